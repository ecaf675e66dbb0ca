"""The numpy reference of Kakeya's sampling (``services/core/sampling.py`` describes both rules): what ``process``,
``coupled`` and the rejection rule's ``verify`` mean, in float64 numpy. ``backends/*/sampling.py`` compute the same on
the device and the tests hold them to this file; the host-side steps every backend shares (``assemble``,
``draw_from_proposal``, ``verify_uniforms``) are the product's own, re-exported here beside it."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kakeya.core import noise
from kakeya.core.contract import PROPOSAL_TOP_K, Proposal
from kakeya.core.request import SamplingParams
from kakeya.core.sampling import assemble, draw_from_proposal, first_above, inverse_temperature, verify_uniforms

__all__ = ["assemble", "coupled", "dense", "draw_from_proposal", "inverse_temperature", "process", "proposal_rows"]
__all__ += ["sample", "verify", "verify_uniforms"]


def process(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The processed distribution p over the last axis (float64), for ``params.temperature > 0``."""
    x = np.asarray(logits, np.float64) / params.temperature
    order = np.argsort(-x, axis=-1, kind="stable")  # descending, ties by index
    xs = np.take_along_axis(x, order, axis=-1)
    keep = np.ones_like(xs, dtype=bool)
    V = xs.shape[-1]
    if 0 < params.top_k < V:
        keep[..., params.top_k :] = False
    xs = np.where(keep, xs, -np.inf)
    ps = np.exp(xs - xs[..., :1])
    ps /= ps.sum(-1, keepdims=True)
    if params.top_p < 1:
        before = np.cumsum(ps, -1) - ps  # mass strictly before each entry
        keep &= before < params.top_p  # the smallest prefix reaching top_p (the first always)
    if params.min_p > 0:
        keep &= ps >= params.min_p * ps[..., :1]
    ps = np.where(keep, ps, 0.0)
    ps /= ps.sum(-1, keepdims=True)
    out = np.empty_like(ps)
    np.put_along_axis(out, order, ps, axis=-1)
    return out


def coupled(logits: np.ndarray, params: SamplingParams, keys: tuple[int, int], first_position: int) -> list[int]:
    """The coupled rule's token for each row of ``logits`` [L, V], row i predicting position
    ``first_position + i``: argmax over p's support of logits * (1 / temperature) + G, in float32."""
    x = np.asarray(logits, np.float32)
    score = x * np.float32(inverse_temperature(params)) + noise.gumbel(keys, first_position, *x.shape)
    if params.filtered:
        score = np.where(process(logits, params) > 0, score, -np.inf)
    return np.argmax(score, axis=-1).tolist()


def sample(w: np.ndarray, u: float) -> int:
    """Inverse CDF of the (unnormalised) weights ``w`` [V] at uniform ``u`` in [0, 1): descending weight, ties by index,
    capped at the last positive entry, so a zero-weight token is never drawn."""
    w = np.asarray(w, np.float64)
    order = np.argsort(-w, kind="stable")
    return int(order[first_above(w[order], u)])


def proposal_rows(q: np.ndarray, k: int = PROPOSAL_TOP_K) -> tuple[np.ndarray, np.ndarray]:
    """The top-``k`` of each row of ``q`` [n, V] (descending, ties by index), renormalised."""
    k = min(k, q.shape[-1])
    ids = np.argsort(-q, axis=-1, kind="stable")[:, :k]
    probs = np.take_along_axis(q, ids, axis=-1)
    return ids.astype(np.int32), (probs / probs.sum(-1, keepdims=True)).astype(np.float32)


def dense(proposal: Proposal, vocab: int) -> np.ndarray:
    """q' as [n, vocab] (float64, each row normalised): for the reference and tests only."""
    q = np.zeros((len(proposal), vocab))
    probs = proposal.probs.astype(np.float64)
    np.put_along_axis(q, proposal.ids.astype(np.int64), probs / probs.sum(-1, keepdims=True), axis=-1)
    return q


def verify(
    p: np.ndarray, candidates: Sequence[int], proposal: Proposal | None, u_acc, u_samp
) -> tuple[list[bool], list[int]]:
    """Reference acceptance and residual draws for p [L, V] (``len(candidates) == L - 1``)."""
    L, V = p.shape
    q = np.zeros((L, V))
    if candidates:
        q[: L - 1] = dense(proposal, V)
    accepted = [bool(u_acc[i] * q[i, x] < p[i, x]) for i, x in enumerate(candidates)]
    w = np.maximum(p - q, 0.0)
    return accepted, [sample(w[i], u_samp[i]) for i in range(L)]
