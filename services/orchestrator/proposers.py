"""Draft sources as proposers: each block's candidates come from the first proposer that has some.

A proposer looks at a decode's state (:class:`DraftState`) and returns a :class:`Proposal` -- what it drafted and why --
or None. The loop asks them in order: the grammar's forced tokens (:class:`Guide`), a copy from the context
(:class:`NgramProposer`), then the drafter (``decode/loop.py``'s ``DrafterProposer``, which always answers), as vLLM's
spec_decode proposers do. Every proposal is lossless: the verifier accepts only candidates equal to its own choices.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from kakeya.core.constraints import Constraint, Grammar, tokenizer
from kakeya.core.request import MAX_BLOCK_SIZE

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


# --------------------------------------------------------------------------- grammar-forced tokens
# The loop holds a copy of the verifier session's grammar, advanced by committed tokens, only to draft from. Where
# the grammar allows one continuation for a while (a JSON key, a closing bracket), llguidance's fast-forward tokens
# are one block's candidates. Elsewhere a greedy request's drafter returns each candidate's likeliest ids
# (``Draft.ranked``) and the block takes at each position the best-ranked id the grammar allows, so the drafter never
# proposes a candidate the verifier must refuse; a block without ranks is cut before its first refused candidate.

# The drafter's likeliest ids per candidate a greedy constrained request chooses among (``Draft.ranked``): the
# most a drafter gives, since a refused id costs only one grammar check (why not 8: docs/structured.md).
RANKED = 16


class Guide:
    """The grammar after the tokens committed so far; as a proposer (:meth:`propose`) it drafts the tokens it
    forces, and it cuts the drafter's blocks to what it allows (:meth:`choose`, :meth:`allowed_prefix`)."""

    def __init__(self, grammar: Grammar):
        self.grammar = grammar
        self._seen = 0

    def propose(self, state: DraftState) -> Proposal | None:
        """The tokens the grammar forces next, as many as one block takes (the cache's rollback slack), as one
        block: the drafter only takes the new positions' aux."""
        run = self.forced(state.committed, min(state.room, state.max_block) - 1)
        return Proposal(run, FORCED, f"the grammar allows one continuation of {len(run)} tokens") if run else None

    def forced(self, committed: Sequence[int], limit: int) -> tuple[int, ...]:
        """At most ``limit`` tokens the grammar forces after ``committed`` (the generation's tokens so far)."""
        self._catch_up(committed)
        return tuple(self.grammar.forced()[:limit]) if limit > 0 else ()

    def allowed_prefix(self, committed: Sequence[int], candidates: Sequence[int]) -> int:
        """How many of the drafter's ``candidates`` the grammar allows in a row after ``committed``: the ones
        after the first it refuses could never be accepted (the verifier's choice there is an allowed token)."""
        self._catch_up(committed)
        return self.grammar.allowed_prefix(candidates)

    def choose(self, committed: Sequence[int], ranked: Sequence[Sequence[int]]) -> tuple[int, ...]:
        """Each position's best-ranked id the grammar allows, up to a position where none is."""
        self._catch_up(committed)
        return tuple(self.grammar.choose(ranked))

    def _catch_up(self, committed: Sequence[int]) -> None:
        self.grammar.advance(committed[self._seen :])
        self._seen = len(committed)


def open_guide(constraint: Constraint, tokenizer_json: str, vocab: int, eos_ids: Sequence[int]) -> Guide:
    """A :class:`Guide` for ``constraint`` (checked already: it compiles) over the checkpoint's tokenizer."""
    return Guide(Grammar(constraint.grammar(), tokenizer(tokenizer_json, vocab, (int(eos_ids[0]),))))


# --------------------------------------------------------------------------- n-gram copies
# Prompt-lookup decoding (vLLM's ``ngram`` method) in its simplest form: code and chat repeat themselves, and a small
# drafter continues such runs worse than a lookup does (``benchmarks/ngram.py``). A block is copied when the match is
# at least ``MIN_MATCH`` tokens. The index is incremental (each call indexes the tokens committed since the last), so
# a block costs a few dict operations whatever the context's length.

MIN_MATCH = 3  # shortest suffix whose earlier occurrence is trusted (2 matched as often but copied worse)
MAX_MATCH = 8  # longest suffix looked up: the longest match wins, and past 8 tokens one is as good as another


class NgramIndex:
    """Where each n-gram of a growing token stream last ended, and the copy that follows the stream's suffix."""

    def __init__(self, min_match: int = MIN_MATCH, max_match: int = MAX_MATCH):
        if not 1 <= min_match <= max_match:
            raise ValueError(f"need 1 <= min_match <= max_match, got {min_match}, {max_match}")
        self.min_match, self.max_match = min_match, max_match
        self._ends: dict[tuple[int, ...], int] = {}  # n-gram -> the index just past its latest occurrence
        self._indexed = 0  # n-grams ending at indices below this are in ``_ends``

    def propose(self, tokens: Sequence[int], k: int) -> tuple[int, ...]:
        """Up to ``k`` tokens to follow ``tokens`` (the whole stream so far, growing between calls): the continuation of
        the latest earlier occurrence of its longest suffix of ``min_match`` to ``max_match`` tokens; () when there is
        none. A continuation running into the stream's end repeats the period it found."""
        n_tokens = len(tokens)
        if n_tokens < self._indexed:
            raise ValueError("the token stream shrank: an NgramIndex follows one growing stream")
        # Index every n-gram that ends before the last token: the suffix itself must not match itself.
        for end in range(max(self._indexed, 1), n_tokens):
            for n in range(self.min_match, min(self.max_match, end) + 1):
                self._ends[tuple(tokens[end - n : end])] = end
        self._indexed = max(self._indexed, n_tokens)
        if k < 1:
            return ()
        for n in range(min(self.max_match, n_tokens - 1), self.min_match - 1, -1):
            start = self._ends.get(tuple(tokens[n_tokens - n :]))
            if start is not None:
                period = n_tokens - start
                return tuple(tokens[start + i % period] for i in range(k))
        return ()


class NgramProposer:
    """Draft by copy (greedy and coupled decodes): the index over prompt + committed tokens proposes the next
    block where the context's suffix occurred before, sized as the decode sizes a copy (a sizer that has seen
    copies break at once says 1: the drafter drafts this block instead)."""

    def __init__(self):
        self.index, self._stream = NgramIndex(), []

    def propose(self, state: DraftState) -> Proposal | None:
        stream, committed = self._stream, state.committed
        if not stream:
            stream.extend(state.prompt_ids)
        stream.extend(committed[len(stream) - len(state.prompt_ids) :])
        copy = self.index.propose(stream, MAX_BLOCK_SIZE - 1)
        if not copy:
            return None
        size = min(state.size(True), state.room)
        if size < 2:
            return None
        return Proposal(copy[: size - 1], NGRAM, "the context's last tokens occurred before: what followed them")
