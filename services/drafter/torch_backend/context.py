"""Context K/V handed in as tensors: the block trainer's (many blocks over one precomputed context).

Sessions' context K/V live in the model's pool (``batch_step.py``); this is the ``Segment.context`` the
decoder layers' own forward (``DecoderLayer.forward``) attends to when the trainer supplies the context.
"""

from __future__ import annotations

import torch


class GivenContext:
    """Context K/V ``[N, n_kv, T, hd]`` a block attends to before its own keys (concatenated)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys, self.values = keys, values

    def with_block(self, view, k: torch.Tensor, v: torch.Tensor):
        return torch.cat([self.keys, k], dim=2), torch.cat([self.values, v], dim=2)
