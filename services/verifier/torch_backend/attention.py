"""The ``Attend`` callables of the torch forwards that are not the batched step (``batch_step.PooledAttention``).

``Gemma4Text.forward`` is the one layer loop; each forward hands it an ``Attend``: :class:`SegmentAttention`
for sessions' blocks the step cannot take (a prefill chunk longer than the ring's slack: row-wise ops once
for all segments, attention per segment over its own pages, ``pool.PooledRing`` / ``pool.PooledFull``), and
:class:`IndexedAttention` over per-layer :class:`FullKVCache` for the plain reference decode
(``TargetTorch.greedy_reference``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kakeya.verifier.backend import Forward, Segment


class SegmentAttention:
    """Each segment's rows attend over its own session's caches, written as its plan says."""

    def __init__(self, segments: Sequence[Segment], masks: Sequence[dict]):
        self.segments, self.masks = segments, masks  # masks: per segment, layer type -> bool [L, keys] or None
        self.spans, at = [], 0
        for s in segments:
            self.spans.append((at, at + len(s.ids)))
            at += len(s.ids)

    def __call__(self, i: int, layer, q: torch.Tensor, k, v, shared):
        outs, kvs = [], []  # kvs: each segment's fetched (k, v), for the KV-shared layers after this one
        for j, (s, (lo, hi)) in enumerate(zip(self.segments, self.spans)):
            kv = shared[j] if shared is not None else s.caches.layers[i].fetch(k[:, :, lo:hi], v[:, :, lo:hi], s.plan)
            kvs.append(kv)
            outs.append(layer.attn.attend(q[:, :, lo:hi], *kv, self.masks[j][layer.layer_type], 1.0))
        return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)), kvs

    def split(self, hidden: torch.Tensor, saved: dict[int, torch.Tensor]) -> list[Forward]:
        """The body's outputs cut back into one :class:`Forward` per segment."""
        out = []
        for s, (lo, hi) in zip(self.segments, self.spans):
            aux = torch.cat([saved[i][0, lo:hi] for i in s.aux_layers], dim=-1) if s.aux_layers else None
            out.append(Forward(hidden[:, lo:hi], aux))
        return out


class IndexedAttention:
    """Every layer of a kind writes its K/V at one index tensor and attends over one extent.

    ``where``: layer type -> ``(index [L] on the device, extent)``, ``masks``: layer
    type -> bool ``[L, extent]`` or None; ``caches``: one per layer with its own K/V.
    """

    def __init__(self, caches: Sequence, where: dict, masks: dict):
        self.caches, self.where, self.masks = caches, where, masks

    def __call__(self, i: int, layer, q: torch.Tensor, k, v, shared):
        t = layer.layer_type
        kv = shared if shared is not None else self.caches[i].fetch_at(*self.where[t], k, v)
        return layer.attn.attend(q, *kv, self.masks[t], 1.0), kv


class FullKVCache:
    """One layer's exact K/V of every position ``[1, kv_heads, slots, head_dim]``, grown in 256-slot steps
    to at least double (O(log n) moves): the plain reference decode's, no ring, no pool."""

    keys = values = None

    def reserve(self, n: int, keep: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Room for ``n`` positions, the first ``keep`` kept (``keys``/``values``: this layer's, for shape)."""
        cap = 0 if self.keys is None else self.keys.shape[2]
        if n <= cap:
            return
        size = (max(n, 2 * cap) + 255) // 256 * 256
        new = [t.new_zeros((*t.shape[:2], size, t.shape[-1])) for t in (keys, values)]
        if self.keys is not None:
            new[0][:, :, :keep], new[1][:, :, :keep] = self.keys[:, :, :keep], self.values[:, :, :keep]
        self.keys, self.values = new

    def fetch_at(self, positions: torch.Tensor, extent: int, keys: torch.Tensor, values: torch.Tensor):
        """``keys``/``values`` written at ``positions`` (room reserved), then the first ``extent`` positions."""
        self.keys.index_copy_(2, positions, keys)
        self.values.index_copy_(2, positions, values)
        return self.keys[:, :, :extent], self.values[:, :, :extent]
