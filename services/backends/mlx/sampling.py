"""Sampling on MLX: the coupled rule's noisy argmax; the processed distribution, inverse-CDF draws
and the acceptance test of the rejection rule.

Mirrors the numpy reference (``tests/sampling/reference.py``) op for op, for the verifier and the drafter. The
coupled rule's Gumbel noise is made on the device (``core/noise.py``, in uint32); the rejection rule's
uniforms come from the host. Only ints (and a drafter's [n, K] proposal) come back.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from kakeya.core import noise
from kakeya.core.contract import Proposal, TokenLogprobs
from kakeya.core.request import SamplingParams
from kakeya.core.sampling import inverse_temperature


def gumbel(keys: tuple[int, int], first_position: int, rows: int, vocab: int) -> mx.array:
    """The noise [rows, vocab] (float32) at positions ``first_position ..``, bit for bit ``noise.gumbel``'s uniforms."""
    positions = mx.arange(first_position, first_position + rows, dtype=mx.uint32)[:, None]
    h = noise.bits(keys, positions, mx.arange(vocab, dtype=mx.uint32))
    u = noise.uniform_levels(h).astype(mx.float32) * noise.U_SCALE
    return -mx.log(-mx.log(u))


def coupled_rows(logits: mx.array, params: SamplingParams, keys: tuple[int, int], first_position: int) -> list[int]:
    """The coupled rule's token of each row of ``logits`` [L, V] (row i: position ``first_position + i``),
    in one host sync: argmax over p's support of logits * (1 / temperature) + G."""
    x = logits.astype(mx.float32) * inverse_temperature(params)
    score = x + gumbel(keys, first_position, x.shape[0], x.shape[1])
    if params.filtered:
        ps, order = process_sorted(logits, params)
        keep = mx.put_along_axis(mx.zeros(ps.shape, mx.bool_), order, ps > 0, axis=-1)
        score = mx.where(keep, score, -mx.inf)
    return mx.argmax(score, axis=-1).tolist()


