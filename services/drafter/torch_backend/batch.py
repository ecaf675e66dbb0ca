"""Several drafter sessions' work as ONE torch forward (the model side of ``batch.py``).

Sessions' rows are flattened along the sequence axis (vLLM's layout): every
row-wise op -- the embedding, norms, q/k/v/o projections, MLP, ``fc`` and the
LM head -- runs once over all rows, each row's RoPE at its own session's
position. Only attention is per session: each segment of query rows attends to
its own session's context cache exactly as its own forward does
(``LayerKV.with_block``: scratch rows after the context, the same key span and
mask), so a session drafts in a batch what it drafts alone.

Functions take the model (``dflash_torch.DFlashDraftModel``) as their first
argument; they read its layers but import nothing from it.
"""

from __future__ import annotations

import torch

from kakeya.backends.torch.ops import sdpa, sdpa_backends
from kakeya.drafter.context import block_mask, draft_rows


def _rope(model, spans: list[tuple[int, int]]):
    """cos/sin rows for each ``(start, n)`` span, concatenated (each span's table is what its own
    forward builds, so the numbers are the same)."""
    tables = [model._cos_sin(start, n) for start, n in spans]
    if len(tables) == 1:
        return tables[0]
    return torch.cat([c for c, _ in tables]), torch.cat([s for _, s in tables])


@torch.inference_mode()
def extend(model, caches: list, auxs: list[torch.Tensor]) -> None:
    """Append each ``auxs[i]`` ([n_i, aux_width], the next positions) to ``caches[i]``.

    ``fc``, ``hidden_norm`` and every layer's k/v projection run once over all
    sessions' new rows; each session then appends its own slice.
    """
    work = [(c, a) for c, a in zip(caches, auxs) if a.shape[-2]]
    if not work:
        return
    aux = torch.cat([a.reshape(-1, a.shape[-1]) for _, a in work])
    h = model.hidden_norm(model.fc(aux.to(device=model.device, dtype=model.dtype)[None]))
    cos, sin = _rope(model, [(c.length, a.shape[-2]) for c, a in work])
    kv = model.layers_kv(h, cos, sin)
    at = 0
    for cache, a in work:
        n = a.shape[-2]
        cache.append([(k[:, :, at : at + n], v[:, :, at : at + n]) for k, v in kv])
        at += n


def _attention(layer, x: torch.Tensor, segments: list, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """One layer over flattened sessions: ``segments`` = (layer K/V, view, mask, rows) each."""
    q, k, v = layer.project(x, cos, sin)
    outs, at = [], 0
    for ctx, view, mask, n in segments:
        ks, vs = ctx.with_block(view, k[:, :, at : at + n], v[:, :, at : at + n])
        outs.append(sdpa(q[:, :, at : at + n], ks, vs, mask, layer.self_attn.scale))
        at += n
    return layer.finish(x, outs[0] if len(outs) == 1 else torch.cat(outs, dim=2))


@torch.inference_mode()
def hidden(model, blocks: list[tuple[object, list[int]]]) -> torch.Tensor:
    """Final-norm hidden ``[sum B_i, hidden]`` of every ``(cache, block ids)`` in ONE forward."""
    if model.target is None:
        raise RuntimeError("drafter is not bound to a target embedding/LM head")
    sizes = [len(ids) for _, ids in blocks]
    ids = torch.tensor([t for _, b in blocks for t in b], dtype=torch.long).to(model.device, non_blocking=True)
    x = model.target.embed_rows(ids).to(model.dtype)
    if model.config.input_embedding_scale != 1.0:
        x = x * model.config.input_embedding_scale
    x = x[None]
    cos, sin = _rope(model, [(c.length, n) for (c, _), n in zip(blocks, sizes)])
    views = [c.plan.block(n, scratch=True) for (c, _), n in zip(blocks, sizes)]
    masks: dict = {}
    with sdpa_backends():
        for i, layer in enumerate(model.layers):
            attn, segments = layer.self_attn, []
            for s, ((cache, _), n) in enumerate(zip(blocks, sizes)):
                ctx = cache.layers[i]
                view, key = views[s][ctx.layout], (s, ctx.layout, attn.is_causal)
                if key not in masks:
                    m = block_mask(view, n, is_causal=attn.is_causal, window=attn.window)
                    masks[key] = None if m is None else torch.from_numpy(m).to(model.device, non_blocking=True)
                segments.append((ctx, view, masks[key], n))
            x = _attention(layer, x, segments, cos, sin)
    return model.norm(x[0])


@torch.inference_mode()
def logits(model, blocks: list[tuple[object, int, int]]) -> torch.Tensor:
    """Logits ``[sum (B_i - 1), vocab]`` of every ``(cache, last_token, block_size)`` block's
    positions ``1..B_i-1``, in order, from one forward and one LM head call."""
    mask_id = model.config.mask_token_id
    h = hidden(model, [(c, [last] + [mask_id] * (size - 1)) for c, last, size in blocks])
    return model.compute_logits(h[torch.tensor(draft_rows(size for _, _, size in blocks), device=h.device)])


def argmax(logits: torch.Tensor, caches: list) -> list[int]:
    """Greedy tokens of logits rows (one host sync; torch runs eagerly, the caches are written)."""
    return torch.argmax(logits, dim=-1).tolist()
