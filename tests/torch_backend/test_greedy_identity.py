"""Greedy speculative output with the torch backend == the target's greedy AR, past ring wraps.

Sliding window 32, 400 generated tokens: the verifier's ring wraps > 10 times and
nearly every block after the first wrap trims rejected positions from a wrapped
ring (BRIEF §5). The reference is computed twice and must agree: our own model
decoding token by token on plain unbounded caches (window applied by the mask),
and transformers' ``generate`` (greedy).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kakeya.core.request import CachePolicy
from kakeya.orchestrator.decode.loop import run
from kakeya.verifier.local import LocalVerifier

from ..policy_reference import torch_greedy
from .conftest import AUX_LAYERS, PROMPT

N = 400
LONG_PROMPT = [2] + [(7 * i) % 900 + 10 for i in range(100)]  # longer than window and slack


@pytest.fixture(scope="module")
def verifier(tiny, torch_target):
    return LocalVerifier(torch_target, tiny.target, AUX_LAYERS)


@pytest.fixture(scope="module")
def reference(tiny, torch_target):
    from transformers import AutoModelForCausalLM

    ours = torch_greedy(torch_target, PROMPT, N)
    hf = AutoModelForCausalLM.from_pretrained(tiny.target, dtype=torch.float32).eval()
    out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=N, min_new_tokens=N, do_sample=False)
    assert out[0, len(PROMPT) :].tolist() == ours, "our plain AR and transformers' greedy generate disagree"
    assert len(set(ours)) >= 100, "the tiny target degenerated: the identity test would prove little"
    return ours


def test_window_wraps_at_least_four_times(torch_target):
    assert torch_target.args.sliding_window * 4 <= len(PROMPT) + N


@pytest.fixture(scope="module")
def torch_run(verifier, torch_drafter):
    """``get(n, block_size)``: the torch drafter's run of ``n`` tokens after PROMPT (native policy) and its
    verifier's KV bytes at the end, run once per module: greedy decoding of one pair is deterministic, so the
    identity test at block 8, the mixed test's pure-torch blocks and the memory test's 400-token run decoded the
    very same tokens three times (~5 s each)."""
    done = {}

    def get(n: int, block_size: int):
        if (n, block_size) not in done:
            session = verifier.open_session()
            gen = run(session, torch_drafter.open_session(), PROMPT, n, block_size)
            done[n, block_size] = gen, session.stats().kv_bytes.as_dict()
        return done[n, block_size]

    return get


@pytest.mark.parametrize("block_size", [1, 4, 8, 16])
def test_torch_drafter_matches_greedy_ar(reference, torch_run, block_size):
    gen, _ = torch_run(N, block_size)
    assert gen.token_ids == reference
    if block_size > 1:
        assert gen.mean_acceptance < 1.5  # random drafter: rollback on nearly every block


@pytest.mark.parametrize("block_size", [4, 16])
def test_planted_error_drafter_matches_greedy_ar(verifier, reference, block_size):
    """Full, partial and zero acceptance all happen (the random drafter almost only gives zero)."""
    from tests.planted import PlantedDrafterSession

    planted = PlantedDrafterSession(reference, len(PROMPT), verifier.info.vocab_size, seed=block_size)
    gen = run(verifier.open_session(), planted, PROMPT, N, block_size)
    assert gen.token_ids == reference
    lengths = gen.acceptance_lengths
    assert block_size in lengths and 1 in lengths and any(1 < n < block_size for n in lengths)


def test_prompt_longer_than_the_window(verifier, torch_target, torch_drafter):
    ref = torch_greedy(torch_target, LONG_PROMPT, 120)
    gen = run(verifier.open_session(), torch_drafter.open_session(), LONG_PROMPT, 120, 8)
    assert gen.token_ids == ref


def test_sink_window_policy_matches_mlx_backend(tiny, verifier, torch_drafter):
    """A bounded sink+window policy changes the model's output; both backends change it identically."""
    from kakeya.drafter.local import MLXDrafter
    from kakeya.verifier.local import mlx_verifier

    policy = CachePolicy("sink-window", sink=4, window=20)
    mine = run(verifier.open_session(policy), torch_drafter.open_session(), PROMPT, 200, 8)
    theirs = run(
        mlx_verifier(tiny.target, AUX_LAYERS).open_session(policy),
        MLXDrafter(tiny.draft, tiny.target).open_session(),
        PROMPT,
        200,
        8,
    )
    assert mine.token_ids == theirs.token_ids


