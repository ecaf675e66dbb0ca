"""N-gram drafts: propose a block by copying what followed the context's last tokens the last time they occurred.

Prompt-lookup decoding (vLLM's ``ngram`` method) in its simplest form: code and chat repeat themselves, and
a small drafter continues such runs worse than a lookup does (``benchmarks/ngram.py``). The loop drafts by
copy when the match is at least ``MIN_MATCH`` tokens and asks the drafter otherwise; the rejection rule
needs the drafter's distribution, so it never copies. The index is incremental (each call indexes the
tokens committed since the last), so a block costs a few dict operations whatever the context's length.
"""

from __future__ import annotations

from collections.abc import Sequence

from kakeya.core.request import MAX_BLOCK_SIZE
from kakeya.orchestrator.proposers import NGRAM, DraftState, Proposal

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
