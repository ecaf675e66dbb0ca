"""Draft sources as proposers: each block's candidates come from the first proposer that has some.

A proposer looks at a decode's state (:class:`DraftState`) and returns a :class:`Proposal` -- what it drafted and why --
or None. The loop asks them in order: the grammar's forced tokens (``forced.py``), a copy from the context
(``ngram.py``), then the drafter (``decode/loop.py``'s ``DrafterProposer``, which always answers), as vLLM's spec_decode
proposers do. Every proposal is lossless: the verifier accepts only candidates equal to its own choices.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

FORCED, NGRAM, DRAFTER = "forced", "ngram", "drafter"


class DraftState(NamedTuple):
    """What a proposer sees of a decode before its next block: the prompt and the committed tokens, the most
    tokens the block may commit (``room``: what ``max_tokens`` leaves), the largest block the session's cache
    rolls back (``max_block``), and ``size(copy)``: the block size the decode would choose (for a copy, or not)."""

    prompt_ids: Sequence[int]
    committed: Sequence[int]
    room: int
    max_block: int
    size: Callable[[bool], int]


@dataclass(frozen=True)
class Proposal:
    """A proposer's block: its candidates, which source drafted them and why. ``ask``: the block size asked of
    the drafter this round (1: it only takes the new positions' aux, so its context has no gap; 0: no call);
    the drafter's own proposal gets its candidates from that call's answer."""

    tokens: tuple[int, ...]
    source: str
    why: str
    ask: int = 1


class Proposer(Protocol):
    def propose(self, state: DraftState) -> Proposal | None:
        """This block's candidates, or None: the next proposer is asked."""
