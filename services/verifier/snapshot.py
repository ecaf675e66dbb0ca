"""A verifier session's state after a token prefix, kept in its verifier's prefix cache and resumed from.

A snapshot is what a cold prefill of exactly those tokens leaves under one resolved cache policy: the ring
layout, every layer's K/V (a ring whole, a full-attention cache's first ``positions``) and, with f_theta,
the latent ring and its layout. It is taken from a session whose generation is over, trimmed back to the
prefix first (exactly: at most the ring's slack), and copied; resuming copies it into a new session's own
caches, so any number of sessions may resume from one snapshot and none changes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kakeya.verifier.layout import trim_is_exact


@dataclass(frozen=True)
class RingState:
    slots: np.ndarray  # each slot's position (EMPTY: none); never edited in place (RingLayout.resume)
    offset: int
    written: int
    used: int


@dataclass(frozen=True)
class VerifierSnapshot:
    positions: int
    ring: RingState
    caches: list[list]  # per cache layer, its arrays (``SessionCaches.copy``)
    latent_ring: RingState | None = None  # f_theta restoration only
    latents: Any = None
    nbytes: int = 0


def _ring(layout) -> RingState:
    return RingState(layout.positions, layout.offset, layout.written, layout.used)


def take(session) -> VerifierSnapshot:
    """A copy of ``session``'s (a ``LocalVerifierSession``) state at its offset (every forward applied, none pending)."""
    positions = session.offset
    caches = session.target.copy_caches(session.cache, positions)
    nbytes = sum(a.nbytes for layer in caches for a in layer) + session.layout.positions.nbytes
    latent_ring = latents = None
    if session.latents is not None:
        latent_ring, latents = _ring(session.latent_layout), session.latents.copy()
        nbytes += latents.nbytes
    return VerifierSnapshot(positions, _ring(session.layout), caches, latent_ring, latents, nbytes)


def restore(session, snap: VerifierSnapshot, back: int = 0) -> bool:
    """Set a new session (same target and resolved policy, nothing run yet) to ``snap``'s state, less its
    newest ``back`` positions (a prompt that shares the snapshot's ids only that far). False, the session
    left as it was, where forgetting them would not be exact (``RingLayout.can_trim``: a ring keeps
    ``slack`` positions' worth of rollback, and the snapshot may have used some)."""
    rings = [(session.layout, snap.ring)]
    if snap.latent_ring is not None:
        rings.append((session.latent_layout, snap.latent_ring))
    if not all(trim_is_exact(r.offset, r.written, back, layout.slack) for layout, r in rings):
        return False
    for layout, r in rings:
        layout.resume(r.slots, r.offset, r.written, r.used)
    session.target.load_caches(session.cache, snap.caches, snap.positions)
    if snap.latent_ring is not None:
        session.latents.load(snap.latents)
    for layout, _ in rings:
        if back:
            layout.trim(back)
    return True


def resume(session, reuse, count: bool) -> int:
    """Resume a new ``session`` (with a prefix cache) from the longest snapshot ``reuse`` allows (None: any),
    or the longest prefix of one its prompt shares that the ring can trim back to exactly; the positions it
    holds (0: a cold prefill). ``count``: the lookup counts as a hit or a miss (the verifier's lookup decides; a drafter
    only offers what it holds)."""
    found = session.prefixes.find(session.policy, session.prompt, reuse, partial=True) if reuse is None or reuse else []
    for match in found:  # longest first
        if restore(session, match.value, match.back):
            break
    if count:
        session.prefixes.count(session.offset)
    return session.offset


def save(session, ids) -> bool:
    """Keep ``session``'s state after exactly ``ids`` in its prefix cache: the session (its generation over)
    is trimmed back to ``len(ids)``, only as far as the ring stays exact (``RingLayout.can_trim``), and
    closed after. False when nothing was kept (no prefix cache, out of reach, over budget)."""
    session._check_open()
    if session._pending is not None:
        raise RuntimeError("save: commit the pending block first")
    if tuple(ids[: len(session.prompt)]) != session.prompt or len(ids) < len(session.prompt):
        raise ValueError("save: ids must start with the session's prompt")
    back = session.offset - len(ids)
    if session.prefixes is None or not session.layout.can_trim(back):
        return False
    session.trim(back)
    snap = take(session)
    return session.prefixes.put(session.policy, ids, snap, snap.nbytes)
