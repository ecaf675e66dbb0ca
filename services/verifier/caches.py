"""What every backend's verifier caches share: arrays only, written where a forward's plan says.

A session's caches (:class:`SessionCaches`) are one object per layer that has
its own K/V, in layer order: a :class:`RingKV` on sliding layers (bounded, see
``layout.py``) and the backend's full-attention cache (exact or quantized) on
the others. They hold arrays and nothing about a forward: no position counter
(the session's ``RingLayout`` is the only one; a trim moves it back and leaves
the arrays alone) and no plan (every write gets its ``ForwardPlan`` as an
argument). The backends (``mlx_backend/cache.py``, ``torch_backend/cache.py``)
add only their array operations.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kakeya.core.contract import SLIDING
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


class RingKV(LayerKV):
    """One sliding layer's K/V ring of ``capacity`` slots; all rings of a session share one layout.

    ``plan.in_place``: write first, attend over ``ring[:used]``; otherwise attend
    over ``ring[:used] ++ new`` and write afterwards (a forward longer than the
    slack would overwrite slots its own first queries still need).
    """

    def __init__(self, capacity: int):
        self.capacity = capacity

    def fetch(self, keys, values, plan: ForwardPlan) -> tuple[Any, Any]:
        """Write this forward's ``keys``/``values`` where ``plan`` says; the K/V its queries attend over."""
        if plan.in_place:
            self._write(keys, values, plan)
            return self.keys[..., : plan.used, :], self.values[..., : plan.used, :]
        if self.keys is None or plan.used == 0:
            all_k, all_v = keys, values
        else:
            all_k = self.concat([self.keys[..., : plan.used, :], keys])
            all_v = self.concat([self.values[..., : plan.used, :], values])
        self._write(keys, values, plan)
        return all_k, all_v

    def _write(self, keys, values, plan: ForwardPlan) -> None:
        if self.keys is None:
            self.keys, self.values = self.zeros(keys, self.capacity), self.zeros(values, self.capacity)
        for w in plan.writes:
            self.keys[..., w.dst : w.dst + w.length, :] = keys[..., w.src : w.src + w.length, :]
            self.values[..., w.dst : w.dst + w.length, :] = values[..., w.src : w.src + w.length, :]

    # -- the backend's array operations -------------------------------------------------

    @staticmethod
    def zeros(like, slots: int):
        """Zeros shaped like ``like`` [1, heads, *, dim] with ``slots`` slots."""
        raise NotImplementedError

    @staticmethod
    def concat(parts: Sequence):
        """``parts`` joined along the slot axis."""
        raise NotImplementedError


class SessionCaches:
    """A session's caches: one per layer with its own K/V, in layer order (``kinds``: each one's layer type).

    ``batchable``: whether a batched forward may take this set (MLX: not with
    quantized full-attention caches); ``batch_key``: sets of one key may share
    a batched forward (torch: sessions whose full-attention K/V live in one
    pool). A backend may subclass it (torch: pages of the target's pools).
    """

    batch_key: object = None

    def __init__(self, layers: list, kinds: Sequence[str], batchable: bool = True):
        self.layers = layers
        self.kinds = list(kinds)
        self.rings = [c for c, kind in zip(layers, kinds) if kind == SLIDING]
        self.fulls = [c for c, kind in zip(layers, kinds) if kind != SLIDING]
        self.batchable = batchable

    def arrays(self) -> list:
        return [a for c in self.layers for a in c.arrays()]

    def kv_bytes(self) -> dict:
        return {"sliding": sum(c.nbytes for c in self.rings), "full": sum(c.nbytes for c in self.fulls)}

    def copy(self, positions: int, copy: Callable) -> list[list]:
        """Every layer's arrays as they hold positions ``< positions``, each through the backend's ``copy``:
        a ring whole (its slots hold what the layout says), a full-attention cache's first ``positions``
        (its buffers may be longer). What a prefix snapshot keeps (``verifier/snapshot.py``)."""
        return [
            [copy(a) if kind == SLIDING else copy(a[:, :, :positions]) for a in layer.arrays()]
            for layer, kind in zip(self.layers, self.kinds)
        ]
