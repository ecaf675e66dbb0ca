"""Kakeya's processed p (``reference.process``) == transformers' logits warpers (``hf_reference.py``).

Every backend is held to ``process`` (``test_reference.py``) and the statistical tests measure samples
against transformers' p, so this is where ``process`` itself meets an independent implementation:
temperature, top-k, top-p and min-p over a grid of values and their edges (k = 1, k at and past the
vocabulary, top-p near 0 and near 1, min-p = 1, huge and tiny temperatures, masked (-inf) tokens, a
logit that takes all the mass). Ties are where the two may differ, by design: Kakeya breaks them by
token index and keeps exactly k; the tie tests pin that, and that nothing else differs. The grid is
shown to catch wrong rules (an off-by-one top-p, an absolute min-p, top-k after top-p).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kakeya.core.request import SamplingParams

from . import reference as ref
from .hf_reference import hf_process

V = 64
TEMPERATURES = [0.05, 0.7, 1.0, 2.5, 1e4]
TOP_K = [0, 1, 2, 17, V - 1, V, V + 5]
TOP_P = [1.0, 0.999, 0.9, 0.5, 0.05, 1e-6]
MIN_P = [0.0, 1e-3, 0.1, 0.5, 1.0]
GRID = [
    SamplingParams(t, top_k=k, top_p=p, min_p=m) for t, k, p, m in itertools.product(TEMPERATURES, TOP_K, TOP_P, MIN_P)
]


def _tie_free() -> np.ndarray:
    """Rows of distinct logits, and the edges: masked tokens, one logit that takes all the mass, a wide range."""
    rng = np.random.default_rng(0)
    x = rng.normal(0, 3, (6, V))
    x[1, rng.choice(V, V // 2, replace=False)] = -np.inf  # a padded vocabulary: half the tokens masked
    x[2, 5] = 1e4  # every other token underflows to probability 0
    x[3] = rng.uniform(-1e3, 1e3, V)
    return x


def _tied() -> np.ndarray:
    """Rows of small integer logits: every value is shared by many tokens."""
    return np.random.default_rng(1).integers(-3, 3, (6, V)).astype(np.float64)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """transformers' warpers run in torch: on these tiny rows a thread team only waits on a busy machine."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _support(p: np.ndarray) -> np.ndarray:
    return p > 0


def test_without_ties_process_is_transformers_warpers_exactly():
    x = _tie_free()
    for params in GRID:
        ours, theirs = ref.process(x, params), hf_process(x, params)
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-12, err_msg=params.label)
        assert (_support(ours) == _support(theirs)).all(), params.label


def test_with_ties_top_p_and_min_p_keep_the_same_distribution_up_to_which_tied_token():
    """top-p keeps as many tokens as transformers' does and the same probabilities; among tokens tied at
    its boundary, the lowest ids. min-p keeps every token tied at its threshold, as transformers' does."""
    x = _tied()
    for params in (p for p in GRID if p.top_k == 0):
        ours, theirs = ref.process(x, params), hf_process(x, params)
        np.testing.assert_allclose(np.sort(ours, -1), np.sort(theirs, -1), rtol=0, atol=1e-12, err_msg=params.label)
        if params.top_p == 1:  # no boundary to break a tie at: the very same tokens
            np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-12, err_msg=params.label)
        for row, p in zip(x, ours):
            kept = _support(p)
            at = np.flatnonzero(row == row[kept].min())  # the tokens at the boundary value: the lowest ids kept
            assert kept[at].tolist() == sorted(kept[at].tolist(), reverse=True), (params.label, kept[at])


@pytest.mark.parametrize("k", [1, 3, 10, 40])
def test_with_ties_top_k_keeps_exactly_k_where_transformers_keeps_every_tied_token(k):
    params = SamplingParams(1.0, top_k=k)
    x = _tied()
    ours, theirs = ref.process(x, params), hf_process(x, params)
    for row, p, q in zip(x, ours, theirs):
        kth = np.sort(row)[::-1][k - 1]
        assert _support(q).tolist() == (row >= kth).tolist()  # transformers: all tokens tied with the k-th
        kept = np.flatnonzero(p)
        assert len(kept) == k and _support(q)[kept].all()  # Kakeya: k of them, the lowest ids among the tied
        at = np.flatnonzero(row == kth)
        assert set(kept) & set(at) == set(at[: k - int((row > kth).sum())])
        np.testing.assert_allclose(p[kept], q[kept] / q[kept].sum(), rtol=0, atol=1e-12)  # p: theirs, on our k
    # the smallest case, by hand: three tied at the top, k = 2
    four = np.array([1.0, 1.0, 1.0, 0.0])
    assert ref.process(four, SamplingParams(1.0, top_k=2)).tolist() == [0.5, 0.5, 0.0, 0.0]
    np.testing.assert_allclose(hf_process(four, SamplingParams(1.0, top_k=2)), [1 / 3, 1 / 3, 1 / 3, 0.0])


# --------------------------------------------------------------------------- the grid has the power to catch


def _filtered(x, params, keep_rule):
    """p by ``keep_rule(sorted probabilities) -> keep mask`` after temperature and top-k (a wrong process)."""
    xs = -np.sort(-np.asarray(x, np.float64) / params.temperature, -1)
    if 0 < params.top_k < xs.shape[-1]:
        xs[..., params.top_k :] = -np.inf
    ps = np.exp(xs - xs[..., :1])
    ps /= ps.sum(-1, keepdims=True)
    ps = np.where(keep_rule(ps), ps, 0.0)
    return ps / ps.sum(-1, keepdims=True)


def _off_by_one_top_p(x, params):  # stops before the token that crosses top_p (keeping at least one)
    def rule(ps):
        keep = np.cumsum(ps, -1) < params.top_p if params.top_p < 1 else np.ones_like(ps, bool)
        keep[..., 0] = True
        return keep & (ps >= params.min_p * ps[..., :1])

    return _filtered(x, params, rule)


def _absolute_min_p(x, params):  # min-p against 1, not against the top token's probability
    def rule(ps):
        before = np.cumsum(ps, -1) - ps
        return (before < params.top_p) & (ps >= params.min_p)

    return _filtered(x, params, rule)


def _top_k_after_top_p(x, params):  # the order swapped: top-p on the full distribution, then top-k
    p = ref.process(x, SamplingParams(params.temperature, top_p=params.top_p, min_p=params.min_p))
    if params.top_k:
        p = np.where(np.argsort(np.argsort(-p, -1, kind="stable"), -1) < params.top_k, p, 0.0)
    return p / p.sum(-1, keepdims=True)


@pytest.mark.parametrize("wrong", [_off_by_one_top_p, _absolute_min_p, _top_k_after_top_p], ids=lambda f: f.__name__)
def test_the_grid_catches_a_wrong_rule(wrong):
    x = _tie_free()[[0, 3]]  # the plain rows; compared sorted (the wrong rules work on sorted logits)
    with np.errstate(invalid="ignore"):  # a wrong rule may keep nothing of a row (0 / 0): caught as well
        caught = next(
            (p for p in GRID if not np.allclose(np.sort(wrong(x, p), -1), np.sort(hf_process(x, p), -1))), None
        )
    assert caught is not None, f"{wrong.__name__} passed the whole grid"
