"""CPU time a server process spends on model work, read from ``/proc`` (Linux; elsewhere ``None``).

How a waiting stream tells a busy process from a wedged one (``ComputeThread.progress``): a long job
still spends CPU time, a thread blocked for good spends none. Model work is the compute thread (and one
running a job inline), every thread not started through Python's ``threading`` (MLX's, torch's and BLAS's
native pools), and every process those started (MLX's CPU backend runs ``g++`` for new shapes); not the
gRPC handler threads, which wake whether or not anything moves. The reads give up the GIL, so a
:class:`CpuSampler` does them on a thread of its own and a handler's look costs an attribute read.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Collection

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def model_cpu_seconds(model_threads: Collection[int]) -> float | None:
    """CPU seconds (so far) of the model work above; ``model_threads``: native ids of the Python threads
    that run model work (the compute thread, an inline job's). None where ``/proc`` cannot be read."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    python = {t.native_id for t in threading.enumerate()} - set(model_threads)
    total = 0.0
    for name in tasks:
        if int(name) in python:
            continue
        task = f"/proc/self/task/{name}"
        total += _thread_seconds(task) + sum(_process_seconds(pid) for pid in _children(task))
    return total


def _thread_seconds(task: str) -> float:
    """One thread's CPU time: ``schedstat``'s nanoseconds where the kernel keeps them, else ``stat``'s ticks."""
    try:
        with open(f"{task}/schedstat", "rb") as f:
            ns = int(f.read().split()[0])
        if ns:
            return ns / 1e9
    except (OSError, ValueError, IndexError):
        pass
    return _stat_seconds(f"{task}/stat")


def _process_seconds(pid: int, depth: int = 0) -> float:
    """A child process's CPU time (all its threads), and its own children's (a compiler driver's)."""
    seconds = _stat_seconds(f"/proc/{pid}/stat")
    if depth < 4:
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            return seconds
        for name in tasks:
            seconds += sum(_process_seconds(child, depth + 1) for child in _children(f"/proc/{pid}/task/{name}"))
    return seconds


def _children(task: str) -> list[int]:
    try:
        with open(f"{task}/children", "rb") as f:
            return [int(pid) for pid in f.read().split()]
    except (OSError, ValueError):
        return []


def _stat_seconds(path: str) -> float:
    """utime + stime of a ``stat`` file (fields 14 and 15 of proc(5)); 0.0 once it is gone."""
    try:
        with open(path, "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICKS
    except (OSError, ValueError, IndexError):
        return 0.0


class CpuSampler:
    """``model_cpu_seconds`` read every ``every_s`` on a daemon thread, while someone called :meth:`read`
    within the last ``idle_s`` (then it sleeps until the next call). ``model_threads``: the native ids of
    the Python threads running model work now."""

    def __init__(self, model_threads: Callable[[], Collection[int]], every_s: float = 0.05, idle_s: float = 2.0):
        self._threads, self._every, self._idle = model_threads, every_s, idle_s
        self._last: tuple[float | None, float] = (None, 0.0)  # (CPU seconds, monotonic time read)
        self._asked = 0.0
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def read(self) -> tuple[float | None, float]:
        """The latest (CPU seconds, when read); (None, 0.0) before a current reading (the first, or the first
        since the sampler slept: a rate over its sleep would say nothing of now) or where there is none."""
        now = self._asked = time.monotonic()
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="model-cpu", daemon=True)
                    self._thread.start()
        self._wake.set()
        cpu, at = self._last
        return (cpu, at) if now - at < self._idle / 2 else (None, 0.0)

    def _run(self) -> None:
        while True:
            if time.monotonic() - self._asked > self._idle:
                self._wake.clear()
                self._wake.wait()
            cpu = model_cpu_seconds(self._threads())
            self._last = (cpu, time.monotonic())
            if cpu is None:
                return  # nothing to read here, ever
            time.sleep(self._every)
