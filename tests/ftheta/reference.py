"""An independent greedy AR for sink-window + f_theta restoration: keep everything, mask, substitute.

No ring and no latent ring: every layer keeps every position's exact K/V
(mlx-lm's KVCache), every sliding layer also keeps every position's RESTORED
K/V (f_theta on that position's aux, RoPE at its position with a plain scalar
offset), one token at a time, prompt included. Query t of a sliding layer sees
exact K/V at sinks and in its window, restored K/V at p >= sink with
t - Wn < p <= t - window, nothing else; full layers see exact K/V of every
position. If the session's slots, latent ring, rollback, masks or RoPE
positions were wrong anywhere, its output would drift from this.
"""

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache


class _WithRestored:
    """A sliding layer's cache: every exact K/V, with every restored K/V in front."""

    def __init__(self):
        self.exact = KVCache()
        self.rk: list[mx.array] = []
        self.rv: list[mx.array] = []

    @property
    def offset(self):
        return self.exact.offset

    def update_and_fetch(self, k, v):
        k, v = self.exact.update_and_fetch(k, v)
        if not self.rk:
            return k, v
        return mx.concatenate(self.rk + [k], axis=2), mx.concatenate(self.rv + [v], axis=2)


def restore_greedy(target, restorer, prompt_ids, max_tokens, policy, aux_layers, logits_out=None):
    policy = policy.resolve(target.args.sliding_window)
    sink, window, native = policy.sink, policy.window, target.args.sliding_window
    sliding = [i for i in range(target.n_cached) if target.layer_types[i] == "sliding_attention"]
    cache = [_WithRestored() if i in sliding else KVCache() for i in range(target.n_cached)]

    def step(token, t):
        n_restored = len(cache[sliding[0]].rk)  # = t: every earlier position
        p = np.arange(n_restored)
        restored = (p >= sink) & (p <= t - window) & (p > t - native)
        k = np.arange(t + 1)
        exact = (k > t - window) | (k < sink)
        mask = mx.array(np.concatenate([restored, exact])[None])
        hidden, saved = target.body(
            mx.array([[token]]), cache, {"full_attention": None, "sliding_attention": mask}, aux_layers
        )
        z = restorer.encode(mx.concatenate([saved[i][0] for i in aux_layers], axis=-1), aux_layers)  # [1, 2r]
        for i in sliding:
            attn = target.inner.layers[i].self_attn
            rk, rv = restorer.layer_kv(z, i, attn)  # [1, kv, hd]
            cache[i].rk.append(attn.rope(rk.transpose(1, 0, 2)[None], offset=t))
            cache[i].rv.append(rv.transpose(1, 0, 2)[None])
        logits = target.logits(hidden)[0, -1]
        if logits_out is not None:
            logits_out.append(np.array(logits))
        return int(mx.argmax(logits).item())

    for t, tok in enumerate(prompt_ids):
        nxt = step(tok, t)
    ids = [nxt]
    t = len(prompt_ids)
    while len(ids) < max_tokens:
        ids.append(step(ids[-1], t))
        t += 1
    return ids
