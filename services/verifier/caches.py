"""What every backend's verifier caches share: arrays only, written where a forward's plan says.

A session's caches (:class:`SessionCaches`) are one object per layer that has its own K/V, in layer
order: a ring on sliding layers (bounded, see ``layout.py``) and a full-attention cache (exact or
quantized) on the others (MLX: ``mlx_backend/cache.py``; torch: pages of its pools, ``pool.py``). They
hold arrays and nothing about a forward: no position counter (the session's ``RingLayout`` is the only
one; a trim moves it back and leaves the arrays alone) and no plan (each write gets its ``ForwardPlan``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kakeya.core.contract import SLIDING


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


class SessionCaches:
    """A session's caches: one per layer with its own K/V, in layer order (``kinds``: each one's layer type).
    ``batchable``: whether a batched forward may take this set (MLX: not with quantized full caches);
    ``batch_key``: sets of one key may share one (torch: full-attention K/V in one pool)."""

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
