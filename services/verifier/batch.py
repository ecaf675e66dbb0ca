"""Verify several sessions' blocks in one forward: the verifier server's batch runner.

``decide_batch(items)`` is :meth:`LocalVerifierSession.decide` for many sessions at
once (what the verifier server runs for the steps that queued up together), and
``verify_batch(items)`` its first half, :meth:`LocalVerifierSession.verify`; each item
of that is a :class:`VerifyItem` and gets back exactly what its own ``verify`` would
have returned or raised:

* every item is validated as ``verify`` validates it; a bad one gets its own
  ValueError / RuntimeError as its result and the others still run;
* the good ones of one target (and one ``cache.batch_key``: torch sessions whose
  full-attention K/V share a pool) run as ONE forward over their segments: each
  session's plan built by its own layout, its caches written as in its own
  forward (which is the same forward with one segment), then the choices --
  greedy rows through one LM head and one host sync (torch: inside the batched
  step, ``StaticVerify.verify_segments``; else ``backend.greedy_batch``), a
  sampling session's choices from its own logits rows with its own seed and
  positions -- and each session left with the same pending block, so ``commit``
  is unchanged;
* a lone item, fewer than ``target.min_batch`` of one group, or one a batched
  forward cannot take (:func:`batchable`) simply runs ``session.verify`` (for a
  lone torch greedy block that is the same step with one session).

:func:`counts` says how many blocks ran batched and how many alone, and why
(what a server exports as metrics).

Outputs stay identical to running alone because a session's rows meet other
sessions' rows only in row-wise operations (projections, norms, MLP, MoE, LM
head); attention, caches, positions, masks, noise and random streams stay its own.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kakeya.core.contract import Draft, Proposal, Verdict
from kakeya.verifier.backend import greedy_batch
from kakeya.verifier.session import LocalVerifierSession, verdict


@dataclass(frozen=True, slots=True)
class VerifyItem:
    """One session's block: ``block_ids`` its newest committed token then the draft's candidates; ``proposal``
    the rows they were drawn from (a rejection-rule session's), else None."""

    session: LocalVerifierSession
    block_ids: Sequence[int]
    proposal: Proposal | None = None


@dataclass
class BatchCounts:
    """Blocks :func:`verify_batch` ran, by how (process-wide, since start)."""

    forwards: int = 0  # batched forwards run
    batched: int = 0  # blocks verified in them
    alone_policy: int = 0  # blocks verified alone: their session cannot join a batched forward (:func:`batchable`)
    alone_few: int = 0  # blocks verified alone: fewer than ``min_batch`` of their group were queued


_COUNTS = BatchCounts()
_COUNTS_LOCK = threading.Lock()


def counts() -> dict[str, int]:
    """A copy of the counters (:class:`BatchCounts`)."""
    with _COUNTS_LOCK:
        return asdict(_COUNTS)


def _count(**add: int) -> None:
    with _COUNTS_LOCK:
        for k, v in add.items():
            setattr(_COUNTS, k, getattr(_COUNTS, k) + v)


def verify_batch(items: Sequence[VerifyItem]) -> list[Any]:
    """One result per item, in order: its choices, or the exception its ``verify`` would raise."""
    results: list[Any] = [None] * len(items)
    groups: dict[tuple, list[int]] = {}  # (id(target), cache batch key) -> items batched together
    alone: list[int] = []
    seen: set[int] = set()
    for i, item in enumerate(items):
        session = item.session
        try:
            session.check_block(item.block_ids, item.proposal)
            if id(session) in seen:  # a session has one step in flight; never two in one forward
                raise RuntimeError("commit the previous block before verifying another")
        except (ValueError, RuntimeError) as exc:
            results[i] = exc
            continue
        seen.add(id(session))
        if batchable(session):
            groups.setdefault((id(session.target), session.cache.batch_key), []).append(i)
        else:
            alone.append(i)
    if alone:
        _count(alone_policy=len(alone))
    for group in groups.values():
        if len(group) < items[group[0]].session.target.min_batch:
            alone += group
            _count(alone_few=len(group))
            continue
        _count(forwards=1, batched=len(group))
        try:
            for i, r in zip(group, _together([items[i] for i in group])):
                results[i] = r
        except Exception as exc:  # noqa: BLE001 - the forward itself failed: every session in it hears why
            for i in group:
                results[i] = exc
    for i in alone:
        try:
            results[i] = items[i].session.verify(items[i].block_ids, items[i].proposal)
        except Exception as exc:  # noqa: BLE001 - its own failure, its result alone
            results[i] = exc
    return results


def decide_batch(items: Sequence[tuple[LocalVerifierSession, int, Draft]]) -> list[Verdict | Exception]:
    """:meth:`LocalVerifierSession.decide` for many sessions at once (each item ``(session, last_token, draft)``,
    the contract's ``Verifier.decide_batch``): :func:`decide` of their blocks."""
    return decide([VerifyItem(s, [last, *d.tokens], d.proposal) for s, last, d in items])


def decide(items: Sequence[VerifyItem]) -> list[Verdict | Exception]:
    """One :func:`verify_batch`, then each verified block kept as the acceptance rule keeps it."""
    out: list[Verdict | Exception] = []
    for item, c in zip(items, verify_batch(items)):
        try:
            out.append(c if isinstance(c, Exception) else verdict(item.session, item.block_ids, c))
        except Exception as exc:  # noqa: BLE001 - its own failure, its result alone
            out.append(exc)
    return out


def batchable(session: LocalVerifierSession) -> bool:
    """Whether ``session`` may join a batched forward: f_theta restoration (MLX only) writes a latent
    ring from each forward's aux and attends over restored K/V, so such a session runs alone
    (correct, no batching gain); so does a cache set the backend's batched forward cannot take
    (MLX: quantized full-attention caches)."""
    return session.restorer is None and session.cache.batchable


def _together(items: Sequence[VerifyItem]) -> list[list[int]]:
    target = items[0].session.target
    segments = [it.session.forward_plan(it.block_ids) for it in items]
    wanted = [
        it.session.sampling is None and it.session.grammar is None for it in items
    ]  # the step's argmax serves these
    if target.static_verify:  # the batched step takes every greedy row's choice itself
        outs, greedy = target.verify_segments(segments, wanted)
    else:
        outs, greedy = target.forward(segments), [None] * len(items)
        rows = [j for j, w in enumerate(wanted) if w]
        if rows:  # one LM head over every greedy block, split back per block
            flat, at = greedy_batch(target, [outs[j].hidden for j in rows]), 0
            for j in rows:
                n = len(items[j].block_ids)
                greedy[j], at = flat[at : at + n], at + n
    for it, segment, out in zip(items, segments, outs):
        it.session.forward_done(segment, out)
    out = []
    for it, o, g in zip(items, outs, greedy):
        try:
            out.append(it.session.choose(it.block_ids, it.proposal, o, g))
        except Exception as exc:  # noqa: BLE001 - its own failure (a sampling session's), its result alone
            out.append(exc)
    return out
