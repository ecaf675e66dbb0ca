"""A sampling drafter's block under either rule (backend-neutral; the rules: ``core/sampling.py``).

q_i is the target's temperature / top-k / top-p / min-p applied to the drafter's own logits. Coupled:
candidate i is argmax(processed q_i + G(seed, position, token)), the verifier's noise, made on the device:
only the B-1 ids leave it. Rejection: q_i cut to its top-K and renormalised is both what the candidate is
drawn from and what the verifier tests min(1, p/q') against; [B-1, K] ids and probabilities leave the
device and the draw is on the host from the session's seeded stream, alike for MLX and torch.
"""

from __future__ import annotations

from kakeya.core import noise
from kakeya.core import sampling as lossless
from kakeya.core.contract import DRAFTER_STREAM, PROPOSAL_TOP_K, Draft, session_rng
from kakeya.core.request import COUPLED, SamplingParams


class CoupledDrafts:
    """A coupled-rule session's candidates: the noisy argmax of its processed logits."""

    def __init__(self, params: SamplingParams):
        self.params, self.keys = params, noise.session_keys(params.seed)

    def draft(self, logits, sampler, first_position: int) -> Draft:
        """Candidates for the ``logits`` rows [B-1, V] (device), row i at position ``first_position + i``."""
        return Draft(sampler.coupled_rows(logits, self.params, self.keys, first_position))


class RejectionDrafts:
    """A rejection-rule session's candidates, each drawn from the top-``PROPOSAL_TOP_K`` proposal it sends."""

    def __init__(self, params: SamplingParams):
        self.params, self.rng = params, session_rng(params.seed, DRAFTER_STREAM)

    def draft(self, logits, sampler, first_position: int) -> Draft:
        """Candidates for the ``logits`` rows [B-1, V] (device) and their proposal (positions play no part)."""
        ids, probs = sampler.proposal(logits, self.params, PROPOSAL_TOP_K)
        probs = probs / probs.sum(-1, keepdims=True)  # the top-k cut renormalised: each row a distribution
        tokens, proposal = lossless.draw_from_proposal(ids, probs, self.rng.random(ids.shape[0]))
        return Draft(tokens, proposal)


def session_rule(sampling: SamplingParams | None) -> CoupledDrafts | RejectionDrafts | None:
    """How a drafter session samples its candidates: None when greedy."""
    if sampling is None or sampling.check().greedy:
        return None
    if sampling.seed is None:
        raise ValueError("seed: a sampling session needs the request's seed (the engine draws one)")
    return CoupledDrafts(sampling) if sampling.rule == COUPLED else RejectionDrafts(sampling)
