"""Same seed + same request -> same tokens, under either rule at a fixed block size: in-process (MLX,
torch, mixed), split over gRPC (torch verifier + MLX drafter servicers on loopback), and through the
public engine API. (That the coupled rule's tokens are AR sampling's, on every path and schedule,
is ``test_identity.py``.)"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from kakeya.core.contract import Draft, Proposal
from kakeya.core.request import COUPLED, REJECTION, SAMPLING_RULES, Request, SamplingParams
from kakeya.orchestrator.decode.engine import Engine
from kakeya.orchestrator.decode.loop import run

PROMPT = [2, 40, 41, 42, 43, 44, 45, 46, 47, 48]
N = 48
PARAMS = SamplingParams(0.8, top_k=40, top_p=0.95, seed=1234)
RULES = {rule: replace(PARAMS, rule=rule) for rule in SAMPLING_RULES}


def _generate(verifier, drafter, params, block_size=8):
    vs = verifier.open_session(sampling=params)
    ds = drafter.open_session(params) if block_size > 1 else None
    try:
        return run(vs, ds, PROMPT, N, block_size).token_ids
    finally:
        vs.close()
        if ds is not None:
            ds.close()


@pytest.mark.parametrize("rule", SAMPLING_RULES)
@pytest.mark.parametrize("deployment", ["mlx", "torch", "mlx verifier + torch drafter"])
def test_in_process_same_seed_same_tokens(local, deployment, rule):
    if deployment in local:
        v, d = local[deployment]
    else:
        v, d = local["mlx"][0], local["torch"][1]
    params = RULES[rule]
    first = _generate(v, d, params)
    assert _generate(v, d, params) == first
    assert _generate(v, d, replace(params, seed=params.seed + 1)) != first  # the seed matters
    assert len(first) == N and all(0 <= t < v.info.vocab_size for t in first)


@pytest.mark.parametrize("rule", SAMPLING_RULES)
def test_split_over_grpc_same_seed_same_tokens_and_equal_to_colocated(split, local, rule):
    gv, gd = split["mlx"]
    params = RULES[rule]
    remote = _generate(gv, gd, params)
    assert remote == _generate(gv, gd, params)
    assert remote == _generate(*local["mlx"], params)  # the same arithmetic and the same noise / uniforms
    ar = _generate(gv, gd, params, block_size=1)  # AR sampling over the wire
    assert ar == _generate(local["mlx"][0], None, params, block_size=1)


@pytest.mark.parametrize("rule", SAMPLING_RULES)
def test_mixed_torch_verifier_mlx_drafter_over_grpc_is_reproducible(split, rule):
    gv, gd = split["torch"]
    assert gv.remote.backend == "torch" and gd.remote.backend == "mlx"
    first = _generate(gv, gd, RULES[rule])
    assert first == _generate(gv, gd, RULES[rule])
    assert len(first) == N


def test_engine_draws_reports_and_honours_the_seed(local):
    v, d = local["mlx"]
    engine = Engine(v, d, codec=None)
    unseeded = Request(PROMPT, max_tokens=24, block_size=4, sampling=SamplingParams(1.0))
    gen = engine.generate(unseeded)
    seed = gen.sampling.seed
    assert seed is not None and gen.sampling.temperature == 1.0
    again = engine.generate(replace(unseeded, sampling=SamplingParams(1.0, seed=seed)))
    assert again.token_ids == gen.token_ids and again.sampling.seed == seed
    with pytest.raises(ValueError, match=r"^sampling\.top_p: "):
        engine.generate(replace(unseeded, sampling=SamplingParams(1.0, top_p=0)))


def test_greedy_is_untouched_by_sampling_support(local):
    """Temperature 0 ignores every other knob and stays the target's greedy AR."""
    v, d = local["mlx"]
    greedy = _generate(v, d, None)
    assert greedy == _generate(v, d, SamplingParams(0.0, top_k=3, top_p=0.5, seed=9))
    assert greedy == _generate(v, None, None, block_size=1)


def test_a_rejection_rule_verifier_refuses_candidates_without_their_proposal(local):
    v, _ = local["torch"]
    s = v.open_session(sampling=RULES[REJECTION])
    first, _ = s.prefill(PROMPT)
    with pytest.raises(ValueError, match="proposal"):
        s.decide(first, Draft((5, 6)))


def test_a_coupled_rule_verifier_refuses_a_proposal_beside_its_candidates(local):
    """A proposal means the drafter ran the rejection rule: a mismatch of rules fails loudly, never silently."""
    v, _ = local["torch"]
    s = v.open_session(sampling=RULES[COUPLED])
    first, _ = s.prefill(PROMPT)
    rows = Proposal(np.array([[5], [6]], np.int32), np.ones((2, 1), np.float32))
    with pytest.raises(ValueError, match="^proposal: a coupled-rule session takes candidates only"):
        s.decide(first, Draft((5, 6), rows))
    verdict = s.decide(first, Draft((5, 6)))  # candidates alone: verified and committed
    assert 0 <= verdict.accepted <= 2 and s.offset == len(PROMPT) + verdict.accepted + 1
