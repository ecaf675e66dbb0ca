"""Several drafter sessions' work as ONE MLX forward (the model side of ``batch.py``).

The same layout as ``drafter/torch_backend/batch.py``: sessions' rows flattened along the
sequence axis, every row-wise op (embedding, norms, q/k/v/o projections, MLP,
``fc``, LM head) once over all rows, RoPE per session segment at its own
offset, attention per segment over that session's ``visible context ++ block``
with its own mask -- what its own forward computes.

Functions take the model (``dflash_mlx.DFlashDraftModel``) as their first
argument; they read its layers but import nothing from it.
"""

from __future__ import annotations

import mlx.core as mx

from kakeya.drafter.context import block_mask, draft_rows


def extend(model, caches: list, auxs: list[mx.array]) -> None:
    """Append each ``auxs[i]`` ([n_i, aux_width], the next positions) to ``caches[i]``.

    ``fc``, ``hidden_norm`` and every layer's k/v projection run once over all
    sessions' new rows; RoPE and the append are per session.
    """
    work = [(c, a) for c, a in zip(caches, auxs) if a.shape[-2]]
    if not work:
        return
    aux = mx.concatenate([a.reshape(-1, a.shape[-1]) for _, a in work]).astype(model.dtype)
    h = model.hidden_norm(model.fc(aux[None]))
    kv = [layer.self_attn.project_kv(h) for layer in model.layers]
    at = 0
    for cache, a in work:
        n, pos = a.shape[-2], cache.length
        cache.append([(model.rope(k[:, :, at : at + n], offset=pos), v[:, :, at : at + n]) for k, v in kv])
        at += n


def _attention(attn, x: mx.array, segments: list, rope) -> mx.array:
    """``Attention.__call__`` over flattened sessions: ``segments`` = (layer K/V, view, mask, position, rows)."""
    B, L, _ = x.shape
    q = attn.project_q(x)
    k, v = attn.project_kv(x)
    outs, at = [], 0
    for ctx, view, mask, pos, n in segments:
        ks, vs = ctx.with_block(view, rope(k[:, :, at : at + n], offset=pos), v[:, :, at : at + n])
        qs = rope(q[:, :, at : at + n], offset=pos)
        outs.append(mx.fast.scaled_dot_product_attention(qs, ks, vs, scale=attn.scale, mask=mask))
        at += n
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


def hidden(model, blocks: list[tuple[object, list[int]]]) -> mx.array:
    """Final-norm hidden ``[sum B_i, hidden]`` of every ``(cache, block ids)`` in ONE forward (lazy)."""
    if model.target is None:
        raise RuntimeError("drafter is not bound to a target embedding/LM head")
    sizes = [len(ids) for _, ids in blocks]
    ids = mx.array([t for _, b in blocks for t in b], dtype=mx.int32)
    x = model.target.embed_rows(ids).astype(model.dtype)
    if model.config.input_embedding_scale != 1.0:
        x = x * model.config.input_embedding_scale
    x = x[None]
    views = [c.plan.block(n) for (c, _), n in zip(blocks, sizes)]
    masks: dict = {}
    for i, layer in enumerate(model.layers):
        attn, segments = layer.self_attn, []
        for s, ((cache, _), n) in enumerate(zip(blocks, sizes)):
            ctx = cache.layers[i]
            view, key = views[s][ctx.layout], (s, ctx.layout, attn.is_causal)
            if key not in masks:
                m = block_mask(view, n, is_causal=attn.is_causal, window=attn.window)
                masks[key] = None if m is None else mx.array(m)
            segments.append((ctx, view, masks[key], cache.length, n))
        h = x + _attention(attn, layer.input_layernorm(x), segments, model.rope)
        x = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.norm(x[0])


def logits(model, blocks: list[tuple[object, int, int]]) -> mx.array:
    """Logits ``[sum (B_i - 1), vocab]`` of every ``(cache, last_token, block_size)`` block's
    positions ``1..B_i-1``, in order, from one forward and one LM head call (lazy)."""
    mask_id = model.config.mask_token_id
    h = hidden(model, [(c, [last] + [mask_id] * (size - 1)) for c, last, size in blocks])
    return model.compute_logits(h[mx.array(draft_rows(size for _, _, size in blocks), dtype=mx.int32)])


def argmax(logits: mx.array, caches: list) -> list[int]:
    """Greedy tokens of logits rows, evaluated together with the caches' K/V (one sync)."""
    tokens = mx.argmax(logits, axis=-1)
    mx.eval(tokens, *[c.state for c in caches])
    return tokens.tolist()
