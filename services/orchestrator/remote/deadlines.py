"""Per-step deadlines on the orchestrator's backend streams: a hung backend told from a slow one.

A hung peer (a stopped process, a wedged accelerator) never closes its connection, so only a deadline notices it. These
bound ONE step by silence, not length: every session asks its backend for a Progress message every ``PROGRESS_FRACTION``
of the deadline (``Open.progress_ms``), sent only while its compute gets work done, and each re-arms the step's
deadline. A slow backend keeps talking; a stopped one goes silent, and the step fails after ``max(--backend-timeout, 20
x the median step)`` of silence (a prefill's plus ``10 x`` the median per-token prefill time per prompt token). One
:class:`Watchdog` thread per process watches every armed step; its clock stops while this process does not run.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable

DEFAULT_BACKEND_TIMEOUT_S = 2.0
STEP_FACTOR = 20.0
PREFILL_FACTOR = 10.0
PROGRESS_FRACTION = 0.1  # Progress asked for every tenth of the floor: a backend is hung after ten silent beats
STALL_S = 0.25  # a watchdog tick this late: this process did not run meanwhile (see Watchdog)

log = logging.getLogger("kakeya.orchestrator")


class StepClock:
    """Recent step times of one backend, turned into a step's deadline of silence and the Progress interval."""

    def __init__(self, floor_s: float = DEFAULT_BACKEND_TIMEOUT_S, window: int = 64):
        if floor_s <= 0:
            raise ValueError(f"--backend-timeout must be > 0 seconds, got {floor_s:g}")
        self.floor_s = floor_s
        self._steps: deque[float] = deque(maxlen=window)
        self._per_token: deque[float] = deque(maxlen=window)
        self._lock = threading.Lock()

    def record(self, seconds: float, prefill_tokens: int = 0) -> None:
        with self._lock:
            if prefill_tokens:
                self._per_token.append(seconds / prefill_tokens)
            else:
                self._steps.append(seconds)

    @property
    def progress_ms(self) -> int:
        """``Open.progress_ms``: how often a session's backend reports progress while a step waits."""
        return max(1, round(self.floor_s * PROGRESS_FRACTION * 1000))

    def timeout(self, prefill_tokens: int = 0) -> float:
        with self._lock:
            step = statistics.median(self._steps) if self._steps else 0.0
            per_token = statistics.median(self._per_token) if self._per_token else 0.0
        t = max(self.floor_s, STEP_FACTOR * step)
        if prefill_tokens:
            t += PREFILL_FACTOR * per_token * prefill_tokens
        return t


class Watchdog:
    """Calls ``on_expiry`` of every armed step whose deadline passed (from its own thread). Deadlines count
    only time this process ran: a tick ``STALL_S`` or more late means nothing of ours ran meanwhile (no reader
    could have heard an answer), so that time is not the backend's silence. Tests drive ``clock``/``sleep``."""

    def __init__(self, tick_s: float = 0.05, clock: Callable[[], float] = time.monotonic, sleep=time.sleep):
        self._tick = tick_s
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._armed: dict[int, tuple[float, Callable[[], None]]] = {}
        self._heap: list[tuple[float, int]] = []
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self.stalled_s = 0.0  # time this process did not run (late ticks), counted against no deadline

    def arm(self, seconds: float, on_expiry: Callable[[], None]) -> int:
        with self._lock:
            key = next(self._ids)
            at = self._clock() - self.stalled_s + seconds  # on the clock less the stalls, as _run's "now"
            self._armed[key] = (at, on_expiry)
            heapq.heappush(self._heap, (at, key))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="backend-watchdog", daemon=True)
                self._thread.start()
            return key

    def disarm(self, key: int) -> None:
        with self._lock:
            self._armed.pop(key, None)

    def _run(self) -> None:
        last = self._clock()
        while True:
            self._sleep(self._tick)
            due = []
            with self._lock:
                t = self._clock()
                late, last = t - last - self._tick, t
                if late >= STALL_S:
                    self.stalled_s += late
                    log.info("this process did not run for %.2f s: no step deadline counts that time", late)
                now = t - self.stalled_s
                while self._heap and self._heap[0][0] <= now:
                    _, key = heapq.heappop(self._heap)
                    hit = self._armed.pop(key, None)
                    if hit is not None:
                        due.append(hit[1])
            for fn in due:
                try:
                    fn()
                except Exception:  # pragma: no cover - an expiry must never kill the watchdog
                    log.exception("a step deadline's expiry failed")


WATCHDOG = Watchdog()
