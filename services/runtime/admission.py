"""Admission and lifetime of a server's sessions (verifier and drafter streams).

- a session limit (``--max-sessions``) checked when a stream opens;
- a K/V-byte budget (``--max-kv-bytes``): a session is admitted only if its
  worst case (the cache policy's exact bytes at its ``max_positions``) fits
  beside every admitted session's worst case;
- beyond either, ``RESOURCE_EXHAUSTED`` naming the limit, or a bounded wait
  (``--queue N --queue-timeout S``);
- idle expiry (``--idle-timeout``): a session whose client sent nothing for
  that long (while the server waited on it) is cancelled and freed.

Every way a session ends -- finished, cancelled, errored, expired -- goes
through the idempotent :meth:`SessionRegistry.close`, which frees its cache
and its reservation.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

log = logging.getLogger("kakeya")


class SessionLimitError(Exception):
    pass


DEFAULT_MAX_SESSIONS = 64  # each open stream holds a server thread: the pool is sized from this
DEFAULT_IDLE_TIMEOUT_S = 60.0


@dataclass
class SessionEntry:
    id: str
    session: Any = None
    cache_bytes: int = 0
    kv_bytes: dict = field(default_factory=dict)  # by kind (verifier: sliding, full), for the metrics
    reserved_bytes: int = 0  # worst-case K/V bytes this session was admitted with
    closed: bool = False
    opened_at: float = field(default_factory=time.monotonic)
    last_active: float = field(default_factory=time.monotonic)
    waiting: bool = False  # blocked on the client's next message (idle time counts only then)
    cancel: Callable[[], None] | None = None  # ends the stream (the idle watcher's tool)
    idle_expired: bool = False


class SessionRegistry:
    """Live sessions of one server: admission (count and K/V-byte limits, optional wait queue),
    idle expiry, and the bytes they hold. ``close`` is idempotent and safe from any thread.
    """

    def __init__(
        self,
        max_sessions: int = 0,
        max_kv_bytes: int = 0,
        queue: int = 0,
        queue_timeout_s: float = 0.0,
        idle_timeout_s: float = 0.0,
    ):
        self.max_sessions = max(0, int(max_sessions))
        self.max_kv_bytes = max(0, int(max_kv_bytes))
        self.queue = max(0, int(queue))
        self.queue_timeout_s = max(0.0, float(queue_timeout_s))
        self.idle_timeout_s = max(0.0, float(idle_timeout_s))
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)
        self._live: dict[str, SessionEntry] = {}
        self._waiting = 0
        self.total = 0
        self.expired = 0
        if self.idle_timeout_s:
            threading.Thread(target=self._idle_watch, name="session-idle-watch", daemon=True).start()

    def _admit(self, fits: Callable[[], str | None]) -> None:
        """Wait (under the lock) until ``fits()`` names no limit, within the queue's bounds."""
        problem = fits()
        if problem is None:
            return
        if not self.queue or self._waiting >= self.queue:
            extra = f"; wait queue full ({self._waiting} of {self.queue}, --queue)" if self.queue else ""
            raise SessionLimitError(problem + extra)
        self._waiting += 1
        try:
            deadline = time.monotonic() + self.queue_timeout_s
            while problem is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SessionLimitError(f"{problem}; waited {self.queue_timeout_s:g} s in the queue (--queue-timeout)")
                self._freed.wait(left)
                problem = fits()
        finally:
            self._waiting -= 1

    def open(self) -> SessionEntry:
        def fits():
            if self.max_sessions and len(self._live) >= self.max_sessions:
                return f"session limit reached: {len(self._live)} of {self.max_sessions} sessions live (--max-sessions)"
            return None

        with self._lock:
            self._admit(fits)
            entry = SessionEntry(uuid.uuid4().hex[:12])
            self._live[entry.id] = entry
            self.total += 1
            return entry

    def reserve(self, entry: SessionEntry, nbytes: int) -> None:
        """Admit ``entry`` for a worst case of ``nbytes`` K/V bytes (the ``--max-kv-bytes`` budget)."""

        def fits():
            if not self.max_kv_bytes:
                return None
            if nbytes > self.max_kv_bytes:
                return (f"K/V budget: this session may need {nbytes} bytes, more than the whole budget"
                        f" {self.max_kv_bytes} (--max-kv-bytes); ask for fewer positions or a bounded cache policy")
            held = self._reserved()
            if held + nbytes > self.max_kv_bytes:
                return (f"K/V budget exhausted: {held} of {self.max_kv_bytes} bytes reserved, this session needs"
                        f" {nbytes} (--max-kv-bytes)")
            return None

        with self._lock:
            if entry.closed:
                return
            self._admit(fits)
            entry.reserved_bytes = int(nbytes)

    def _reserved(self) -> int:
        return sum(e.reserved_bytes for e in self._live.values())

    def close(self, entry: SessionEntry) -> None:
        with self._lock:
            if entry.closed:
                return
            entry.closed = True
            self._live.pop(entry.id, None)
            session, entry.session, entry.cache_bytes, entry.kv_bytes, entry.reserved_bytes = entry.session, None, 0, {}, 0
            self._freed.notify_all()
        if session is not None:
            try:
                session.close()  # drops the cache arrays; safe while a step still holds its own references
            except Exception:  # pragma: no cover - closing must never fail a stream
                log.exception("closing session %s", entry.id)

    def _idle_watch(self) -> None:
        period = min(1.0, self.idle_timeout_s / 4)
        while True:
            time.sleep(period)
            now = time.monotonic()
            with self._lock:
                idle = [e for e in self._live.values() if e.waiting and now - e.last_active > self.idle_timeout_s]
            for e in idle:
                log.warning("session %s idle for %.0f s (--idle-timeout): closing it", e.id, now - e.last_active)
                e.idle_expired = True
                self.expired += 1
                if e.cancel is not None:
                    e.cancel()
                self.close(e)

    @property
    def live(self) -> int:
        with self._lock:
            return len(self._live)

    @property
    def live_bytes(self) -> int:
        with self._lock:
            return sum(e.cache_bytes for e in self._live.values())

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
