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


def quantize(x: torch.Tensor, group_size: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Affine per-group quantization of the last dim, the same rule as ``mx.quantize``.

    Returns ``(codes, scales, biases)``: codes uint8 ``[..., D * bits / 8]`` (two
    4-bit codes per byte), scales/biases ``[..., D / group_size]`` in ``x.dtype``;
    ``x ~= code * scale + bias``. One end of each group's range is represented
    exactly (the one with the larger magnitude), as in MLX.
    """
    *lead, D = x.shape
    if D % group_size:
        raise ValueError(f"head dim {D} is not a multiple of the quantization group size {group_size}")
    g = x.float().reshape(*lead, D // group_size, group_size)
    n_bins = 2**bits - 1
    w_max, w_min = g.amax(-1, keepdim=True), g.amin(-1, keepdim=True)
    neg = w_min.abs() > w_max.abs()
    scales = torch.clamp((w_max - w_min) / n_bins, min=1e-7)
    scales = torch.where(neg, scales, -scales)
    edge = torch.where(neg, w_min, w_max)
    q0 = torch.round(edge / scales)
    scales = torch.where(q0 != 0, edge / q0, scales)
    biases = torch.where(q0 == 0, torch.zeros_like(edge), edge)
    codes = torch.clamp(torch.round((g - biases) / scales), 0, n_bins).to(torch.uint8).reshape(*lead, D)
    if bits == 4:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return codes, scales.squeeze(-1).to(x.dtype), biases.squeeze(-1).to(x.dtype)


def dequantize(codes, scales, biases, group_size: int, bits: int, dtype: torch.dtype) -> torch.Tensor:
    if bits == 4:
        codes = torch.stack([codes & 15, codes >> 4], dim=-1).flatten(-2)
    *lead, D = codes.shape
    g = codes.float().reshape(*lead, D // group_size, group_size)
    out = g * scales.float().unsqueeze(-1) + biases.float().unsqueeze(-1)
    return out.reshape(*lead, D).to(dtype)


class QuantizedFullKVCache:
    """A full-attention layer's K/V, affine-quantized (4 or 8 bits) per group of the head dim.

    Same O(1) trim and chunked growth as :class:`FullKVCache`; the attended
    prefix is dequantized to the compute dtype on fetch. (MLX's
    ``QuantizedKVCache`` stores the same codes; it multiplies them inside its
    quantized matmuls instead.)
    """

    def __init__(self, bits: int = 8, group_size: int = 64, step: int = 256):
        if bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {bits}")
        self.bits, self.group_size, self.step = bits, group_size, step
        self.offset = 0
        self.keys: list[torch.Tensor] | None = None  # [codes, scales, biases]
        self.values: list[torch.Tensor] | None = None
        self.dtype: torch.dtype | None = None

    def _alloc(self, like: list[torch.Tensor], cap: int) -> list[torch.Tensor]:
        return [t.new_zeros((*t.shape[:2], cap, t.shape[-1])) for t in like]

    def update_and_fetch(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.dtype = keys.dtype
        qk = quantize(keys, self.group_size, self.bits)
        qv = quantize(values, self.group_size, self.bits)
        n = keys.shape[2]
        end = self.offset + n
        cap = 0 if self.keys is None else self.keys[0].shape[2]
        if end > cap:
            new_cap = ((end + self.step - 1) // self.step) * self.step
            nk, nv = self._alloc(qk, new_cap), self._alloc(qv, new_cap)
            if self.offset:
                for dst, src in zip(nk + nv, self.keys + self.values):
                    dst[:, :, : self.offset] = src[:, :, : self.offset]
            self.keys, self.values = nk, nv
        for dst, src in zip(self.keys + self.values, list(qk) + list(qv)):
            dst[:, :, self.offset : end] = src
        self.offset = end
        k = dequantize(*(t[:, :, :end] for t in self.keys), self.group_size, self.bits, keys.dtype)
        v = dequantize(*(t[:, :, :end] for t in self.values), self.group_size, self.bits, values.dtype)
        return k, v

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)
