"""Torch tensors for the verifier cache; the slot logic lives in ``cache.py``.

Mirrors ``cache_mlx.py`` exactly:

* :class:`RingKVCache` -- one sliding layer's K/V ring of ``layout.capacity``
  slots (bounded: ``sink + window - 1 + slack``). It writes wherever the
  session's shared :class:`~services.verifier.cache.RingLayout` planned, so a
  trim of up to ``slack`` positions is always exact, even after the ring wrapped.
  ``plan.in_place``: write first, attend over ``ring[:used]``; otherwise attend
  over ``ring[:used] ++ new`` and write afterwards. The mask comes from the plan.
* :class:`FullKVCache` -- a full-attention layer's exact K/V, preallocated in
  chunks of ``step`` positions, so an append is a slice copy and a trim is just
  moving the offset back (O(1)).

Both are ``[1, n_kv_heads, slots, head_dim]``, the layout torch's
``scaled_dot_product_attention`` takes.
"""

from __future__ import annotations

import torch

from .cache import RingLayout, RingPlan


class RingKVCache:
    """One sliding layer's K/V ring. All rings of a session share one layout."""

    def __init__(self, layout: RingLayout):
        self.layout = layout
        self.plan: RingPlan | None = None  # set by the model before each forward
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    @property
    def offset(self) -> int:
        return self.layout.offset

    def _write(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        if self.keys is None:
            b, h, _, dk = keys.shape
            cap = self.layout.capacity
            self.keys = keys.new_zeros((b, h, cap, dk))
            self.values = values.new_zeros((b, h, cap, values.shape[-1]))
        for w in self.plan.writes:
            self.keys[:, :, w.dst : w.dst + w.length] = keys[:, :, w.src : w.src + w.length]
            self.values[:, :, w.dst : w.dst + w.length] = values[:, :, w.src : w.src + w.length]

    def update_and_fetch(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        plan = self.plan
        if plan is None:
            raise RuntimeError("ring cache has no plan for this forward")
        if plan.in_place:
            self._write(keys, values)
            return self.keys[:, :, : plan.used], self.values[:, :, : plan.used]
        if self.keys is None or plan.used == 0:
            all_k, all_v = keys, values
        else:
            all_k = torch.cat([self.keys[:, :, : plan.used], keys], dim=2)
            all_v = torch.cat([self.values[:, :, : plan.used], values], dim=2)
        self._write(keys, values)
        return all_k, all_v

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


class FullKVCache:
    """A full-attention layer's exact K/V: grows in chunks, trims in O(1)."""

    def __init__(self, step: int = 256):
        if step < 1:
            raise ValueError("step must be >= 1")
        self.step = step
        self.offset = 0
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def _reserve(self, n: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        cap = 0 if self.keys is None else self.keys.shape[2]
        if n <= cap:
            return
        new_cap = ((n + self.step - 1) // self.step) * self.step
        b, h, _, dk = keys.shape
        nk = keys.new_zeros((b, h, new_cap, dk))
        nv = values.new_zeros((b, h, new_cap, values.shape[-1]))
        if self.offset:
            nk[:, :, : self.offset] = self.keys[:, :, : self.offset]
            nv[:, :, : self.offset] = self.values[:, :, : self.offset]
        self.keys, self.values = nk, nv

    def update_and_fetch(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = keys.shape[2]
        end = self.offset + n
        self._reserve(end, keys, values)
        self.keys[:, :, self.offset : end] = keys
        self.values[:, :, self.offset : end] = values
        self.offset = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()
