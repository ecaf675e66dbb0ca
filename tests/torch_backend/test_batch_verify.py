"""verify_batch on torch: several sessions in one batched step == each session verified alone.

Choices identical, aux allclose (float32: only the order of a matmul's sums over
more rows, and of attention over more masked slots, differs), and after every
commit the caches and positions are the same -- every later round's choices
depend on them. Covered: different prompts, prompt lengths, block lengths 1..16
and n_keep per session, wrapped native and sink-window rings, quantized full
layers (their own pool, their own batch), KV sharing + per-layer inputs, MoE,
sampling sessions with seeds, 16 sessions at once, CUDA's padded shapes (session
and block buckets, padded sessions reading the trash page) run eagerly, and a
bad item in a batch.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kakeya.core.request import REJECTION, CachePolicy, SamplingParams
from kakeya.verifier.session import LocalVerifierSession, VerifyItem, verify_batch
from kakeya.verifier.torch_backend.target import TargetTorch

from ..verifier.batch_scenario import lockstep
from .conftest import AUX_LAYERS, PROMPT

SINK = CachePolicy(kind="sink-window", sink=2, window=8)  # ring of 2 + 7 + 16 slots: wraps at once


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [2] + [5 + (7 * i + salt) % 200 for i in range(n - 1)]


def _specs():
    return [
        (PROMPT, CachePolicy(), None),
        (_prompt(5, 1), SINK, None),
        (_prompt(70, 2), CachePolicy(), None),  # native ring (window 32) already wrapped
        (_prompt(40, 3), SINK, None),
        (_prompt(13, 4), CachePolicy(full_kv_bits=8, full_kv_group_size=32), None),
    ]


def test_batched_sessions_match_alone(torch_target):
    lockstep(torch_target, AUX_LAYERS, _specs(), rounds=8)


def test_sixteen_sessions_of_every_policy_match_alone(torch_target):
    policies = [CachePolicy(), SINK, CachePolicy(full_kv_bits=4, full_kv_group_size=32), CachePolicy(slack=8)]
    specs = [(_prompt(3 + 7 * k, k), policies[k % 4], None) for k in range(14)]
    specs += [
        (_prompt(33, 20), CachePolicy(), SamplingParams(temperature=1.0, seed=21)),
        (_prompt(9, 21), SINK, SamplingParams(temperature=0.8, seed=22, rule=REJECTION)),
    ]
    lockstep(torch_target, AUX_LAYERS, specs, rounds=5, seed=2)


def test_cuda_shapes_pad_sessions_and_blocks_and_match_alone(tiny):
    """5 sessions run as a bucket of 8 (3 padded ones), blocks padded to a bucket, whole rings and full
    extents of fixed sizes: what CUDA captures, eagerly; alone is the same step with one session."""
    from kakeya.backends.torch.graphs import BUCKETS, GraphOptions

    options = GraphOptions(capture=False, buckets=BUCKETS, static_extent=True)
    target = TargetTorch.load(tiny.target, "cpu", "float32", graph_options=options, max_context=32, chunk_pages=2)
    specs = [(_prompt(4 + 11 * k, k), SINK if k % 2 else CachePolicy(), None) for k in range(5)]
    lockstep(target, AUX_LAYERS, specs, rounds=6, seed=3)
    shapes = list(target.steps.graphs.steps)
    assert {sh.sessions for sh in shapes} == {1, 8} and not any(sh.ragged for sh in shapes)
    assert {sh.block for sh in shapes} <= set(BUCKETS)


@pytest.mark.parametrize("which", ["features_target", "tiny_moe"])
def test_batched_sessions_match_alone_kv_sharing_and_moe(which, request):
    path = request.getfixturevalue(which)
    target = TargetTorch.load(getattr(path, "target", path), "cpu", "float32")
    aux = (1, 4) if target.args.num_hidden_layers > 4 else (1,)
    specs = [
        (_prompt(9, 1), CachePolicy(), None),
        (_prompt(30, 2), CachePolicy(kind="sink-window", sink=1, window=4), None),
        (_prompt(3, 3), CachePolicy(), None),
    ]
    lockstep(target, aux, specs, rounds=5)


def test_sampling_sessions_in_a_batch_draw_the_same_tokens_as_alone(torch_target):
    specs = [
        (PROMPT, CachePolicy(), SamplingParams(temperature=1.0, seed=11)),
        (_prompt(50, 1), SINK, SamplingParams(temperature=0.7, top_k=20, seed=12, rule=REJECTION)),
        (_prompt(8, 2), CachePolicy(), None),  # a greedy session among them
        (_prompt(20, 3), CachePolicy(), SamplingParams(temperature=1.3, top_p=0.9, seed=13)),
        (_prompt(12, 4), CachePolicy(), SamplingParams(temperature=0.9, min_p=0.05, seed=14, rule=REJECTION)),
    ]
    lockstep(torch_target, AUX_LAYERS, specs, rounds=6, seed=1)


def test_a_bad_item_fails_alone_and_the_rest_run(torch_target):
    good = [LocalVerifierSession(torch_target, AUX_LAYERS, CachePolicy()) for _ in range(3)]
    ref = LocalVerifierSession(torch_target, AUX_LAYERS, CachePolicy())
    for s in good + [ref]:
        s.prefill(PROMPT)
    pending = LocalVerifierSession(torch_target, AUX_LAYERS, CachePolicy())
    pending.prefill(PROMPT)
    pending.verify([7])  # not committed: its next verify must refuse
    sampler = LocalVerifierSession(
        torch_target, AUX_LAYERS, CachePolicy(), SamplingParams(temperature=1.0, seed=3, rule=REJECTION)
    )
    sampler.prefill(PROMPT)
    block = [9, 10, 11]
    items = [
        VerifyItem(good[0], block),
        VerifyItem(good[1], []),  # empty block
        VerifyItem(pending, block),
        VerifyItem(good[2], block),
        VerifyItem(sampler, block),  # no proposal
        VerifyItem(good[0], block),  # the same session twice in one batch
    ]
    got = verify_batch(items)
    want = ref.verify(block)
    assert got[0] == want and got[3] == want
    assert isinstance(got[1], ValueError) and "block length" in str(got[1])
    assert isinstance(got[2], RuntimeError) and "commit" in str(got[2])
    assert isinstance(got[4], ValueError) and "proposal" in str(got[4])
    assert isinstance(got[5], RuntimeError)
    assert good[1].offset == len(PROMPT) and good[1]._pending is None  # the failed ones are untouched
    torch.testing.assert_close(good[0].commit(2), ref.commit(2), rtol=1e-4, atol=1e-5)


def test_a_session_moving_between_batched_and_lone_verifies_matches_one_always_alone(torch_target):
    """A batched verify is a dynamic forward, a lone greedy one the static step; both write the same
    ring, so the static step's device copy of the slots' positions must follow every dynamic write."""
    alone, moving, other = (LocalVerifierSession(torch_target, AUX_LAYERS, SINK) for _ in range(3))
    last = alone.prefill(PROMPT)[0]
    assert moving.prefill(PROMPT)[0] == last
    other_last = other.prefill(_prompt(30, 5))[0]
    rng = np.random.default_rng(7)
    for r in range(15):
        block = [last] + [int(c) for c in rng.integers(3, torch_target.args.vocab_size, int(rng.integers(0, 8)))]
        want = alone.verify(block)
        if r % 3:  # batched with another session: the dynamic forward
            got, theirs = verify_batch([VerifyItem(moving, block), VerifyItem(other, [other_last, 5, 6])])
            other.commit(1)
            other_last = theirs[0]
        else:  # alone: the static step
            got = moving.verify(block)
        assert got == want, f"round {r}"
        keep = int(rng.integers(1, len(block) + 1))
        torch.testing.assert_close(moving.commit(keep), alone.commit(keep), rtol=1e-4, atol=1e-4)
        last = want[keep - 1]
    assert alone.offset > 2 * alone.layout.capacity  # the ring wrapped, trims after wraps


def test_a_batch_of_one_takes_the_static_step(torch_target, monkeypatch):
    s = LocalVerifierSession(torch_target, AUX_LAYERS, CachePolicy())
    s.prefill(PROMPT)
    monkeypatch.setattr(torch_target, "forward", lambda segments: pytest.fail("a lone item must not batch"))
    calls = []
    real = torch_target.verify_static
    monkeypatch.setattr(torch_target, "verify_static", lambda *a: calls.append(1) or real(*a))
    (choices,) = verify_batch([VerifyItem(s, [5, 6, 7])])
    assert len(choices) == 3 and calls == [1]
