"""Independent greedy AR references: keep every position, mask it.

No ring at all: every layer holds every position (mlx-lm's KVCache, or its
QuantizedKVCache on full layers when the policy quantizes them) and the
sliding layers get the policy's visibility (sinks + window) as an explicit
mask built from absolute positions. If the ring's slot bookkeeping or its
rollback were wrong anywhere, speculative output would drift from this.
:func:`policy_greedy` is the MLX target's under any cache policy, :func:`torch_greedy`
the torch target's (no pool either). Each imports its backend when called.
"""

import numpy as np


def policy_greedy(target, prompt_ids, max_tokens, policy, margins=None):
    """Greedy ids; if ``margins`` is a list, the top-1 minus top-2 logit of each step is appended to it."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    policy = policy.resolve(target.args.sliding_window)
    group = min(policy.full_kv_group_size, target.args.global_head_dim or target.args.head_dim)
    cache = [
        KVCache()
        if t == "sliding_attention" or not policy.full_kv_bits
        else QuantizedKVCache(group_size=group, bits=policy.full_kv_bits)
        for t in target.layer_types[: target.n_cached]
    ]

    def masks(start, n):
        q = np.arange(start, start + n)[:, None]
        k = np.arange(start + n)[None, :]
        sliding = mx.array((k <= q) & ((k > q - policy.window) | (k < policy.sink)))
        return {"full_attention": None if n == 1 else "causal", "sliding_attention": sliding}

    def pick(hidden):
        logits = target.logits(hidden[:, -1:])[0, -1]
        if margins is not None:
            top2 = mx.topk(logits, 2)
            margins.append(float(mx.max(top2) - mx.min(top2)))
        return int(mx.argmax(logits).item())

    hidden, _ = target.body(mx.array([list(prompt_ids)]), cache, masks(0, len(prompt_ids)), ())
    pos = len(prompt_ids)
    ids = [pick(hidden)]
    while len(ids) < max_tokens:
        hidden, _ = target.body(mx.array([[ids[-1]]]), cache, masks(pos, 1), ())
        pos += 1
        ids.append(pick(hidden))
    return ids


def torch_plain(target, total):
    """A ``TargetTorch``'s plain forward, ``forward(ids, start)`` -> final-norm hidden ``[1, len(ids), H]``: every
    layer that owns K/V keeps every position (up to ``total``) in a buffer of its own (no ring, no pool, no
    rollback); sliding layers see ``sliding_window`` keys by the mask."""
    import torch

    a, dev = target.args, target.device
    kv = [
        [torch.zeros((1, a.kv_heads_of(i), total, a.head_dim_of(i)), dtype=target.dtype, device=dev) for _ in "kv"]
        for i in range(target.n_cached)
    ]

    @torch.inference_mode()
    def forward(ids, start):
        end = start + len(ids)
        pos = torch.arange(start, end, device=dev)
        q, k = pos[:, None], torch.arange(end, device=dev)[None, :]
        masks = {"full_attention": k <= q, "sliding_attention": (k <= q) & (k > q - a.sliding_window)}

        def attention(i, layer, q_rows, k_rows, v_rows, shared):
            if shared is None:  # a layer with K/V of its own (a KV-shared one gets its source's)
                for buf, new in zip(kv[i], (k_rows, v_rows)):
                    buf.index_copy_(2, pos, new)
                shared = [buf[:, :, :end] for buf in kv[i]]
            return layer.attn.attend(q_rows, *shared, masks[layer.layer_type], 1.0), shared

        return target.model(torch.tensor([list(ids)], device=dev), pos, attention, ())[0]

    return forward


def torch_greedy(target, prompt_ids, max_tokens):
    """A ``TargetTorch`` decoding token by token through :func:`torch_plain`."""
    forward = torch_plain(target, len(prompt_ids) + max_tokens)
    ids = [target.greedy(forward(prompt_ids, 0)[:, -1:])[0]]
    while len(ids) < max_tokens:
        ids.append(target.greedy(forward(ids[-1:], len(prompt_ids) + len(ids) - 1))[0])
    return ids
