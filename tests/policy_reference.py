"""An independent greedy AR reference for any cache policy: keep every position, mask it.

No ring at all: every layer holds every position (mlx-lm's KVCache, or its
QuantizedKVCache on full layers when the policy quantizes them) and the
sliding layers get the policy's visibility (sinks + window) as an explicit
mask built from absolute positions. If the ring's slot bookkeeping or its
rollback were wrong anywhere, speculative output would drift from this.
"""

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, QuantizedKVCache


def policy_greedy(target, prompt_ids, max_tokens, policy, margins=None):
    """Greedy ids; if ``margins`` is a list, the top-1 minus top-2 logit of each step is appended to it."""
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
