"""What one MLX forward hands mlx-lm's own decoder layers: per-forward cache views and masks.

mlx-lm's attention reads ``cache.offset`` (the RoPE offset, per batch row) and calls
``cache.update_and_fetch``; our caches hold arrays only, so each forward binds them to its segments'
plans in a short-lived :class:`LayerView` per layer. Sessions go on the batch axis, short blocks padded at
the end: each row's real positions reach its own cache exactly as in its own forward (padding never
does), masks are padded with False (a padded row sees key 0 only and is dropped). Projections, norms,
MLP, MoE and the LM head run once over all rows; attention stays per row. A session's own forward is the
batch of one (mlx-lm's own masks; with f_theta the restored K/V in front of each ring). f_theta and
quantized full-attention caches never batch (``verifier/session.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from kakeya.core.contract import FULL, SLIDING
from kakeya.verifier.backend import Segment
from kakeya.verifier.layout import ForwardPlan
from kakeya.verifier.mlx_backend.cache import QuantizedFullKVCache


class LayerView:
    """One layer's caches of a forward's segments behind the single cache mlx-lm's attention uses."""

    def __init__(self, caches: list, plans: list[ForwardPlan], lengths: list[int], prefixes: list):
        self.caches, self.plans, self.lengths = caches, plans, lengths
        self.prefixes = prefixes  # per segment: restored (K, V) placed before the cache's own, or None

    @property
    def offset(self) -> int | list[int]:
        starts = [p.start for p in self.plans]
        return starts[0] if len(starts) == 1 else starts

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if len(self.caches) == 1:
            return self._fetch(0, keys, values)
        rows = [self._fetch(b, keys[b : b + 1, :, :n], values[b : b + 1, :, :n]) for b, n in enumerate(self.lengths)]
        width = max(k.shape[2] for k, _ in rows)  # = the padded masks' key length
        pad = lambda x: mx.pad(x, [(0, 0), (0, 0), (0, width - x.shape[2]), (0, 0)])
        return tuple(mx.concatenate([pad(kv[j]) for kv in rows], axis=0) for j in (0, 1))

    def _fetch(self, b: int, keys: mx.array, values: mx.array):
        k, v = self.caches[b].fetch(keys, values, self.plans[b])
        if self.prefixes[b] is None:
            return k, v
        pk, pv = self.prefixes[b]
        return mx.concatenate([pk.astype(k.dtype), k], axis=2), mx.concatenate([pv.astype(v.dtype), v], axis=2)


class QuantizedLayerView(LayerView):
    """A quantized full-attention layer's view: mlx-lm's attention sees ``bits`` and takes its quantized path."""

    def __init__(self, caches: list[QuantizedFullKVCache], *args):
        super().__init__(caches, *args)
        self.bits, self.group_size = caches[0].bits, caches[0].group_size


def layer_views(segments: Sequence[Segment], kinds: Sequence[str], restored: list) -> list[LayerView]:
    """One view per cached layer; ``restored``: per segment, each sliding layer's restored (K, V) or None."""
    plans, lengths = [s.plan for s in segments], [len(s.ids) for s in segments]
    views, sliding = [], 0
    for i, kind in enumerate(kinds):
        caches = [s.caches.layers[i] for s in segments]
        prefixes = [None] * len(segments)
        if kind == SLIDING:
            prefixes = [None if r is None else r[sliding] for r in restored]
            sliding += 1
        view = QuantizedLayerView if isinstance(caches[0], QuantizedFullKVCache) else LayerView
        views.append(view(caches, plans, lengths, prefixes))
    return views


def attention_masks(segments: Sequence[Segment], rows: int) -> dict:
    """Per layer type, what the forward's queries attend to."""
    if len(segments) == 1:
        plan = segments[0].plan
        sliding = plan.mask if plan.restore is None else np.concatenate([plan.restore.mask, plan.mask], axis=1)
        return {FULL: None if plan.n_new == 1 else "causal", SLIDING: mx.array(sliding)}
    full = [
        np.arange(p.start + p.n_new)[None, :] <= np.arange(p.start, p.start + p.n_new)[:, None]
        for p in (s.plan for s in segments)
    ]
    return {FULL: mx.array(_padded(full, rows)), SLIDING: mx.array(_padded([s.plan.mask for s in segments], rows))}


def _padded(masks: list[np.ndarray], rows: int) -> np.ndarray:
    keys = max(m.shape[1] for m in masks)
    out = np.zeros((len(masks), 1, rows, keys), dtype=bool)
    out[:, 0, :, 0] = True  # padded query rows: one visible key keeps their softmax finite
    for b, m in enumerate(masks):
        out[b, 0, : m.shape[0]] = False
        out[b, 0, : m.shape[0], : m.shape[1]] = m
    return out
