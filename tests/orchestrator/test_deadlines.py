"""Step deadlines (``orchestrator/remote/deadlines.py``): how much silence a step may keep, and a watchdog whose
clock stops while its own process does not run.

The watchdog runs on a driven clock here: each ``tick(dt)`` lets its thread wake once, ``dt`` seconds
later, and returns once it has looked at its deadlines.
"""

from __future__ import annotations

import queue

import pytest

from kakeya.orchestrator.remote.deadlines import STALL_S, StepClock, Watchdog


def test_the_deadline_is_the_floor_until_steps_are_measured_then_twenty_median_steps():
    clock = StepClock(2.0)
    assert clock.timeout() == 2.0 and clock.progress_ms == 200  # Progress every tenth of it
    for seconds in (0.001, 0.002, 0.003):
        clock.record(seconds)
    assert clock.timeout() == 2.0  # 20 x 2 ms is under the floor
    for seconds in (0.5, 0.5, 0.5, 0.5):
        clock.record(seconds)
    assert clock.timeout() == pytest.approx(20 * 0.5)
    clock.record(1.0, prefill_tokens=100)  # 10 ms a prompt token: a prefill of n tokens adds 10 x that x n
    assert clock.timeout(prefill_tokens=50) == pytest.approx(20 * 0.5 + 10 * 0.01 * 50)
    with pytest.raises(ValueError, match="--backend-timeout must be > 0"):
        StepClock(0)


class _Driven:
    """A clock and a sleep for a Watchdog: its thread sleeps until ``tick`` moves the clock."""

    def __init__(self):
        self.now = 100.0
        self._ticks: queue.SimpleQueue = queue.SimpleQueue()
        self._looked: queue.SimpleQueue = queue.SimpleQueue()
        self._started = False

    def clock(self) -> float:
        return self.now

    def sleep(self, _seconds: float) -> None:
        if self._started:
            self._looked.put(None)  # the previous tick's look at the deadlines is done
        self._started = True
        self.now += self._ticks.get()

    def tick(self, dt: float) -> None:
        self._ticks.put(dt)
        self._looked.get(timeout=60)


TICK = 0.0625  # exact in binary: deadlines fall on ticks exactly


def _watchdog():
    driven = _Driven()
    return Watchdog(tick_s=TICK, clock=driven.clock, sleep=driven.sleep), driven


def test_an_armed_step_expires_after_its_seconds_and_a_disarmed_one_never():
    dog, t = _watchdog()
    fired = []
    dog.arm(1.0, lambda: fired.append("a"))
    gone = dog.arm(0.5, lambda: fired.append("b"))
    dog.disarm(gone)
    for _ in range(15):  # 0.9375 s
        t.tick(TICK)
    assert fired == []
    t.tick(TICK)  # 1 s
    assert fired == ["a"]
    for _ in range(32):
        t.tick(TICK)
    assert fired == ["a"]  # once, and never the disarmed one


def test_time_this_process_did_not_run_is_not_a_backends_silence():
    dog, t = _watchdog()
    fired = []
    dog.arm(2.0, lambda: fired.append("step"))
    t.tick(TICK)
    t.tick(5.0)  # the process stopped for 5 s (a paused VM, a starved process): its reader heard nothing
    assert fired == [] and dog.stalled_s == 5.0 - TICK
    for _ in range(29):  # 31 ticks of running time: 1.9375 s
        t.tick(TICK)
    assert fired == []
    t.tick(TICK)  # 2 s that it ran: the silence was the backend's
    assert fired == ["step"]


def test_a_tick_a_little_late_is_no_stall():
    dog, t = _watchdog()
    fired = []
    dog.arm(1.0, lambda: fired.append("step"))
    for _ in range(3):  # a busy machine's ordinary lateness counts in full: 3 x 0.2625 s
        t.tick(TICK + STALL_S * 0.8)
    assert fired == []
    t.tick(TICK + STALL_S * 0.8)  # 1.05 s
    assert dog.stalled_s == 0.0 and fired == ["step"]
