"""What differs between the torch forwards: where each layer's K/V go and what its queries see.

``Gemma4Text.forward`` is the one layer loop; each forward hands it one of these
(an ``Attend``), built for that forward from its arguments and dropped after it:

* :class:`SegmentAttention` -- the dynamic forward of one or more sessions'
  blocks (vLLM-style: concatenated along the sequence axis, ``[1, sum L,
  hidden]``). Everything row-wise -- embeddings, per-layer inputs, norms,
  q/k/v/o projections, RoPE (each row at its own position), MLP, MoE, later the
  LM head -- runs once for all sessions; only attention is per segment: its
  rows write its own session's caches as its plan says and attend over them
  with its own masks. A session's own forward is the one-segment case, so a
  session sees the same numbers batched as alone, up to the floating-point
  order of a matmul over more rows.
* :class:`IndexedAttention` -- K/V written at device index tensors and
  attended over fixed extents: the static verify step (``step.py``; shapes
  that only depend on the bucket, so CUDA graphs can capture it) and the plain
  reference decode (``TargetTorch.greedy_reference``).
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