def cumsum(w: mx.array, block: int = 64) -> mx.array:
    """The running sum over the last axis of ``w`` [..., V], accurate to float32 rounding at any V: each block of
    ``block`` summed alone, then the blocks' totals the same way. MLX's own ``cumsum`` adds one term at a time in
    float32, so over Gemma's 262,144 tokens it drifts by up to ~2e-3 (torch's CPU ``cumsum`` accumulates in float64,
    the reference is float64): enough to move the top-p cut by hundreds of tokens. This stays within ~1e-6."""
    *lead, V = w.shape
    if V <= block:
        return mx.cumsum(w, axis=-1)
    n = -(-V // block)
    padded = mx.pad(w, [(0, 0)] * len(lead) + [(0, n * block - V)])
    inner = mx.cumsum(padded.reshape(*lead, n, block), axis=-1)
    totals = inner[..., -1]
    return (inner + (cumsum(totals, block) - totals)[..., None]).reshape(*lead, n * block)[..., :V]


def process_sorted(logits: mx.array, params: SamplingParams) -> tuple[mx.array, mx.array]:
    """p over the last axis in descending order: (probabilities [L, V] float32, token ids [L, V])."""
    x = logits.astype(mx.float32) / params.temperature
    order = mx.argsort(-x, axis=-1)
    xs = mx.take_along_axis(x, order, axis=-1)
    V = xs.shape[-1]
    keep = mx.ones(xs.shape, dtype=mx.bool_)
    if 0 < params.top_k < V:
        keep = mx.broadcast_to(mx.arange(V) < params.top_k, xs.shape)
    ps = mx.softmax(mx.where(keep, xs, -mx.inf), axis=-1)
    if params.top_p < 1:
        c = cumsum(ps)  # against its own total, not 1: MLX's softmax sums V terms in float32 too
        keep = keep & ((c - ps) < params.top_p * c[..., -1:])
    if params.min_p > 0:
        keep = keep & (ps >= params.min_p * ps[..., :1])
    ps = mx.where(keep, ps, 0.0)
    return ps / ps.sum(axis=-1, keepdims=True), order


def process(logits: mx.array, params: SamplingParams) -> mx.array:
    """p [L, V] in vocabulary order."""
    ps, order = process_sorted(logits, params)
    return mx.put_along_axis(mx.zeros_like(ps), order, ps, axis=-1)


def sample_rows(w: mx.array, u: mx.array) -> mx.array:
    """Inverse CDF of each row of the weights ``w`` [L, V] at ``u`` [L] (descending order)."""
    order = mx.argsort(-w, axis=-1)
    c = cumsum(mx.take_along_axis(w, order, axis=-1))
    k = mx.sum(c <= u[:, None] * c[:, -1:], axis=-1)
    k = mx.minimum(k, mx.sum(w > 0, axis=-1) - 1)
    return mx.take_along_axis(order, k[:, None].astype(mx.int32), axis=-1)[:, 0]


def sample_next(logits: mx.array, params: SamplingParams, u: float) -> int:
    """One token from p at the last row of ``logits`` [L, V]."""
    return int(sample_rows(process(logits[-1:], params), mx.array([u], mx.float32)).item())


def verify_rows(
    logits: mx.array, candidates: Sequence[int], proposal: Proposal | None, params: SamplingParams, u_acc, u_samp
) -> tuple[list[bool], list[int]]:
    """Acceptance of each candidate and the residual / bonus draws, in one host sync: candidate i
    (``block_ids[i+1]``) is tested at row i of ``logits`` [L, V] against the proposal's row i."""
    p = process(logits, params)
    L, V = p.shape
    n = len(candidates)
    q = mx.zeros((L, V), mx.float32)
    accepted = mx.zeros((0,), mx.bool_)
    if n:
        probs = proposal.probs / proposal.probs.sum(-1, keepdims=True)
        q = q.at[mx.arange(n)[:, None], mx.array(proposal.ids)].add(mx.array(probs, mx.float32))
        rows, x = mx.arange(n), mx.array(list(candidates))
        accepted = mx.array(u_acc, mx.float32) * q[rows, x] < p[rows, x]
    samples = sample_rows(mx.maximum(p - q, 0.0), mx.array(u_samp, mx.float32))
    mx.eval(accepted, samples)
    return accepted.tolist(), samples.tolist()


def proposal(logits: mx.array, params: SamplingParams, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The drafter's top-``k`` of its processed q per row: host (ids [n, k] int32, probs [n, k] float32)."""
    ps, order = process_sorted(logits, params)
    k = min(k, ps.shape[-1])
    ids, probs = order[:, :k], ps[:, :k]
    mx.eval(ids, probs)
    return np.array(ids, np.int32), np.array(probs, np.float32)


def logprobs(logits: mx.array, tokens: Sequence[int], k: int) -> list[TokenLogprobs]:
    """Row i's raw log-probability of ``tokens[i]`` and its ``k`` most probable tokens (``TokenLogprobs``): the
    log_softmax, gather and top-k on the device in float32; only the chosen and top-k values come back."""
    x = logits[: len(tokens)].astype(mx.float32)
    lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(lp, mx.array(list(tokens), mx.int32)[:, None], axis=-1)[:, 0]
    k = min(k, lp.shape[-1])
    if k:  # the k largest unordered (argpartition), then ordered among themselves: never a full-vocabulary sort
        part = mx.argpartition(-lp, kth=k - 1, axis=-1)[:, :k]
        rank = mx.argsort(-mx.take_along_axis(lp, part, axis=-1), axis=-1)
        order = mx.take_along_axis(part, rank, axis=-1)
    else:
        order = mx.zeros((lp.shape[0], 0), mx.int32)
    values = mx.take_along_axis(lp, order, axis=-1)
    mx.eval(chosen, order, values)
    return [
        TokenLogprobs(t, c, tuple(zip(i, v)))
        for t, c, i, v in zip(tokens, chosen.tolist(), order.tolist(), values.tolist())
    ]


def restrict(logits: mx.array, bitmask: np.ndarray) -> mx.array:
    """``logits`` [L, V] with every token a grammar does not allow there at -inf. ``bitmask``: llguidance's
    packed rows [L, ceil(V / 32)], expanded on the device by shift and mask (``llguidance.mlx`` is Metal-only)."""
    words = mx.array(bitmask)
    keep = ((words[:, :, None] >> mx.arange(32, dtype=mx.int32)) & 1).reshape(words.shape[0], -1)
    return mx.where(keep[:, : logits.shape[-1]] != 0, logits, -mx.inf)


def argmax_rows(logits: mx.array) -> list[int]:
    """The greedy choice of each row of ``logits`` [L, V], in one host sync."""
    return mx.argmax(logits, axis=-1).tolist()
