"""A verifier session resumed from a prefix snapshot is the session a cold prefill would have made.

Every cache policy, both backends: the first token and every greedy token after it
equal a cold session's on the same prompt (past ring wraps), the snapshot is
never changed by the sessions that resume it, and a snapshot beyond the ring's
slack is refused.
"""

import numpy as np
import pytest

from kakeya.core.prefix import PrefixCache
from kakeya.core.request import CachePolicy
from kakeya.verifier.session import LocalVerifierSession

PROMPT = [2] + [5 + (7 * i) % 900 for i in range(45)]
POLICIES = {
    "native": CachePolicy(),
    "sink-window": CachePolicy("sink-window", sink=4, window=16),
    "kv8": CachePolicy(full_kv_bits=8),
    "kv4-sink": CachePolicy("sink-window", sink=2, window=24, full_kv_bits=4, full_kv_group_size=32),
}


def _decode(session, first: int, n: int) -> list[int]:
    """Greedy AR through verify/commit (blocks of one), ``n`` tokens after ``first``."""
    out, last = [first], first
    for _ in range(n):
        last = session.verify([last])[0]
        session.commit(1)
        out.append(last)
    return out


def _arrays(target, snap) -> list[np.ndarray]:
    """The snapshot's arrays on the host (as float32: numpy has no bfloat16)."""
    if target.backend == "torch":
        return [a.float().numpy() for layer in snap.caches for a in layer]
    import mlx.core as mx

    return [np.array(a.astype(mx.float32) if a.dtype != mx.uint8 else a) for layer in snap.caches for a in layer]


def _resumed_equals_cold(target, policy, aux, n_new=70):
    cache = PrefixCache(1 << 28)
    first = LocalVerifierSession(target, aux, policy, prefixes=cache)
    tok, _ = first.prefill(PROMPT)
    gen = _decode(first, tok, 30)
    ids = PROMPT + gen[:-1]  # the last token was never run
    assert first.save(ids)
    first.close()
    (entry,) = cache.find(policy.resolve(target.args.sliding_window), ids + [1])
    before = _arrays(target, entry.value)

    longer = ids + [gen[-1], 17, 23, 5, 9]
    resumed = LocalVerifierSession(target, aux, policy, prefixes=cache)
    tok_r, aux_r, cached = resumed.resume(longer)
    cold = LocalVerifierSession(target, aux, policy, prefixes=cache)
    tok_c, aux_c = cold.prefill(longer)
    assert cached == len(ids) and cold.cached_tokens == 0
    assert aux_r.shape[0] == len(longer) - len(ids) and aux_c.shape[0] == len(longer)
    assert _decode(resumed, tok_r, n_new) == _decode(cold, tok_c, n_new)  # past the ring's wraps
    resumed.close(), cold.close()
    assert all(np.array_equal(a, b) for a, b in zip(before, _arrays(target, entry.value)))  # never written through


@pytest.mark.parametrize("name", list(POLICIES))
def test_mlx_resumed_session_equals_cold(mlx_target, aux_layers, name):
    _resumed_equals_cold(mlx_target, POLICIES[name], aux_layers)


@pytest.mark.parametrize("name", list(POLICIES))
def test_torch_resumed_session_equals_cold(torch_target, aux_layers, name):
    _resumed_equals_cold(torch_target, POLICIES[name], aux_layers)


def test_torch_static_shapes_resume_into_a_reused_cache_set(static_torch_target, aux_layers):
    """With the CUDA step's whole-buffer shapes a closed session's cache set (graphs and all) is reused:
    the snapshot is copied into its buffers, and the static step's ring positions resynced."""
    _resumed_equals_cold(static_torch_target, POLICIES["native"], aux_layers)
    _resumed_equals_cold(static_torch_target, POLICIES["sink-window"], aux_layers)


def test_mlx_f_theta_restoration_resumes_its_latent_ring(mlx_target, aux_layers, ftheta_dir):
    _resumed_equals_cold(mlx_target, CachePolicy("sink-window", sink=4, window=16, restore=str(ftheta_dir)), aux_layers)


def test_a_snapshot_is_kept_only_within_the_slack_and_for_the_session_prompt(mlx_target, aux_layers):
    cache = PrefixCache(1 << 28)
    s = LocalVerifierSession(mlx_target, aux_layers, CachePolicy(slack=4), prefixes=cache)
    tok, _ = s.prefill(PROMPT)
    gen = _decode(s, tok, 10)
    with pytest.raises(ValueError, match="prompt"):
        s.save([0] + PROMPT[1:] + gen[:-1])
    assert not s.save(PROMPT + gen[:-6])  # 5 positions back: beyond the slack of 4
    assert s.save(PROMPT + gen[:-4]) and len(cache) == 1
    s.close()
    s = LocalVerifierSession(mlx_target, aux_layers, CachePolicy(slack=4), prefixes=cache)
    tok, _ = s.prefill(PROMPT)
    gen = _decode(s, tok, 3)
    s.verify([gen[-1], 1, 2, 3])
    s.commit(1)  # three rejected positions were written: the ring reaches back one more, not two
    assert not s.save(PROMPT + gen[:-2])
    assert s.save(PROMPT + gen[:-1])
    s.close()
    assert not LocalVerifierSession(mlx_target, aux_layers, CachePolicy(), prefixes=None).save(
        []
    )  # no cache: nothing kept


def test_a_resume_offers_only_what_it_may_take(mlx_target, aux_layers):
    cache = PrefixCache(1 << 28)
    s = LocalVerifierSession(mlx_target, aux_layers, CachePolicy(), prefixes=cache)
    tok, _ = s.prefill(PROMPT)
    s.save(PROMPT)
    s.close()
    longer = PROMPT + [tok, 9]
    for reuse, want in ((None, len(PROMPT)), ([len(PROMPT)], len(PROMPT)), ([3], 0), ((), 0)):
        r = LocalVerifierSession(mlx_target, aux_layers, CachePolicy(), prefixes=cache)
        assert r.resume(longer, reuse)[2] == want
        r.close()
    other = LocalVerifierSession(mlx_target, aux_layers, CachePolicy("sink-window", sink=4, window=16), prefixes=cache)
    assert other.resume(longer)[2] == 0  # another policy's snapshot is another state
    other.close()
    assert cache.stats()["hits"] == 2 and cache.stats()["misses"] == 3
