"""MLX arrays for the verifier caches: :class:`RingKVCache` (a sliding layer's ring, written where the plan
says, so rollback is exact), :class:`FullKVCache` (exact K/V, grown as mlx-lm's ``KVCache`` grows, so
``kakeya memory``'s formula holds; a trim is the layout moving back) and :class:`QuantizedFullKVCache`
(``mx.quantize`` codes, which mlx-lm's quantized attention multiplies directly). They hold arrays only:
mlx-lm's attention gets a per-forward view of them with ``offset`` and ``update_and_fetch`` (``target.LayerView``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from kakeya.verifier.layout import ForwardPlan


class LayerKV:
    """One layer's K/V buffers ``[1, kv_heads, slots, head_dim]`` (None until first written)."""

    keys: Any = None
    values: Any = None

    def arrays(self) -> list:
        """Every buffer this layer holds (a quantized cache holds several per K and V)."""
        return [] if self.keys is None else [self.keys, self.values]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())


def _zeros(like: mx.array, slots: int) -> mx.array:
    return mx.zeros((*like.shape[:2], slots, like.shape[-1]), like.dtype)


class RingKVCache(LayerKV):
    """One sliding layer's K/V ring of ``capacity`` slots; all rings of a session share one layout. Out of place, a
    forward attends over ``ring[:used] ++ new`` and writes after (it would overwrite slots its first queries need)."""

    def __init__(self, capacity: int):
        self.capacity = capacity

    def fetch(self, keys: mx.array, values: mx.array, plan: ForwardPlan):
        """Write this forward's ``keys``/``values`` where ``plan`` says; the K/V its queries attend over."""
        if self.keys is None:
            self.keys, self.values = _zeros(keys, self.capacity), _zeros(values, self.capacity)
        out = None
        if not plan.in_place:  # what the queries see is taken before the write
            out = (keys, values)
            if plan.used:
                out = tuple(
                    mx.concatenate([t[..., : plan.used, :], x], axis=2) for t, x in zip((self.keys, self.values), out)
                )
        for w in plan.writes:
            self.keys[..., w.dst : w.dst + w.length, :] = keys[..., w.src : w.src + w.length, :]
            self.values[..., w.dst : w.dst + w.length, :] = values[..., w.src : w.src + w.length, :]
        return out or (self.keys[..., : plan.used, :], self.values[..., : plan.used, :])

    def load(self, saved: Sequence[mx.array]) -> None:
        """A prefix snapshot's ring (``SessionCaches.copy``), as arrays of this cache's own."""
        self.keys, self.values = (mx.array(a) for a in saved)


class FullKVCache(LayerKV):
    """A full-attention layer's exact K/V."""

    step = 256

    def fetch(self, keys: mx.array, values: mx.array, plan: ForwardPlan):
        """Positions ``plan.start ..``; the K/V of every position up to the forward's last."""
        start, end = plan.start, plan.start + keys.shape[2]
        if self.keys is None or end > self.arrays()[0].shape[2]:
            room = (self.step + keys.shape[2] - 1) // self.step * self.step
            new = [_zeros(t, room) for t in self._stored(keys[..., :1, :]) + self._stored(values[..., :1, :])]
            old = self.arrays()
            self._hold([mx.concatenate([o[..., :start, :], z], axis=2) for o, z in zip(old, new)] if old else new)
        for dst, src in zip(self.arrays(), self._stored(keys) + self._stored(values)):
            dst[..., start:end, :] = src
        return self._view(end)

    def _view(self, end: int):
        return self.keys[..., :end, :], self.values[..., :end, :]

    def load(self, saved: Sequence[mx.array]) -> None:
        """A prefix snapshot's positions (``SessionCaches.copy``), as arrays of this cache's own: the next
        forward writes after them (and grows the buffers, as after any forward that filled them)."""
        self._hold([mx.array(a) for a in saved])

    # -- how K/V are stored (the quantized cache stores codes, scales and biases) ------------

    def _stored(self, x: mx.array) -> list[mx.array]:
        return [x]

    def _hold(self, buffers: list[mx.array]) -> None:
        self.keys, self.values = buffers


class QuantizedFullKVCache(FullKVCache):
    """A full-attention layer's K/V as ``mx.quantize`` codes (4 or 8 bits per group of the head dim)."""

    def __init__(self, group_size: int, bits: int):
        self.group_size, self.bits = group_size, bits

    def arrays(self) -> list[mx.array]:
        return [] if self.keys is None else self.keys + self.values

    def _view(self, end: int):
        return [t[..., :end, :] for t in self.keys], [t[..., :end, :] for t in self.values]

    def _stored(self, x: mx.array) -> list[mx.array]:
        return list(mx.quantize(x, group_size=self.group_size, bits=self.bits))

    def _hold(self, buffers: list[mx.array]) -> None:
        self.keys, self.values = buffers[:3], buffers[3:]


class LatentRing:
    """f_theta latent codes of one session, one row per slot of its own :class:`RingLayout`, which plans, applies and
    trims exactly like the K/V ring's, so rollback stays exact. Allocated whole at the start."""

    def __init__(self, capacity: int, dim: int):
        self.data = mx.zeros((capacity, dim), mx.float32)

    def write(self, plan: ForwardPlan, z: mx.array) -> None:
        z = z.astype(self.data.dtype)
        for w in plan.writes:
            self.data[w.dst : w.dst + w.length] = z[w.src : w.src + w.length]

    def materialize(self) -> None:
        mx.eval(self.data)

    def copy(self) -> mx.array:
        """The codes of every slot, never changed by this ring's later writes (a prefix snapshot)."""
        return mx.array(self.data)

    def load(self, data: mx.array) -> None:
        self.data = mx.array(data)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes
