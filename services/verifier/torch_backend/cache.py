"""Torch tensors for the verifier cache; the slot logic lives in ``cache.py``.

Mirrors ``verifier/mlx_backend/cache.py`` exactly:

* :class:`RingKVCache` -- one sliding layer's K/V ring of ``layout.capacity``
  slots (bounded: ``sink + window - 1 + slack``). It writes wherever the
  session's shared :class:`~kakeya.verifier.layout.RingLayout` planned, so a
  trim of up to ``slack`` positions is always exact, even after the ring wrapped.
  ``plan.in_place``: write first, attend over ``ring[:used]``; otherwise attend
  over ``ring[:used] ++ new`` and write afterwards. The mask comes from the plan.
* :class:`FullKVCache` -- a full-attention layer's exact K/V, preallocated
  (``capacity`` positions up front, then doubled when full), so an append is a
  slice copy and a trim is just moving the offset back (O(1)).

The static-shape verify step (``verifier/torch_backend/step.py``) writes differently: it sets
``cache.at = (index, extent)`` -- a device tensor of slots to ``index_copy_``
the new K/V into, and how many slots to attend over -- so a block of L tokens
has the same shapes at every step (the extent is the buffer's capacity when
the step is captured in a CUDA graph), and nothing about the write is decided
on the host inside the step. Buffers never move while ``at`` is in use; the
host grows them (``reserve``) between steps.

Both are ``[1, n_kv_heads, slots, head_dim]``, the layout torch's
``scaled_dot_product_attention`` takes.
"""

from __future__ import annotations

import torch

from kakeya.verifier.layout import RingLayout, ForwardPlan


class RingKVCache:
    """One sliding layer's K/V ring. All rings of a session share one layout."""

    def __init__(self, layout: RingLayout):
        self.layout = layout
        self.plan: ForwardPlan | None = None  # set by the model before each forward
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.at: tuple[torch.Tensor, int] | None = None  # static step: (slots [L], extent)

    @property
    def offset(self) -> int:
        return self.layout.offset

    def _alloc(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        if self.keys is None:
            b, h, _, dk = keys.shape
            cap = self.layout.capacity
            self.keys = keys.new_zeros((b, h, cap, dk))
            self.values = values.new_zeros((b, h, cap, values.shape[-1]))

    def _write(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self._alloc(keys, values)
        for w in self.plan.writes:
            self.keys[:, :, w.dst : w.dst + w.length] = keys[:, :, w.src : w.src + w.length]
            self.values[:, :, w.dst : w.dst + w.length] = values[:, :, w.src : w.src + w.length]

    def update_and_fetch(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.at is not None:  # static step: write first (a block never outgrows the slack), attend over extent
            slots, extent = self.at
            self._alloc(keys, values)
            self.keys.index_copy_(2, slots, keys)
            self.values.index_copy_(2, slots, values)
            return self.keys[:, :, :extent], self.values[:, :, :extent]
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


def grown(cap: int, need: int, step: int, initial: int = 0) -> int:
    """The next capacity for ``need`` positions: ``initial`` if that holds them, else at least double
    (O(log n) moves), in ``step`` chunks when no ``initial`` size was asked for."""
    if cap == 0 and need <= initial:
        return initial
    if initial:
        return max(need, 2 * cap)
    return ((max(need, 2 * cap) + step - 1) // step) * step


class FullKVCache:
    """A full-attention layer's exact K/V: ``capacity`` slots up front, doubled when full, O(1) trims."""

    def __init__(self, step: int = 256, capacity: int = 0):
        if step < 1 or capacity < 0:
            raise ValueError("step must be >= 1 and capacity >= 0")
        self.step, self.initial = step, capacity
        self.offset = 0
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.at: tuple[torch.Tensor, int] | None = None  # static step: (positions [L], extent)

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def reserve(self, n: int, keys: torch.Tensor, values: torch.Tensor) -> bool:
        """Room for ``n`` positions (``keys``/``values``: any K/V of this layer, for shape/dtype);
        True if the buffers moved."""
        cap = self.capacity
        if n <= cap:
            return False
        new_cap = grown(cap, n, self.step, self.initial)
        b, h, _, dk = keys.shape
        nk = keys.new_zeros((b, h, new_cap, dk))
        nv = values.new_zeros((b, h, new_cap, values.shape[-1]))
        if self.offset:
            nk[:, :, : self.offset] = self.keys[:, :, : self.offset]
            nv[:, :, : self.offset] = self.values[:, :, : self.offset]
        self.keys, self.values = nk, nv
        return True

    def update_and_fetch(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.at is not None:  # static step: the host reserved room and advances the offset
            pos, extent = self.at
            self.keys.index_copy_(2, pos, keys)
            self.values.index_copy_(2, pos, values)
            return self.keys[:, :, :extent], self.values[:, :, :extent]
        n = keys.shape[2]
        end = self.offset + n
        self.reserve(end, keys, values)
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

    def __init__(self, bits: int = 8, group_size: int = 64, step: int = 256, capacity: int = 0):
        if bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {bits}")
        self.bits, self.group_size, self.step, self.initial = bits, group_size, step, capacity
        self.offset = 0
        self.keys: list[torch.Tensor] | None = None  # [codes, scales, biases]
        self.values: list[torch.Tensor] | None = None
        self.dtype: torch.dtype | None = None
        self.at: tuple[torch.Tensor, int] | None = None  # static step: (positions [L], extent)

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys[0].shape[2]

    def _alloc(self, like: list[torch.Tensor], cap: int) -> list[torch.Tensor]:
        return [t.new_zeros((*t.shape[:2], cap, t.shape[-1])) for t in like]

    def reserve(self, n: int, keys: torch.Tensor, values: torch.Tensor) -> bool:
        if n <= self.capacity:
            return False
        qk = quantize(keys[:, :, :1], self.group_size, self.bits)
        qv = quantize(values[:, :, :1], self.group_size, self.bits)
        new_cap = grown(self.capacity, n, self.step, self.initial)
        nk, nv = self._alloc(qk, new_cap), self._alloc(qv, new_cap)
        if self.offset:
            for dst, src in zip(nk + nv, self.keys + self.values):
                dst[:, :, : self.offset] = src[:, :, : self.offset]
        self.keys, self.values = nk, nv
        return True

    def update_and_fetch(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.dtype = keys.dtype
        qk = quantize(keys, self.group_size, self.bits)
        qv = quantize(values, self.group_size, self.bits)
        if self.at is not None:  # static step: the host reserved room and advances the offset
            pos, end = self.at
            for dst, src in zip(self.keys + self.values, list(qk) + list(qv)):
                dst.index_copy_(2, pos, src)
        else:
            end = self.offset + keys.shape[2]
            self.reserve(end, keys, values)
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
