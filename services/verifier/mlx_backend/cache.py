"""MLX arrays for the verifier cache; the slot logic lives in ``cache.py``.

``RingKVCache`` is a drop-in for what mlx-lm's Gemma-4 attention expects from
a cache (``offset`` read before ``update_and_fetch``), but writes wherever the
session's shared :class:`RingLayout` planned, so rollback is always exact.
Full-attention layers use mlx-lm's own ``KVCache``: it trims in O(1).
"""

from __future__ import annotations

import mlx.core as mx

from kakeya.verifier.layout import RingLayout, ForwardPlan


class RingKVCache:
    """One sliding layer's K/V ring. All rings of a session share one layout."""

    def __init__(self, layout: RingLayout):
        self.layout = layout
        self.plan: ForwardPlan | None = None  # set by the session before each forward
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        # f_theta: restored K/V [1, kv_heads, slots, head_dim] (RoPE applied) placed in front of the
        # ring's own for one forward; set by the model before it, cleared after (None: no restoration)
        self.prefix: tuple[mx.array, mx.array] | None = None

    @property
    def offset(self) -> int:
        return self.layout.offset

    def _write(self, keys: mx.array, values: mx.array) -> None:
        if self.keys is None:
            b, h, _, dk = keys.shape
            cap = self.layout.capacity
            self.keys = mx.zeros((b, h, cap, dk), keys.dtype)
            self.values = mx.zeros((b, h, cap, values.shape[-1]), values.dtype)
        for w in self.plan.writes:
            self.keys[..., w.dst : w.dst + w.length, :] = keys[..., w.src : w.src + w.length, :]
            self.values[..., w.dst : w.dst + w.length, :] = values[..., w.src : w.src + w.length, :]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        k, v = self._fetch(keys, values)
        if self.prefix is None:
            return k, v
        pk, pv = self.prefix
        return mx.concatenate([pk.astype(k.dtype), k], axis=2), mx.concatenate([pv.astype(v.dtype), v], axis=2)

    def _fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        plan = self.plan
        if plan.in_place:
            self._write(keys, values)
            return self.keys[..., : plan.used, :], self.values[..., : plan.used, :]
        if self.keys is None or plan.used == 0:
            all_k, all_v = keys, values
        else:
            all_k = mx.concatenate([self.keys[..., : plan.used, :], keys], axis=2)
            all_v = mx.concatenate([self.values[..., : plan.used, :], values], axis=2)
        self._write(keys, values)
        return all_k, all_v

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes



class LatentRing:
    """f_theta latent codes of one session, one row per slot of its own :class:`RingLayout`.

    The layout (sink 0, the model's window, the session's slack) plans, applies
    and trims exactly like the K/V ring's, so rollback stays exact; rows are
    written after each forward, from that forward's aux. Allocated whole at the
    start: its size never changes.
    """

    def __init__(self, layout: RingLayout, dim: int):
        self.layout = layout
        self.data = mx.zeros((layout.capacity, dim), mx.float32)

    def write(self, plan: ForwardPlan, z: mx.array) -> None:
        z = z.astype(self.data.dtype)
        for w in plan.writes:
            self.data[w.dst : w.dst + w.length] = z[w.src : w.src + w.length]

    def materialize(self) -> None:
        mx.eval(self.data)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes
