"""torch tensors <-> host numpy arrays, for the one tensor codec (``kakeya.wire.codec``).

bfloat16 has no numpy dtype: it crosses as its 16-bit patterns (``bf16=True``).
"""

from __future__ import annotations

import numpy as np
import torch


def owns(array) -> bool:
    return isinstance(array, torch.Tensor)


def to_host(array: torch.Tensor) -> tuple[np.ndarray, str]:
    """A host numpy view of ``array`` (one device-to-host copy for a GPU tensor) and torch's dtype name;
    bfloat16 as its int16 bit patterns."""
    t = array.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    name = str(t.dtype).removeprefix("torch.")
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy(), name
    if t.dtype.is_complex or t.dtype not in _NUMPY_OK:
        return np.empty(0), name  # the codec refuses the name
    return t.resolve_conj().resolve_neg().numpy(), name


def from_host(arr: np.ndarray, bf16: bool, device=None) -> torch.Tensor:
    """A tensor owning a copy of ``arr`` on ``device`` (default CPU); ``bf16``: ``arr`` holds bfloat16 bits."""
    if bf16:
        arr = arr.view(np.int16)  # torch has no general uint16 support; reinterpreted below
    # torch.tensor copies exactly once, straight onto `device` (the message's bytes are immutable,
    # so the result must own its memory anyway).
    out = torch.tensor(arr, device=device)
    return out.view(torch.bfloat16) if bf16 else out


_NUMPY_OK = {torch.float32, torch.float16, torch.float64, torch.bool}  # what .numpy() takes as it is
_NUMPY_OK |= {torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8}
