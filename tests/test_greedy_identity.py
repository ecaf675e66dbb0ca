"""Greedy speculative output == mlx-lm's own greedy AR, past many sliding-ring wraps.

Window 32 and 400 generated tokens: the ring wraps > 10 times, and every block
after the first wrap trims rejected positions from a wrapped ring (BRIEF §5).
"""

import pytest

from kakeya.core.request import CachePolicy
from kakeya.drafter.local import MLXDrafter
from kakeya.orchestrator.decode.loop import run
from kakeya.verifier.mlx_backend.reference import greedy_reference
from kakeya.verifier.session import LocalVerifierSession

from .planted import PlantedDrafterSession

N = 400
PROMPT = [2, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60]
LONG_PROMPT = [2] + [(7 * i) % 900 + 10 for i in range(100)]  # longer than the window


@pytest.fixture(scope="module")
def reference(mlx_target):
    ids, _, _ = greedy_reference(mlx_target.model, PROMPT, N)
    assert len(set(ids)) >= 100, "the tiny target degenerated: the identity test would prove little"
    return ids


@pytest.fixture(scope="module")
def drafter(tiny_pair):
    return MLXDrafter(tiny_pair.draft, tiny_pair.target)


def test_window_is_small_enough_to_wrap(mlx_target):
    assert mlx_target.args.sliding_window * 4 <= N


@pytest.fixture(scope="module")
def random_run(mlx_target, aux_layers, drafter):
    """``get(n, block_size)``: the random drafter's run of ``n`` tokens after PROMPT (native policy) and its
    verifier's KV bytes at the end, run once per module: greedy decoding of one pair is deterministic, so the
    identity test at block 8 and the memory test's 400-token run decoded the very same tokens twice (~6 s)."""
    done = {}

    def get(n: int, block_size: int):
        if (n, block_size) not in done:
            session = LocalVerifierSession(mlx_target, aux_layers, CachePolicy())
            gen = run(session, drafter.open_session(), PROMPT, n, block_size)
            done[n, block_size] = gen, session.stats().kv_bytes.as_dict()
        return done[n, block_size]

    return get


@pytest.mark.parametrize("block_size", [1, 2, 4, 8, 16])
def test_random_drafter_matches_greedy_ar(reference, random_run, block_size):
    gen, _ = random_run(N, block_size)
    assert gen.token_ids == reference
    if block_size > 1:
        # a random drafter is almost always wrong: trims happened on nearly every block
        assert gen.mean_acceptance < 1.5


@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
def test_planted_error_drafter_matches_greedy_ar(mlx_target, aux_layers, reference, block_size):
    session = LocalVerifierSession(mlx_target, aux_layers, CachePolicy())
    planted = PlantedDrafterSession(reference, len(PROMPT), mlx_target.args.vocab_size, seed=block_size)
    gen = run(session, planted, PROMPT, N, block_size)
    assert gen.token_ids == reference
    lengths = gen.acceptance_lengths
    assert block_size in lengths and 1 in lengths  # full and zero acceptance both happened
    if block_size > 2:
        assert any(1 < n < block_size for n in lengths)  # and partial
        assert planted.kinds["partial"] > 0


def test_prompt_longer_than_the_window(mlx_target, aux_layers, drafter):
    ref, _, _ = greedy_reference(mlx_target.model, LONG_PROMPT, 150)
    gen = run(LocalVerifierSession(mlx_target, aux_layers, CachePolicy()), drafter.open_session(), LONG_PROMPT, 150, 8)
    assert gen.token_ids == ref


def test_sliding_memory_is_bounded_and_full_layers_grow(mlx_target, random_run):
    (_, short), (_, long) = random_run(100, 8), random_run(N, 8)
    assert long["sliding"] == short["sliding"]
    assert long["full"] > short["full"]
    a = mlx_target.args
    n_sliding = a.layer_types.count("sliding_attention")
    ring_slots = a.sliding_window - 1 + CachePolicy().slack
    itemsize = 4  # float32 checkpoint
    assert long["sliding"] == n_sliding * 2 * a.num_key_value_heads * ring_slots * a.head_dim * itemsize


def test_stop_token_inside_a_block(mlx_target, aux_layers, reference):
    stop_at = 57
    stop_tok = reference[stop_at]
    first = reference.index(stop_tok)
    session = LocalVerifierSession(mlx_target, aux_layers, CachePolicy())
    planted = PlantedDrafterSession(reference, len(PROMPT), mlx_target.args.vocab_size, seed=1)
    gen = run(session, planted, PROMPT, N, 8, stop_ids={stop_tok})
    assert gen.token_ids == reference[: first + 1] and gen.finish_reason == "stop"
