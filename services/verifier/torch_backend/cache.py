"""Per-session torch caches and the affine quantization of full-attention K/V.

A served session's K/V are pages of its target's pools (``pool.py``, which stores quantized full K/V with
:func:`quantize` / :func:`dequantize` here). These per-session classes are what the plain reference decode
(``TargetTorch.greedy_reference``) keeps, with the semantics the pools keep: :class:`RingKVCache` (a
sliding layer's ring of ``sink + window - 1 + slack`` slots, written where the plan says, so a trim of up
to ``slack`` is exact past wraps), :class:`FullKVCache` (exact K/V, doubled when full; a trim is the layout
moving back) and :class:`QuantizedFullKVCache` (the same, affine 4/8 bits). All are
``[1, n_kv_heads, slots, head_dim]``, as ``scaled_dot_product_attention`` takes them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kakeya.verifier.caches import LayerKV, RingKV
from kakeya.verifier.layout import ForwardPlan


def _zeros(like: torch.Tensor, slots: int) -> torch.Tensor:
    return like.new_zeros((*like.shape[:2], slots, like.shape[-1]))


class RingKVCache(RingKV):
    """One sliding layer's K/V ring."""

    zeros = staticmethod(_zeros)

    @staticmethod
    def concat(parts: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat(list(parts), dim=2)


def grown(cap: int, need: int, step: int, initial: int = 0) -> int:
    """The next capacity for ``need`` positions: ``initial`` if that holds them, else at least double
    (O(log n) moves), in ``step`` chunks when no ``initial`` size was asked for."""
    if cap == 0 and need <= initial:
        return initial
    if initial:
        return max(need, 2 * cap)
    return ((max(need, 2 * cap) + step - 1) // step) * step


class FullKVCache(LayerKV):
    """A full-attention layer's exact K/V: ``capacity`` slots up front, doubled when full."""

    def __init__(self, step: int = 256, capacity: int = 0):
        if step < 1 or capacity < 0:
            raise ValueError("step must be >= 1 and capacity >= 0")
        self.step, self.initial = step, capacity

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.arrays()[0].shape[2]

    def reserve(self, n: int, keep: int, keys: torch.Tensor, values: torch.Tensor) -> bool:
        """Room for ``n`` positions, the first ``keep`` kept (``keys``/``values``: any K/V of this layer,
        for shape and dtype); True if the buffers moved."""
        cap = self.capacity
        if n <= cap:
            return False
        old, cap = self.arrays(), grown(cap, n, self.step, self.initial)
        new = [_zeros(t, cap) for t in self._stored(keys[:, :, :1]) + self._stored(values[:, :, :1])]
        for dst, src in zip(new, old):
            dst[:, :, :keep] = src[:, :, :keep]
        self._hold(new)
        return True

    def fetch(self, keys: torch.Tensor, values: torch.Tensor, plan: ForwardPlan) -> tuple[torch.Tensor, torch.Tensor]:
        return self.write(plan.start, keys, values)

    def write(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions ``start ..`` of a dynamic forward; the K/V of every position up to its last."""
        end = start + keys.shape[2]
        self.reserve(end, start, keys, values)
        for dst, src in zip(self.arrays(), self._stored(keys) + self._stored(values)):
            dst[:, :, start:end] = src
        return self._view(end, keys.dtype)

    def fetch_at(self, positions: torch.Tensor, extent: int, keys: torch.Tensor, values: torch.Tensor):
        """Static step: ``keys``/``values`` at ``positions`` (the host reserved room), then the first
        ``extent`` positions."""
        self.keys.index_copy_(2, positions, keys)
        self.values.index_copy_(2, positions, values)
        return self.keys[:, :, :extent], self.values[:, :, :extent]

    def _view(self, extent: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[:, :, :extent], self.values[:, :, :extent]

    # -- how K/V are stored (the quantized cache stores codes, scales and biases) ------------

    def _stored(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [x]

    def _hold(self, buffers: list[torch.Tensor]) -> None:
        self.keys, self.values = buffers


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


class QuantizedFullKVCache(FullKVCache):
    """A full-attention layer's K/V, affine-quantized (4 or 8 bits) per group of the head dim.

    Same growth and O(1) trims as :class:`FullKVCache`; the attended prefix is
    dequantized to the compute dtype on fetch. (MLX's quantized cache stores the
    same codes; it multiplies them inside its quantized matmuls instead.)
    """

    def __init__(self, bits: int = 8, group_size: int = 64, step: int = 256, capacity: int = 0):
        if bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {bits}")
        super().__init__(step, capacity)
        self.bits, self.group_size = bits, group_size

    def arrays(self) -> list[torch.Tensor]:
        return [] if self.keys is None else self.keys + self.values

    def _view(self, extent: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        k = dequantize(*(t[:, :, :extent] for t in self.keys), self.group_size, self.bits, dtype)
        v = dequantize(*(t[:, :, :extent] for t in self.values), self.group_size, self.bits, dtype)
        return k, v

    def _stored(self, x: torch.Tensor) -> list[torch.Tensor]:
        return list(quantize(x, self.group_size, self.bits))

    def _hold(self, buffers: list[torch.Tensor]) -> None:
        self.keys, self.values = buffers[:3], buffers[3:]
