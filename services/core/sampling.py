"""Speculative sampling: the host-side steps every backend shares.

Two rules, both exact in distribution, picked per request (``SamplingParams.rule``): **coupled** (Daliri, Musco, Suresh
2024: every token is the Gumbel-max draw of ``noise.py``'s G, so candidates are kept while they equal the verifier's
noisy argmax) and **rejection** (Leviathan et al. 2023: accept with min(1, p/q'), resample from norm(max(0, p - q'))).

p is the *processed* distribution; ``backends/*/sampling.py`` compute it on the device, and the tests hold them to the
numpy reference of both rules (``tests/sampling/reference.py``). The rejection rule's host uniforms (``session_rng``) become tokens by inverse CDF over a fixed
order (descending probability, ties by index) on every backend.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kakeya.core.contract import Proposal
from kakeya.core.request import SamplingParams


def inverse_temperature(params: SamplingParams) -> float:
    """1 / temperature rounded to float32: the coupled rule scales logits by one float32 multiply,
    rounded alike on every backend (a division by a Python float is not: CUDA multiplies by a
    reciprocal, Metal may divide approximately)."""
    return float(np.float32(1.0 / params.temperature))


def draw_from_proposal(ids: np.ndarray, probs: np.ndarray, u: np.ndarray) -> tuple[list[int], Proposal]:
    """Sample one candidate per row of the compact proposal (host). ``probs`` [n, K] float32, descending: the drafter
    sends exactly these, so the verifier's acceptance uses the very distribution each candidate came from."""
    probs = np.ascontiguousarray(probs, np.float32)
    ids = np.ascontiguousarray(ids, np.int32)
    tokens = [int(ids[i, first_above(probs[i], u[i])]) for i in range(ids.shape[0])]
    return tokens, Proposal(ids, probs)


def first_above(row: np.ndarray, u: float) -> int:
    c = np.cumsum(row, dtype=np.float64)
    k = int(np.sum(c <= u * c[-1]))
    return min(k, int(np.count_nonzero(row)) - 1)


def verify_uniforms(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The uniforms of one verify of ``n`` positions: acceptance then sampling, always 2n of them,
    so a session's stream depends only on its sequence of block lengths."""
    u = rng.random(2 * n)
    return u[:n], u[n:]


def assemble(candidates: Sequence[int], accepted: Sequence[bool], samples: Sequence[int]) -> list[int]:
    """The choices a sampling verify returns: ``accepted[i]``: candidate i passed its test; ``samples[i]``: the draw
    from the residual at position i (from p at the last position)."""
    choices = [-1] * len(samples)
    for i, c in enumerate(candidates):
        if not accepted[i]:
            choices[i] = int(samples[i])
            return choices
        choices[i] = int(c)
    choices[len(candidates)] = int(samples[len(candidates)])
    return choices
