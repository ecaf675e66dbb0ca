"""The coupled rule's pieces: the counter-based noise (the same on every backend, uniform, independent),
the Gumbel-max draw (exactly p), the coupling bound of Daliri, Musco and Suresh, and both backends'
noisy argmax == the numpy reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kakeya.core import noise
from kakeya.core.request import SamplingParams

from . import reference as ref
from .hf_reference import hf_process
from .test_reference import PARAMS, _backend
from .test_statistical import chi_square_p

SEEDS = [0, 1, 12345, 2**32, 2**63 + 5, 2**64 - 1]


def _torch_bits(keys, positions, vocab):
    return noise.bits(keys, torch.tensor(positions)[:, None], torch.arange(vocab), noise.wrap32).numpy()


def _mlx_bits(keys, positions, vocab):
    import mlx.core as mx

    return np.array(noise.bits(keys, mx.array(positions, mx.uint32)[:, None], mx.arange(vocab, dtype=mx.uint32)))


@pytest.mark.parametrize("seed", SEEDS)
def test_the_hash_is_bit_identical_in_numpy_torch_and_mlx(seed):
    keys = noise.session_keys(seed)
    positions = [0, 1, 7, 131_071, 2**31 - 1, 2**32 - 1]
    want = noise.bits(keys, np.array(positions, np.uint32)[:, None], np.arange(262_144, dtype=np.uint32))
    assert want.dtype == np.uint32
    assert np.array_equal(_torch_bits(keys, positions, 262_144), want)
    assert np.array_equal(_mlx_bits(keys, positions, 262_144), want)
    assert all(len(np.unique(row)) == len(row) for row in want)  # within a row: a bijection of the token
    # the Python-int form the keys are made with is the same function
    assert [noise.mix(int(x), noise.wrap32) for x in want[2, :5]] == noise.mix(want[2, :5]).tolist()


@pytest.mark.parametrize("backend", ["mlx", "torch"])
def test_each_backends_gumbel_is_the_references_within_float_rounding_of_log(backend):
    s, _, back = _backend(backend)
    keys = noise.session_keys(99)
    want = noise.gumbel(keys, 500, 3, 262_144)
    got = back(s.gumbel(keys, 500, 3, 262_144, "cpu") if backend == "torch" else s.gumbel(keys, 500, 3, 262_144))
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=4e-6)  # -log(-log u) with each library's float32 log


def test_the_uniforms_are_uniform_and_never_0_or_1():
    levels = noise.uniform_levels(
        noise.bits(noise.session_keys(5), np.arange(64, dtype=np.uint32)[:, None], np.arange(4096, dtype=np.uint32))
    )
    u = levels.astype(np.float32) * np.float32(noise.U_SCALE)
    assert (u > 0).all() and (u < 1).all() and (levels % 2 == 1).all()
    counts = np.bincount((u.ravel() * 256).astype(int), minlength=256)
    assert chi_square_p(counts, np.full(256, u.size / 256)) > 1e-3


def test_the_noise_is_independent_across_positions_tokens_and_seeds():
    def g(seed, first=0):
        return noise.gumbel(noise.session_keys(seed), first, 200, 2000).astype(np.float64)

    base = g(3)
    pairs = {
        "next position, same token": (base[1:], base[:-1]),
        "same position, next token": (base[:, 1:], base[:, :-1]),
        "another seed": (base, g(4)),
        "the seed's high word": (base, g(3 + 2**32)),
    }
    for name, (a, b) in pairs.items():
        c = np.corrcoef(a.ravel(), b.ravel())[0, 1]
        assert abs(c) < 5 / np.sqrt(a.size), (name, c)  # 5 sigma of a correlation over that many pairs
    assert np.array_equal(g(3, first=1)[:-1], base[1:])  # a function of the position, not of where a block starts


def _exact_check(p: np.ndarray, draws: np.ndarray) -> float:
    support = np.flatnonzero(p)
    assert np.isin(draws, support).all(), "a draw outside p's support"
    counts = np.bincount(draws, minlength=len(p))[support]
    return chi_square_p(counts, p[support] * len(draws))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(1.0),
        SamplingParams(0.7, top_k=6),
        SamplingParams(1.3, top_p=0.8),
        SamplingParams(0.9, min_p=0.05),
    ],
    ids=lambda p: p.label,
)
def test_the_noisy_argmax_draws_exactly_from_p(params):
    """Gumbel-max: over many positions the coupled token of one logits row is distributed as p."""
    logits = np.random.default_rng(1).normal(0, 1.5, 24).astype(np.float32)
    p = hf_process(logits, params)  # p by transformers' warpers: not by the code that filters the draws
    n = 20_000
    draws = np.array(ref.coupled(np.tile(logits, (n, 1)), params, noise.session_keys(8), 1000))
    assert _exact_check(p, draws) > 1e-3


def test_the_coupling_meets_its_bound_and_never_beats_the_optimal_one():
    """P[argmax(log p + G) == argmax(log q + G)] >= (1 - TV) / (1 + TV) (Daliri, Musco, Suresh 2024), and
    <= 1 - TV (no coupling does better), on random pairs from near to far apart, with this noise."""
    rng = np.random.default_rng(0)
    keys, n, V = noise.session_keys(21), 6000, 40
    for concentration in (0.1, 0.5, 2.0, 10.0):
        for _ in range(3):
            p = rng.dirichlet(np.full(V, concentration))
            q = (
                0.5 * p + 0.5 * rng.dirichlet(np.full(V, concentration))
                if concentration > 1
                else rng.dirichlet(np.full(V, concentration))
            )
            tv = 0.5 * np.abs(p - q).sum()
            one = SamplingParams(1.0)
            a = np.array(ref.coupled(np.tile(np.log(p), (n, 1)).astype(np.float32), one, keys, 0))
            b = np.array(ref.coupled(np.tile(np.log(q), (n, 1)).astype(np.float32), one, keys, 0))
            agree = (a == b).mean()
            slack = 4 * np.sqrt(0.25 / n)
            assert agree >= (1 - tv) / (1 + tv) - slack, (concentration, tv, agree)
            assert agree <= 1 - tv + slack, (concentration, tv, agree)


@pytest.mark.parametrize("backend", ["mlx", "torch"])
@pytest.mark.parametrize("params", PARAMS, ids=lambda p: p.label)
def test_each_backends_coupled_rows_are_the_references(backend, params):
    s, to, _ = _backend(backend)
    keys = noise.session_keys(77)
    for seed, first in [(0, 0), (1, 23), (2, 100_000)]:
        x = np.random.default_rng(seed).normal(0, 3, (6, 300)).astype(np.float32)
        want = ref.coupled(x, params, keys, first)
        assert s.coupled_rows(to(x), params, keys, first) == want
        p = hf_process(x, params)
        assert all(p[i, t] > 0 for i, t in enumerate(want))  # never outside the support


@pytest.mark.parametrize(
    "kwargs", [{"temperature": 1e-39}, {"temperature": 1e-6}, {"temperature": 1.0, "rule": "gumbel"}]
)
def test_degenerate_values_are_refused_naming_the_field(kwargs):
    field = "rule" if "rule" in kwargs else "temperature"
    with pytest.raises(ValueError, match=f"^sampling.{field}: "):
        SamplingParams(**kwargs).check()


@pytest.mark.parametrize("backend", ["mlx", "torch"])
def test_the_smallest_temperature_and_a_huge_one_sample_without_overflow(backend):
    s, to, _ = _backend(backend)
    x = np.random.default_rng(4).normal(0, 30, (4, 262_144)).astype(np.float32)
    keys = noise.session_keys(1)
    cold = SamplingParams(1e-5).check()
    assert (
        s.coupled_rows(to(x), cold, keys, 0) == np.argmax(x, -1).tolist()
    )  # the noise is nothing beside logits / 1e-5
    hot = SamplingParams(1e30).check()
    assert s.coupled_rows(to(x), hot, keys, 0) == ref.coupled(x, hot, keys, 0)
