"""What a generation produced: its committed blocks and the record kept as they come."""

from __future__ import annotations

from dataclasses import dataclass, field

from kakeya.core.request import GREEDY, SamplingParams


@dataclass
class Block:
    """What one step of the loop committed (the prefill's first token is a block of its own)."""

    tokens: list[int]
    drafted: int  # candidates proposed (0 for the prefill token and block size 1)
    accepted: int  # candidates accepted
    draft_s: float = 0.0
    verify_s: float = 0.0  # the verifier's one step: verify and commit
    total_s: float = 0.0
    predrafted: bool = False  # its candidates were pre-drafted while the block before it was verified
    copied: bool = False  # its candidates were copied from earlier in the context (``orchestrator/ngram.py``)


@dataclass
class Generation:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    blocks: list[Block] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens resumed from a prefix cache's snapshot instead of prefilled
    finish_reason: str = "length"  # "stop" | "length"
    prefill_s: float = 0.0
    decode_s: float = 0.0
    drafter_fallback: bool = False  # the drafter failed and the verifier finished alone
    predrafts: int = 0  # pre-drafts started (the blocks with ``predrafted`` set are the ones used)
    verifier_stats: dict = field(default_factory=dict)  # the verifier session's stats() at the end
    sampling: SamplingParams = GREEDY  # as run: with the seed used when sampling

    @property
    def acceptance_lengths(self) -> list[int]:
        """Tokens committed per speculative block (the prefill token is not a block)."""
        return [len(b.tokens) for b in self.blocks[1:]]

    @property
    def mean_acceptance(self) -> float:
        lengths = self.acceptance_lengths
        return sum(lengths) / len(lengths) if lengths else 0.0

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first one, per second of decoding (the first comes from prefill)."""
        n = len(self.token_ids) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0
