"""Verify several sessions' blocks in one forward: the verifier server's batch runner.

``verify_batch(items)`` is :meth:`VerifierSession.verify` for many sessions at
once; each item is ``(session, block_ids, proposal)`` and gets back exactly
what its own ``verify`` would have returned or raised:

* every item is validated as ``verify`` validates it; a bad one gets its own
  ValueError / RuntimeError as its result and the others still run;
* the good ones of one target run as ONE forward (``target.run_batch``, e.g.
  ``verifier/torch_backend/batch.py``): each session's ring planned, written and applied as in
  its own forward, then the choices -- greedy rows through one LM head and one
  host sync (``target.greedy_batch``), a sampling session's acceptance test
  on its own logits rows with its own seeded stream -- and each session left
  with the same pending block, so ``commit`` is unchanged;
* a lone item, or one a batched forward cannot take, simply runs
  ``session.verify`` (for a lone torch greedy block that keeps the static
  step and its CUDA graphs).

Outputs stay identical to running alone because a session's rows meet other
sessions' rows only in row-wise operations (projections, norms, MLP, MoE, LM
head); attention, caches, positions, masks and random streams stay its own.
"""

from __future__ import annotations

from typing import Any, Sequence

Item = tuple  # (VerifierSession, block_ids, Proposal | None)


def verify_batch(items: Sequence[Item]) -> list[Any]:
    """One result per item, in order: its choices, or the exception its ``verify`` would raise."""
    results: list[Any] = [None] * len(items)
    groups: dict[int, list[int]] = {}  # id(target) -> items batched together
    alone: list[int] = []
    seen: set[int] = set()
    for i, (session, ids, proposal) in enumerate(items):
        try:
            session.check_block(ids, proposal)
            if id(session) in seen:  # a session has one step in flight; never two in one forward
                raise RuntimeError("commit the previous block before verifying another")
        except (ValueError, RuntimeError) as exc:
            results[i] = exc
            continue
        seen.add(id(session))
        if _batchable(session):
            groups.setdefault(id(session.target), []).append(i)
        else:
            alone.append(i)
    for group in groups.values():
        if len(group) < getattr(items[group[0]][0].target, "min_batch", 2):
            alone += group
            continue
        try:
            for i, r in zip(group, _together([items[i] for i in group])):
                results[i] = r
        except Exception as exc:  # the forward itself failed: every session in it hears why
            for i in group:
                results[i] = exc
    for i in alone:
        session, ids, proposal = items[i]
        try:
            results[i] = session.verify(ids, proposal)
        except Exception as exc:
            results[i] = exc
    return results


def _batchable(session) -> bool:
    # f_theta restoration (MLX only) writes a latent ring from each forward's aux and attends
    # over restored K/V: such a session runs alone (correct, no batching gain); so does what
    # a backend's batched forward cannot take (MLX: quantized full-attention caches).
    target = session.target
    if session.restorer is not None or not hasattr(target, "run_batch"):
        return False
    check = getattr(target, "batchable", None)
    return check is None or check(session.cache)


def _together(items: Sequence[Item]) -> list[list[int]]:
    target = items[0][0].target
    blocks = []
    for session, ids, _ in items:
        blocks.append((ids, session.cache, session.aux_layers, session.layout.plan(len(ids))))
    outs = target.run_batch(blocks)
    for session, _, _ in items:
        session.layout.applied()
    greedy_rows = [j for j, (s, _, _) in enumerate(items) if s.sampling is None]
    greedy = {}
    if greedy_rows:  # one LM head over every greedy block, split back per block
        flat, at = target.greedy_batch([outs[j].hidden for j in greedy_rows]), 0
        for j in greedy_rows:
            n = len(items[j][1])
            greedy[j], at = flat[at : at + n], at + n
    return [s.accept(ids, proposal, outs[j], greedy.get(j)) for j, (s, ids, proposal) in enumerate(items)]
