"""Admission and lifetime of a server's sessions (verifier and drafter streams).

``--max-sessions`` and ``--max-sessions-per-peer`` when a stream opens; ``--max-kv-bytes`` (the verifier: the policy's
worst case at ``max_positions``; the drafter: its context as it grows); under pressure the longest-idle session
(``--reclaim-idle``) is ended before anyone is refused; then ``RESOURCE_EXHAUSTED`` naming the limit, or a bounded wait
(``--queue``); a session that alone outgrows the K/V budget is ``OUT_OF_RANGE`` at once (no wait or reclaim could
make it fit); idle expiry (``--idle-timeout``). Every way a session ends goes through the idempotent
:meth:`SessionRegistry.close`, which frees its cache and reservation.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

log = logging.getLogger("kakeya")


class SessionLimitError(Exception):
    """A session refused (or ended) by a limit; the message names the flag. ``code``: RESOURCE_EXHAUSTED (the
    server is full now: a retry may fit) or OUT_OF_RANGE (this session alone outgrows the limit: none will)."""

    def __init__(self, problem: str, code: grpc.StatusCode = grpc.StatusCode.RESOURCE_EXHAUSTED):
        super().__init__(problem)
        self.code = code


DEFAULT_MAX_SESSIONS = 64  # each open stream holds a server thread: the pool is sized from this
DEFAULT_IDLE_TIMEOUT_S = 60.0
# A session's client silent this long may lose it to a new session when the server is full. Far above
# what a live generation leaves a stream idle (one drafter or verifier step: milliseconds to a second).
DEFAULT_RECLAIM_IDLE_S = 5.0
RECLAIM_POLL_S = 0.25  # how often a queued session looks for one that has gone idle


@dataclass
class SessionEntry:
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])  # in the logs and the Opened reply
    peer: str = ""  # who opened it (``auth.peer_of``): the per-peer limit counts by this
    session: Any = None
    cache_bytes: int = 0
    kv_bytes: dict = field(default_factory=dict)  # by kind (verifier: sliding, full), for the metrics
    reserved_bytes: int = 0  # K/V bytes this session was admitted with (the budget counts these)
    closed: bool = False
    last_active: float = field(default_factory=time.monotonic)
    waiting: bool = False  # blocked on the client's next message (idle time counts only then)
    queued: bool = False  # not admitted yet: waits for a slot in the --queue once its open is read (servicer._serve)
    end: Callable[[grpc.StatusCode, str], None] | None = None  # ends the stream with a status (expiry, reclaim)
    # what a round call (``servicer.serve_round``) needs to step this session beside its stream;
    # None until the session may step in one (the servicer sets it)
    round: Any = None

    def idle_s(self, now: float) -> float:
        """How long the session has waited on its client (0 while it works)."""
        return now - self.last_active if self.waiting else 0.0


@dataclass(frozen=True)
class _Refusal:
    """Why a session does not fit, and whose idle sessions could make room (None: anyone's)."""

    problem: str
    peer: str | None = None
    code: grpc.StatusCode = grpc.StatusCode.RESOURCE_EXHAUSTED  # OUT_OF_RANGE: it never fits (no wait, no reclaim)


class SessionRegistry:
    """Live sessions of one server: admission, idle expiry, the bytes they hold (see the module docstring)."""

    def __init__(self, max_sessions: int = 0, max_kv_bytes: int = 0, queue: int = 0, queue_timeout_s: float = 0.0,
                 idle_timeout_s: float = 0.0, *, max_per_peer: int = 0, reclaim_idle_s: float = 0.0,
                 close: Callable[[Callable[[], None]], None] | None = None):  # fmt: skip
        # how a session is closed: where its steps run (a server's compute thread: a close queued behind the
        # steps already queued never lands in the middle of a batch of other sessions' steps); None: at once
        self._close = close or (lambda fn: fn())
        self.max_sessions = max(0, int(max_sessions))
        self.max_kv_bytes = max(0, int(max_kv_bytes))
        self.queue = max(0, int(queue))
        self.queue_timeout_s = max(0.0, float(queue_timeout_s))
        self.idle_timeout_s = max(0.0, float(idle_timeout_s))
        self.max_per_peer = max(0, int(max_per_peer))
        self.reclaim_idle_s = max(0.0, float(reclaim_idle_s))
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)
        self._live: dict[str, SessionEntry] = {}
        self._waiting = 0
        self.total = 0
        self.reclaimed = 0
        if self.idle_timeout_s:
            threading.Thread(target=self._idle_watch, name="session-idle-watch", daemon=True).start()

    def _admit(self, fits: Callable[[], _Refusal | None], reclaimed: list, wait: bool = True) -> None:
        """Wait (under the lock) until ``fits()`` refuses nothing, within the queue's bounds (``wait``). Idle sessions
        are reclaimed first, each into ``reclaimed`` as ``(entry, why)`` for :meth:`_finish` once the lock is
        released."""
        refusal = self._fit_reclaiming(fits, reclaimed)
        if refusal is None:
            return
        if refusal.code == grpc.StatusCode.OUT_OF_RANGE:
            raise SessionLimitError(refusal.problem, refusal.code)
        if not wait or not self.queue or self._waiting >= self.queue:
            extra = f"; wait queue full ({self._waiting} of {self.queue}, --queue)" if wait and self.queue else ""
            raise SessionLimitError(refusal.problem + extra)
        self._waiting += 1
        try:
            deadline = time.monotonic() + self.queue_timeout_s
            while refusal is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SessionLimitError(
                        f"{refusal.problem}; waited {self.queue_timeout_s:g} s in the queue (--queue-timeout)"
                    )
                if reclaimed:  # end them now, not after the wait (their streams must not hang meanwhile)
                    self._lock.release()
                    try:
                        self._finish(reclaimed)
                    finally:
                        self._lock.acquire()
                # freed room wakes us; a session that goes idle meanwhile does not, so look again now and then
                self._freed.wait(min(left, RECLAIM_POLL_S) if self.reclaim_idle_s else left)
                refusal = self._fit_reclaiming(fits, reclaimed)
        finally:
            self._waiting -= 1

    def _fit_reclaiming(self, fits, reclaimed: list) -> _Refusal | None:
        """``fits()``, reclaiming the longest-idle session it may take while that names a limit."""
        while (refusal := fits()) is not None:
            victim = None if refusal.code == grpc.StatusCode.OUT_OF_RANGE else self._longest_idle(refusal.peer)
            if victim is None:
                return refusal
            why = (
                f"session reclaimed after {victim.idle_s(time.monotonic()):.0f} s without a message from its client:"
                f" a new session needed its room ({refusal.problem.partition(':')[0]}; --reclaim-idle {self.reclaim_idle_s:g})"
            )
            self.reclaimed += 1
            reclaimed.append((self._detach(victim), why))
        return None

    def _longest_idle(self, peer: str | None) -> SessionEntry | None:
        """The session (of ``peer``, or anyone's) waiting longest on its client, if past --reclaim-idle."""
        if not self.reclaim_idle_s:
            return None
        now = time.monotonic()
        idle = [
            e for e in self._live.values() if (peer is None or e.peer == peer) and e.idle_s(now) >= self.reclaim_idle_s
        ]
        return max(idle, key=lambda e: e.idle_s(now), default=None)

    def _finish(self, reclaimed: list) -> None:
        """End the reclaimed sessions' streams, saying why, and free them (never under the lock)."""
        while reclaimed:
            entry, why = reclaimed.pop()
            log.warning("session %s of %s: %s", entry.id, entry.peer or "?", why)
            self._end(entry, grpc.StatusCode.ABORTED, why)

    def may_queue(self) -> bool:
        """Whether a session refused now could wait in the ``--queue`` (a place is free in it)."""
        with self._lock:
            return bool(self.queue) and self._waiting < self.queue

    def open(self, peer: str = "", entry: SessionEntry | None = None, wait: bool = True) -> SessionEntry:
        """A new session of ``peer`` (``auth.peer_of``), or SessionLimitError naming the limit. ``entry``: one made
        before it waits (``lifecycle.session_stream``), so that its client, leaving, ends the wait (``close``)."""
        entry = entry or SessionEntry(peer=peer)

        def fits() -> _Refusal | None:
            if entry.closed:
                return None
            if self.max_per_peer:
                held = sum(1 for e in self._live.values() if e.peer == peer)
                if held >= self.max_per_peer:
                    return _Refusal(f"per-peer session limit reached: {held} of {self.max_per_peer} sessions live"
                                    " from this caller (--max-sessions-per-peer)", peer)  # fmt: skip
            if self.max_sessions and len(self._live) >= self.max_sessions:
                return _Refusal(
                    f"session limit reached: {len(self._live)} of {self.max_sessions} sessions live (--max-sessions)"
                )
            return None

        reclaimed: list = []
        try:
            with self._lock:
                self._admit(fits, reclaimed, wait)
                if not entry.closed:
                    self._live[entry.id] = entry
                    self.total += 1
        finally:
            self._finish(reclaimed)
        return entry

    def find(self, session_id: str, peer: str) -> SessionEntry | None:
        """The live session ``session_id`` if ``peer`` opened it; None otherwise (unknown, ended, or another
        caller's: a caller can neither address nor tell apart the sessions of others)."""
        with self._lock:
            entry = self._live.get(session_id)
            return entry if entry is not None and entry.peer == peer else None

    def reserve(self, entry: SessionEntry, nbytes: int, wait: bool = True) -> None:
        """Admit ``entry`` for ``nbytes`` K/V bytes (the ``--max-kv-bytes`` budget); its reservation
        becomes ``nbytes``. A session that grows (the drafter's context) asks again with ``wait``
        False: one that already holds memory must never wait for others that might wait for it."""

        def fits() -> _Refusal | None:
            if not self.max_kv_bytes or entry.closed:  # (a closed one's wait ends: its client left the queue)
                return None
            if nbytes > self.max_kv_bytes:
                return _Refusal(
                    f"K/V budget: this session may need {nbytes} bytes, more than the whole budget"
                    f" {self.max_kv_bytes} (--max-kv-bytes); ask for fewer positions or a bounded cache policy",
                    code=grpc.StatusCode.OUT_OF_RANGE,
                )
            held = self._reserved() - entry.reserved_bytes
            if held + nbytes > self.max_kv_bytes:
                return _Refusal(
                    f"K/V budget exhausted: {held} of {self.max_kv_bytes} bytes reserved, this session needs"
                    f" {nbytes} (--max-kv-bytes)"
                )
            return None

        reclaimed: list = []
        try:
            with self._lock:
                if entry.closed:
                    return
                self._admit(fits, reclaimed, wait)
                entry.reserved_bytes = int(nbytes)
        finally:
            self._finish(reclaimed)

    def _reserved(self) -> int:
        return sum(e.reserved_bytes for e in self._live.values())

    def _detach(self, entry: SessionEntry) -> SessionEntry:
        """Drop ``entry`` from the live sessions (under the lock); :meth:`_end` then frees its session."""
        entry.closed = True
        self._live.pop(entry.id, None)
        entry.cache_bytes, entry.kv_bytes, entry.reserved_bytes = 0, {}, 0
        self._freed.notify_all()
        return entry

    def _end(self, entry: SessionEntry, code: grpc.StatusCode | None = None, why: str = "") -> None:
        """End a detached entry's stream (with ``code`` and ``why``, if given) and free its session."""
        if code is not None and entry.end is not None:
            entry.end(code, why)
        with self._lock:
            session, entry.session = entry.session, None
        if session is not None:
            self._close(lambda: self._close_now(session, entry.id))

    @staticmethod
    def _close_now(session, entry_id: str) -> None:
        try:
            session.close()  # drops the cache arrays
        except Exception:  # pragma: no cover - closing must never fail a stream
            log.exception("closing session %s", entry_id)

    def close(self, entry: SessionEntry) -> None:
        """End ``entry`` (any thread, any number of times); a session attached after it ended is freed too."""
        with self._lock:
            if not entry.closed:
                self._detach(entry)
        self._end(entry)

    def end_all(self, code: grpc.StatusCode, why: str) -> int:
        """End every live session's stream with ``code`` and ``why`` (a drain's last step); how many there were."""
        with self._lock:
            ended = [self._detach(e) for e in list(self._live.values())]
        for e in ended:
            self._end(e, code, why)
        return len(ended)

    def _idle_watch(self) -> None:
        period = min(1.0, self.idle_timeout_s / 4)
        while True:
            time.sleep(period)
            now = time.monotonic()
            with self._lock:
                idle = [self._detach(e) for e in list(self._live.values()) if e.idle_s(now) > self.idle_timeout_s]
            for e in idle:
                why = f"session closed after {e.idle_s(now):.0f} s without a message from its client (--idle-timeout {self.idle_timeout_s:g})"
                log.warning("session %s of %s: %s", e.id, e.peer or "?", why)
                self._end(e, grpc.StatusCode.DEADLINE_EXCEEDED, why)

    @property
    def live(self) -> int:
        with self._lock:
            return len(self._live)

    @property
    def live_bytes(self) -> int:
        with self._lock:
            return sum(e.cache_bytes for e in self._live.values())

    @property
    def waiting(self) -> int:
        """Sessions waiting in the admission queue (``--queue``) now."""
        with self._lock:
            return self._waiting

    def info_counts(self) -> dict[str, int]:  # the GetInfo fields verifier and drafter both fill from here
        return dict(live_sessions=self.live, max_sessions=self.max_sessions, live_kv_bytes=self.live_bytes,
                    total_sessions=self.total, queued_sessions=self.waiting)  # fmt: skip

    @property
    def reserved_bytes(self) -> int:
        with self._lock:
            return self._reserved()

    def bytes_by_kind(self, default_kind: str) -> dict[str, int]:
        """Live cache bytes by kind (entries without a breakdown count as ``default_kind``)."""
        out: dict[str, int] = {}
        with self._lock:
            for e in self._live.values():
                for kind, n in (e.kv_bytes or {default_kind: e.cache_bytes}).items():
                    out[kind] = out.get(kind, 0) + int(n)
        return out


class Watched:
    """A request iterator that tells the registry when the session waits on its client."""

    def __init__(self, requests, entry: SessionEntry):
        self._it, self._entry = iter(requests), entry

    def __iter__(self):
        return self

    def __next__(self):
        e = self._entry
        e.last_active, e.waiting = time.monotonic(), True
        try:
            return next(self._it)
        finally:
            e.waiting, e.last_active = False, time.monotonic()
