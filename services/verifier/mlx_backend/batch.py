"""One MLX forward over several sessions' blocks, through mlx-lm's own decoder layers.

mlx-lm's Gemma-4 attention takes one cache per layer and reads ``cache.offset``
as the RoPE offset, which ``mx.fast.rope`` accepts per batch row. So sessions go
on the BATCH axis (``[B, Lmax, hidden]``, short blocks padded at the end) and
each layer gets a :class:`_Rows` cache adapter: its ``offset`` is every
session's own, and ``update_and_fetch`` hands each row's real positions to that
session's own cache (written exactly as in its own forward -- padding never
reaches a cache) and returns the K/V padded to a common key length. The masks
are each session's own, padded with False (a padded query row sees key 0 only,
so it stays finite; its outputs are dropped). Projections, norms, MLP, MoE
and the LM head run once over all rows; attention stays per row.

Not batched (they run alone, see ``batch.py``): f_theta restoration and
quantized full-attention caches (mlx-lm's quantized attention reads the
cache's packed tuples, which this adapter does not pad).
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import numpy as np

from kakeya.core.contract import FULL, SLIDING
from kakeya.verifier.mlx_backend.cache import RingKVCache


class _Rows:
    """One layer's caches of B sessions behind the single-cache interface mlx-lm's attention uses."""

    def __init__(self, caches: list, lengths: list[int], keys: int):
        self.caches, self.lengths, self.keys = caches, lengths, keys

    @property
    def offset(self) -> list[int]:
        return [c.offset for c in self.caches]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        ks, vs = [], []
        for b, (c, n) in enumerate(zip(self.caches, self.lengths)):
            k, v = c.update_and_fetch(keys[b : b + 1, :, :n], values[b : b + 1, :, :n])
            pad = [(0, 0), (0, 0), (0, self.keys - k.shape[2]), (0, 0)]
            ks.append(mx.pad(k, pad))
            vs.append(mx.pad(v, pad))
        return mx.concatenate(ks, axis=0), mx.concatenate(vs, axis=0)


def _padded(masks: list[np.ndarray], rows: int) -> np.ndarray:
    keys = max(m.shape[1] for m in masks)
    out = np.zeros((len(masks), 1, rows, keys), dtype=bool)
    out[:, 0, :, 0] = True  # padded query rows: one visible key keeps their softmax finite
    for b, m in enumerate(masks):
        out[b, 0, : m.shape[0]] = False
        out[b, 0, : m.shape[0], : m.shape[1]] = m
    return out


def forward_batch(target, blocks: Sequence[tuple]) -> list:
    """``blocks`` of ``(ids, cache, aux_layers, plan)``; one ``(hidden [1, L, H], aux [L, A])`` per block, in order."""
    inner = target.inner
    lengths = [len(ids) for ids, *_ in blocks]
    rows = max(lengths)
    ids = mx.array([list(i) + [0] * (rows - len(i)) for i, *_ in blocks])
    full_masks, sliding_masks = [], []
    for (_, cache, _, plan), n in zip(blocks, lengths):
        start = None
        for c in cache:
            if isinstance(c, RingKVCache):
                c.plan = plan
            start = c.offset if start is None else start
        start = start or 0
        full_masks.append(np.arange(start + n)[None, :] <= np.arange(start, start + n)[:, None])
        sliding_masks.append(plan.mask)
    masks = {FULL: _padded(full_masks, rows), SLIDING: _padded(sliding_masks, rows)}
    n_cached = target.n_cached
    caches = [_Rows([b[1][i] for b in blocks], lengths, masks[target.layer_types[i]].shape[-1]) for i in range(n_cached)]
    masks = {t: mx.array(m) for t, m in masks.items()}

    h = inner.embed_tokens(ids) * inner.embed_scale
    per_layer = [None] * len(inner.layers)
    if inner.hidden_size_per_layer_input:
        pli = inner._project_per_layer_inputs(h, inner._get_per_layer_inputs(ids))
        per_layer = [pli[:, :, i, :] for i in range(len(inner.layers))]
    caches += [None] * (len(inner.layers) - n_cached)
    wanted = {i for _, _, aux, _ in blocks for i in aux}
    saved = {}
    intermediates = [(None, None)] * len(inner.layers)
    for idx, layer in enumerate(inner.layers):
        kvs, offset = intermediates[inner.previous_kvs[idx]]
        h, kvs, offset = layer(h, masks[layer.layer_type], caches[idx], per_layer_input=per_layer[idx], shared_kv=kvs, offset=offset)
        intermediates[idx] = (kvs, offset)
        if idx in wanted:
            saved[idx] = h
    hidden = inner.norm(h)
    out = []
    for b, ((_, _, aux, _), n) in enumerate(zip(blocks, lengths)):
        rows_aux = mx.concatenate([saved[i][b, :n] for i in aux], axis=-1) if aux else None
        out.append((hidden[b : b + 1, :n], rows_aux))
    return out
