"""How much memory a torch device has free: what a CUDA server's ``--prefix-cache-bytes auto`` is a share of
(``runtime/spare.py``), its snapshots living beside the model on the device."""

from __future__ import annotations

import torch


def device_free_bytes(device: str) -> int | None:
    """The free memory of a CUDA ``device`` now (``torch.cuda.mem_get_info``); None for any other device."""
    d = torch.device(device)
    if d.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(d)
    return int(free)
