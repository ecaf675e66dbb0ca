"""Several sessions' draft calls as one batched forward (backend-neutral).

``draft_batch(items)`` is what the drafter server's compute thread runs when
Draft requests of several streams queue up together: each item is checked
exactly as ``LocalDrafterSession.draft`` checks it (a bad item gets its own
exception as its result; the others still run), then the sessions of each
model run as ``session.draft_together``: ONE ``DraftModel.draft_step`` projects
all new aux rows into the contexts and runs all blocks of size >= 2 through one
forward and one LM head call (on torch one step over pooled K/V, one attention
call per layer), which is what a session drafting alone runs with itself as the
only block. Sessions may differ in context length,
block size, last token and sampling: a greedy session gets its argmax tokens,
a sampling one its candidates from its own logits rows with its own seed (and,
under the coupled rule, its own positions), as it would alone. Fewer sessions of a model than its
``min_batch`` draft one by one.

Alone and batched run the same arithmetic on the same rows, but a matrix
multiply over more rows may round differently (BLAS picks its kernel by shape:
on a CPU, ~1e-5 in float32 logits), so the tokens are those of drafting alone
except at a float tie between two candidates. Drafts are proposals: the
verifier's acceptance (greedy, coupled or rejection) keeps the output exact
either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kakeya.core.contract import Draft
from kakeya.drafter.session import LocalDrafterSession, draft_together


@dataclass(frozen=True, slots=True)
class DraftItem:
    """One session's draft call: extend its context by ``new_aux`` (None: no new rows), then draft
    ``block_size - 1`` tokens after ``last_token`` (``LocalDrafterSession.draft``)."""

    session: LocalDrafterSession
    new_aux: Any
    last_token: int
    block_size: int


def draft_batch(items: Sequence[DraftItem]) -> list[Draft | Exception]:
    """One result per item, in order: its ``Draft``, or the exception it raised (to be raised to that
    item's caller alone)."""
    results: list[Any] = [None] * len(items)
    groups: dict[int, list] = {}  # sessions of one loaded model batch together
    seen: set[int] = set()
    for i, item in enumerate(items):
        session = item.session
        try:
            if id(session) in seen:
                raise ValueError("a session drafts at most once per batch (its next block needs this one's tokens)")
            call = session.check(item.new_aux, item.last_token, item.block_size)
        except Exception as exc:  # noqa: BLE001 -- this item's own failure, reported to its caller
            results[i] = exc
            continue
        seen.add(id(session))
        groups.setdefault(id(session.model), []).append((i, call))
    for group in groups.values():
        if len(group) >= group[0][1].session.model.min_batch:
            for (i, _), draft in zip(group, draft_together([call for _, call in group])):
                results[i] = draft
            continue
        for i, call in group:
            try:
                results[i] = call.session.run(call)
            except Exception as exc:  # noqa: BLE001 -- this item's own failure
                results[i] = exc
    return results
