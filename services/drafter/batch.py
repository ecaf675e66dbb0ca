"""Several sessions' draft calls as one batched forward (backend-neutral).

``draft_batch(items)`` is what the drafter server's compute thread runs when
Draft requests of several streams queue up together: each item is checked
exactly as ``DrafterSession.draft`` checks it (a bad item gets its own
exception as its result; the others still run), then all sessions' new aux
rows are projected in ONE context extension and all blocks of size >= 2 run
through ONE forward and one LM head call (``model.batched``: ``drafter/mlx_backend/batch.py``
or ``drafter/torch_backend/batch.py``). Sessions may differ in context length, block size,
last token and sampling: a greedy session gets its argmax tokens, a sampling
one its ``Draft`` drawn from its own logits rows with its own seeded stream,
as it would alone. A batch of one is the plain ``DrafterSession.draft`` path.

Alone and batched run the same arithmetic on the same rows, but a matrix
multiply over more rows may round differently (BLAS picks its kernel by shape:
on a CPU, ~1e-5 in float32 logits), so the tokens are those of drafting alone
except at a float tie between two candidates. Drafts are proposals: the
verifier's greedy or lossless acceptance keeps the output exact either way.
"""

from __future__ import annotations

from typing import Any, Sequence

from kakeya.core.contract import Draft
from kakeya.drafter.sampling import sampled_draft
from kakeya.drafter.session import DrafterSession


def draft_batch(items: Sequence[tuple[DrafterSession, Any, int, int]]) -> list[Any]:
    """``items``: (session, new_aux, last_token, block_size) each. One result per item, in order:
    its ``Draft``, or the exception it raised (to be raised to that item's caller alone)."""
    results: list[Any] = [None] * len(items)
    groups: dict[int, list] = {}  # sessions of one loaded model batch together
    seen: set[int] = set()
    for i, (session, new_aux, last_token, block_size) in enumerate(items):
        try:
            if id(session) in seen:
                raise ValueError("a session drafts at most once per batch (its next block needs this one's tokens)")
            aux = session.check(new_aux, last_token, block_size)
        except Exception as exc:  # noqa: BLE001 -- this item's own failure, reported to its caller
            results[i] = exc
            continue
        seen.add(id(session))
        groups.setdefault(id(session.model), []).append((i, session, aux, last_token, block_size))
    for work in groups.values():
        if len(work) < getattr(work[0][1].model, "min_batch", 2):
            for i, session, aux, last_token, block_size in work:
                try:
                    results[i] = session.run(aux, last_token, block_size)
                except Exception as exc:  # noqa: BLE001 -- this item's own failure
                    results[i] = exc
        else:
            for i, out in _run(work):
                results[i] = out
    return results


def _run(work: list) -> list[tuple[int, Any]]:
    """Sessions of one model: one context extension, one block forward, one host sync for the greedy ones."""
    model = work[0][1].model
    caches = [session.cache for _, session, *_ in work]
    for _, session, *_ in work:
        session.calls += 1
    model.batched.extend(model, caches, [aux for _, _, aux, _, _ in work])
    blocks = [w for w in work if w[4] > 1]
    out = [(i, Draft(())) for i, *_, block_size in work if block_size == 1]  # block size 1: extend only
    if not blocks:
        for cache in caches:
            model.settle(cache)
        return out
    logits = model.batched.logits(model, [(session.cache, last, size) for _, session, _, last, size in blocks])
    greedy = any(session.sampling is None for _, session, *_ in blocks)
    tokens = model.batched.argmax(logits, caches) if greedy else None  # evaluates every cache too
    at = 0
    for i, session, _, _, size in blocks:
        rows = slice(at, at + size - 1)
        at += size - 1
        if session.sampling is None:
            out.append((i, Draft(tokens[rows])))
        else:
            out.append((i, sampled_draft(logits[rows], model.sampler, session.sampling, session.rng)))
    if not greedy:
        for cache in caches:
            model.settle(cache)
    return out