class MLXAux:
    """Colocated mixed deployment: hand an MLX drafter the torch verifier's aux (via numpy)."""

    def __init__(self, session):
        self.session = session

    def draft(self, new_aux, last_token, block_size):
        import mlx.core as mx

        return self.session.draft(mx.array(new_aux.detach().cpu().numpy()), last_token, block_size)

    def close(self):
        self.session.close()


@pytest.mark.parametrize("block_size", [8])
def test_mixed_torch_verifier_mlx_drafter(tiny, verifier, torch_run, reference, block_size):
    from kakeya.drafter.local import MLXDrafter

    mlx_drafter = MLXDrafter(tiny.draft, tiny.target)
    mixed = run(verifier.open_session(), MLXAux(mlx_drafter.open_session()), PROMPT, N, block_size)
    assert mixed.token_ids == reference
    # same drafts too: the two drafters agree, so the blocks (acceptance lengths) agree
    pure, _ = torch_run(N, block_size)
    assert mixed.acceptance_lengths == pure.acceptance_lengths


def test_mixed_mlx_verifier_torch_drafter(tiny, torch_drafter, reference):
    """The reverse: mx.array aux goes straight into the torch drafter (numpy round trip inside)."""
    from kakeya.verifier.local import mlx_verifier

    gen = run(mlx_verifier(tiny.target, AUX_LAYERS).open_session(), torch_drafter.open_session(), PROMPT, N, 8)
    assert gen.token_ids == reference


def test_sliding_memory_is_bounded_and_full_layers_grow(torch_run, torch_target):
    (_, short), (_, long) = torch_run(100, 8), torch_run(N, 8)
    assert long["sliding"] == short["sliding"]
    assert long["full"] > short["full"]
    a = torch_target.args
    n_sliding = a.layer_types.count("sliding_attention")
    ring_slots = a.sliding_window - 1 + CachePolicy().slack
    assert long["sliding"] == n_sliding * 2 * a.num_key_value_heads * ring_slots * a.head_dim * 4


def test_aux_handed_to_the_drafter_stays_a_torch_tensor(verifier):
    s = verifier.open_session()
    first, aux = s.prefill(PROMPT)
    assert isinstance(first, int) and isinstance(aux, torch.Tensor)
    assert aux.shape == (len(PROMPT), len(AUX_LAYERS) * verifier.info.hidden_size)
    choices = s.verify([first, 5, 6])
    assert len(choices) == 3 and all(isinstance(c, int) for c in choices)
    kept = s.commit(1)
    assert kept.shape[0] == 1 and np.isfinite(kept.numpy()).all()
    assert verifier.info.backend == "torch"


def test_colocated_drafter(tiny, torch_target, torch_drafter, reference):
    """The colocated drafter shares the target's embedding / LM head tensors and drafts exactly like the
    standalone one."""
    from kakeya.drafter.local import TorchDrafter

    co = TorchDrafter.colocated(tiny.draft, torch_target)
    assert co.model.target.embed is torch_target.model.embed
    assert co.warm_up(ctx=64) > 0
    a = run(LocalVerifier(torch_target, tiny.target, AUX_LAYERS).open_session(), co.open_session(), PROMPT, 120, 8)
    b = run(
        LocalVerifier(torch_target, tiny.target, AUX_LAYERS).open_session(),
        torch_drafter.open_session(),
        PROMPT,
        120,
        8,
    )
    assert a.token_ids == b.token_ids == reference[:120]
    assert a.acceptance_lengths == b.acceptance_lengths
