"""One torch forward over several sessions' blocks: flattened tokens, per-session attention.

vLLM-style: the blocks of N sessions are concatenated along the sequence axis
(``[1, sum L, hidden]``), so everything that works row by row -- embeddings,
per-layer inputs, norms, the q/k/v/o projections, RoPE (each row at its own
position), the dense MLP, the MoE router and experts, and later the LM head --
runs ONCE for all sessions: one pass over the weights instead of N. Only
attention is per session: each segment of rows writes its own session's caches
(exactly as that session's own forward would) and attends over them with its
own mask. A session therefore sees the same numbers as alone, up to the
floating-point order of a matmul over more rows.

The layer pieces are ``gemma4_torch``'s own (``Attention.project``/``output``,
``DecoderLayer.after_attention``); only the short layer loop is spelled here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from kakeya.backends.torch.ops import gemma4_rms_norm, sdpa_backends
from kakeya.verifier.torch_backend.gemma4 import Forward, Gemma4Text


@dataclass
class Segment:
    """One session's block in a batched forward (what ``Gemma4Text.forward`` takes for one session)."""

    ids: torch.Tensor  # [1, L]
    cache: Sequence  # the session's per-layer caches, planned for this block
    aux_layers: Sequence[int]
    masks: dict  # layer type -> bool [L, keys] or None, as for the session's own forward
    pos: torch.Tensor  # [L] absolute positions


def forward_batch(model: Gemma4Text, segments: Sequence[Segment]) -> list[Forward]:
    """Run every segment's block through the body in one pass; one ``Forward`` per segment, in order."""
    with sdpa_backends():
        return _forward(model, segments)


def _forward(model: Gemma4Text, segs: Sequence[Segment]) -> list[Forward]:
    spans, a = [], 0
    for s in segs:
        spans.append((a, a + s.ids.shape[1]))
        a += s.ids.shape[1]
    ids = torch.cat([s.ids for s in segs], dim=1)
    x = F.embedding(ids, model.embed)
    x = x * model.scalars(x.dtype, x.device)[0]
    pli = model.per_layer_inputs(ids, x) if model.ple else None
    rope = model.rope(torch.cat([s.pos for s in segs]), x.dtype)
    wanted = {i for s in segs for i in s.aux_layers}
    saved: dict[int, torch.Tensor] = {}
    kvs: list = [None] * len(model.layers)  # per layer: each segment's (k, v), for KV-shared layers
    n_cached = model.args.n_cached
    for i, layer in enumerate(model.layers):
        t = layer.layer_type
        cos, sin = rope[t]
        shared = kvs[model.previous_kvs[i]] if i >= n_cached else None
        q, k, v = layer.qkv(x, cos, sin, shared is None)
        outs, kvs[i] = [], []
        for j, ((lo, hi), s) in enumerate(zip(spans, segs)):
            if shared is not None:
                kj, vj = shared[j]
            else:
                kj, vj = s.cache[i].update_and_fetch(k[:, :, lo:hi], v[:, :, lo:hi])
            kvs[i].append((kj, vj))
            outs.append(layer.attn.attend(q[:, :, lo:hi], kj, vj, s.masks[t], 1.0))
        a = layer.attn.output(outs[0] if len(outs) == 1 else torch.cat(outs, dim=2))
        x = layer.after_attention(x, a, None if pli is None else pli[:, :, i])
        if i in wanted:
            saved[i] = x
    hidden = gemma4_rms_norm(x, model.norm, model.args.rms_norm_eps)
    out = []
    for (lo, hi), s in zip(spans, segs):
        aux = torch.cat([saved[i][0, lo:hi] for i in s.aux_layers], dim=-1) if s.aux_layers else None
        out.append(Forward(hidden[:, lo:hi], aux))
    return out
