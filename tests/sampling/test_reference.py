"""Both backends' processing, draws and acceptance == the numpy reference (tests/sampling/reference.py),
and the reference itself keeps p exactly (enumerated, no sampling)."""

from __future__ import annotations

import numpy as np
import pytest

from kakeya.core.contract import Proposal
from kakeya.core.request import InvalidRequest, SamplingParams

from . import reference as ref

PARAMS = [
    SamplingParams(1.0),
    SamplingParams(0.7, top_k=5),
    SamplingParams(1.3, top_p=0.8),
    SamplingParams(0.9, min_p=0.1),
    SamplingParams(0.5, top_k=20, top_p=0.9, min_p=0.02),
    SamplingParams(2.0, top_k=1),
    SamplingParams(1.0, top_p=1e-6),
]
V = 300


def _backend(name):
    if name == "mlx":
        import mlx.core as mx

        from kakeya.backends.mlx import sampling as s

        return s, (lambda a: mx.array(np.asarray(a, np.float32))), (lambda t: np.array(t))
    import torch

    from kakeya.backends.torch import sampling as s

    return s, (lambda a: torch.tensor(np.asarray(a, np.float32))), (lambda t: t.numpy())


def _logits(seed, rows=6):
    return np.random.default_rng(seed).normal(0, 3, (rows, V)).astype(np.float32)


@pytest.mark.parametrize("backend", ["mlx", "torch"])
@pytest.mark.parametrize("params", PARAMS, ids=lambda p: p.label)
def test_processing_matches_reference(backend, params):
    s, to, back = _backend(backend)
    tied = np.random.default_rng(9).integers(-3, 3, (6, V)).astype(np.float32)  # ties broken by index, as there
    for x in [*(_logits(seed) for seed in range(3)), tied]:
        want = ref.process(x, params)
        got = back(s.process(to(x), params))
        np.testing.assert_allclose(got, want, atol=2e-6)
        assert ((got > 0) == (want > 0)).all()  # the same support, exactly
        if params.top_k:
            assert ((want > 0).sum(-1) <= params.top_k).all()


@pytest.mark.parametrize("backend", ["mlx", "torch"])
def test_inverse_cdf_draws_match_reference(backend):
    s, to, back = _backend(backend)
    p = ref.process(_logits(7, rows=1), SamplingParams(1.0, top_p=0.95))[0]
    us = np.linspace(0.0005, 0.9995, 400)
    got = back(s.sample_rows(to(np.tile(p, (len(us), 1))), to(us))).tolist()
    assert got == [ref.sample(p, u) for u in us]
    assert all(p[t] > 0 for t in got)  # never a token outside the support


@pytest.mark.parametrize("backend", ["mlx", "torch"])
@pytest.mark.parametrize("params", PARAMS[:5], ids=lambda p: p.label)
def test_acceptance_and_residual_match_reference(backend, params):
    s, to, _back = _backend(backend)
    rng = np.random.default_rng(11)
    L = 5
    x = _logits(3, rows=L)
    q = ref.process(_logits(4, rows=L - 1), SamplingParams(1.0))
    ids, probs = ref.proposal_rows(q, 16)
    cands, proposal = ref.draw_from_proposal(ids, probs, rng.random(L - 1))
    for _ in range(20):
        u_acc, u_samp = rng.random(L - 1), rng.random(L)
        acc, samples = s.verify_rows(to(x), cands, proposal, params, u_acc, u_samp)
        want_acc, want_samples = ref.verify(ref.process(x, params), cands, proposal, u_acc, u_samp)
        assert acc == want_acc and samples == want_samples
        choices = ref.assemble(cands, acc, samples)
        first_reject = next((i for i, a in enumerate(acc) if not a), None)
        if first_reject is not None:
            assert choices[first_reject] != cands[first_reject]  # the residual is 0 at the rejected token
            assert choices[first_reject + 1 :] == [-1] * (L - 1 - first_reject)


@pytest.mark.parametrize("backend", ["mlx", "torch"])
def test_drafter_proposal_is_the_reference_top_k(backend):
    s, to, _ = _backend(backend)
    params = SamplingParams(0.8, top_p=0.9)
    x = _logits(5, rows=3)
    ids, probs = s.proposal(to(x), params, 8)
    want_ids, want_probs = ref.proposal_rows(ref.process(x, params), 8)
    live = want_probs > 0  # past the support the order of zero-probability ids is immaterial
    assert ((probs > 0) == live).all() and (ids[live] == want_ids[live]).all()
    np.testing.assert_allclose(probs / probs.sum(-1, keepdims=True), want_probs, atol=1e-6)


def test_the_rule_keeps_p_exactly():
    """Enumerated: P(token) = q'(t) min(1, p/q') + P(reject) * residual(t) == p(t), for any proposal q'."""
    rng = np.random.default_rng(0)
    for _ in range(20):
        p = ref.process(rng.normal(0, 2, 40), SamplingParams(1.0, top_k=25))
        q = ref.dense(
            Proposal(*ref.proposal_rows(ref.process(rng.normal(0, 2, (1, 40)), SamplingParams(1.0)), 10)), 40
        )[0]
        accept = np.minimum(q, p)  # q * min(1, p/q)
        residual = np.maximum(p - q, 0)
        out = accept + (1 - accept.sum()) * residual / residual.sum()
        np.testing.assert_allclose(out, p, atol=1e-12)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": 1.0, "top_k": -1}, "top_k"),
        ({"temperature": 1.0, "top_p": 0.0}, "top_p"),
        ({"temperature": 1.0, "top_p": 1.01}, "top_p"),
        ({"temperature": 1.0, "min_p": -0.1}, "min_p"),
        ({"temperature": 1.0, "min_p": 1.5}, "min_p"),
        ({"temperature": 1.0, "seed": -3}, "seed"),
    ],
)
def test_bad_params_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequest, match=f"^sampling.{field}: ") as refused:
        SamplingParams(**kwargs).check()
    assert refused.value.field == f"sampling.{field}"


def test_greedy_and_seeding():
    assert SamplingParams().greedy and SamplingParams().seeded().seed is None
    s = SamplingParams(0.7).seeded()
    assert s.seed is not None and 0 <= s.seed < 2**63 and s.seeded() is s


@pytest.mark.parametrize("backend", ["mlx", "torch"])
@pytest.mark.parametrize("top_p", [0.5, 0.9])
def test_the_top_p_cut_at_gemmas_vocabulary_is_the_references(backend, top_p):
    """At 262,144 tokens the cut is the reference's but for float32 rounding: the tokens kept on one side only
    carry under 1e-5 of p. (MLX's own cumsum and softmax sum one term at a time in float32: they moved the cut
    by ~1e-3 of mass, hundreds of tokens, before ``backends/mlx/sampling.cumsum``.)"""
    s, to, back = _backend(backend)
    x = np.random.default_rng(5).normal(0, 3, (2, 262_144)).astype(np.float32)
    for params in (SamplingParams(1.0, top_p=top_p), SamplingParams(0.7, top_k=50_000, top_p=top_p)):
        want = ref.process(x, params)
        got = back(s.process(to(x), params))
        differ = (got > 0) != (want > 0)
        full = ref.process(x, SamplingParams(params.temperature, top_k=params.top_k))  # p before the cut
        assert (full * differ).sum(-1).max() < 1e-5, (full * differ).sum(-1)
