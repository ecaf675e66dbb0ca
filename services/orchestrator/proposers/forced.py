"""Grammar-aware drafting: the tokens a constraint's grammar forces are drafted without the drafter.

The loop holds a copy of the verifier session's grammar, advanced by committed tokens, only to draft from. Where the
grammar allows one continuation for a while (a JSON key, a closing bracket), llguidance's fast-forward tokens are sent
as one block's candidates. Elsewhere a greedy request's drafter returns each candidate's likeliest ids
(``Draft.ranked``) and the block takes at each position the best-ranked id the grammar allows (:meth:`Guide.choose`),
so the drafter never proposes a candidate the verifier must refuse; a block without ranks is cut before its first
refused candidate. The verifier still decides every token, so the output is unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

from kakeya.core.constraints import Constraint, Grammar, tokenizer
from kakeya.orchestrator.proposers import FORCED, DraftState, Proposal

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
