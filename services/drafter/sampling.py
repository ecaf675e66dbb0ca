"""A sampling drafter's block: candidates drawn from the proposal it sends (backend-neutral).

The drafter's processed distribution q_i at each block position (the target's
temperature / top-k / top-p / min-p applied to the drafter's own logits, which
come through the target's LM head) is cut to its top-K and renormalised: that
q'_i is both what candidate i is sampled from and what goes to the verifier,
so the verifier's acceptance test min(1, p/q') is exact. Only [B-1, K] ids and
probabilities leave the device; the draw itself is on the host from the
session's seeded stream, identical for MLX and torch.
"""

from __future__ import annotations

from kakeya.core import sampling as lossless
from kakeya.core.contract import DRAFTER_STREAM, PROPOSAL_TOP_K, Draft, SamplingParams, session_rng


def session_sampling(sampling: SamplingParams | None):
    """(params, rng) of a drafter session: (None, None) when greedy."""
    if sampling is None or sampling.check().greedy:
        return None, None
    if sampling.seed is None:
        raise ValueError("seed: a sampling session needs the request's seed (the engine draws one)")
    return sampling, session_rng(sampling.seed, DRAFTER_STREAM)


def sampled_draft(logits, sampler, params: SamplingParams, rng, k: int = PROPOSAL_TOP_K) -> Draft:
    """Candidates for the ``logits`` rows [B-1, V] (device), each drawn from its top-``k`` proposal."""
    ids, probs = sampler.proposal(logits, params, k)
    probs = probs / probs.sum(-1, keepdims=True)  # the top-k cut renormalised: each row a distribution
    tokens, proposal = lossless.draw_from_proposal(ids, probs, rng.random(ids.shape[0]))
    return Draft(tokens, proposal)
