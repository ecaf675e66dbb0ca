"""The one thread a server process runs its model work on, with batching of like work.

All model work runs on ONE thread (MLX arrays stay on the thread that made them; there is one device anyway); gRPC
handler threads only translate and wait. Jobs run in submission order, except that **batchable** jobs of one kind AND
one runner that queued while the thread was busy go to that runner together: N sessions' steps, one forward. Nothing
waits on purpose to form a batch, and a session's order cannot change: its handler waits for each result.

**Inline when idle** (``inline``, torch on a CPU only): a job finding the thread idle runs on the calling handler
thread under the same lock, saving a lone stream's two thread hand-offs.

**Progress** (:meth:`ComputeThread.progress`): jobs finished and the CPU time of model work (the compute thread, threads
not started through ``threading`` such as MLX's, torch's and BLAS's pools, and their processes; not gRPC's), which a
waiting handler watches to tell a slow process from a wedged one. Read from ``/proc`` (Linux; elsewhere ``None``) by a
:class:`CpuSampler` on its own thread.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Hashable, Sequence
from concurrent.futures import Future
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, NamedTuple

DEFAULT_MAX_BATCH = 16
BUSY_FRACTION = 0.05  # model work's CPU time, as a share of the time it was measured over, that is progress


class Progress(NamedTuple):
    """What :meth:`ComputeThread.progress` saw at ``at`` (monotonic seconds)."""

    done: int  # jobs finished
    cpu_s: float | None  # CPU seconds of model work so far (``model_cpu_seconds``; None: unknown, here or yet)
    cpu_at: float  # when cpu_s was read
    at: float

    def since(self, earlier: Progress) -> bool:
        """Work got done between ``earlier`` and this: a job finished, or model work spent at least ``BUSY_FRACTION`` of
        the time between the two readings on a CPU (a rate: idle threads' crumbs never add up)."""
        if self.done != earlier.done:
            return True
        if self.cpu_s is None or earlier.cpu_s is None or self.cpu_at <= earlier.cpu_at:
            return False
        return self.cpu_s - earlier.cpu_s >= BUSY_FRACTION * (self.cpu_at - earlier.cpu_at)


@dataclass
class _Job:
    fn: Callable | None  # a plain job
    kind: Hashable | None = None  # a batchable job: its kind, item and runner
    item: Any = None
    runner: Callable[[list], Sequence[Any]] | None = None
    future: Future = field(default_factory=Future)


class ComputeThread:
    """Runs callables on one dedicated thread (see the module docstring). ``max_batch``: most items one runner call gets
    (1: every job alone)."""

    def __init__(self, name: str, max_batch: int = DEFAULT_MAX_BATCH):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.max_batch = max_batch
        self.batches = 0  # runner calls so far, and the items they carried (for metrics/tests)
        self.batched_items = 0
        self._jobs: deque[_Job] = deque()
        self._cv = threading.Condition()
        self._stopped = False
        self._work = threading.Lock()  # held while model work runs, on this thread or inline on a caller's
        self.inline = False  # run a job on its caller's thread when nothing else is queued or running
        self._pending = 0  # jobs submitted and not yet started, taken ones included (none: a caller may run inline)
        self.completed = 0  # jobs finished, inline ones included (counted under the work lock)
        self._worker: int | None = None  # native id of the thread running model work now (None: none runs)
        self._cpu = CpuSampler(self._model_threads)
        self._thread = threading.Thread(target=self._loop, name=f"{name}-compute", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable, *args, **kwargs) -> Future:
        return self._put(_Job(fn=lambda: fn(*args, **kwargs)))[0]

    def start(self, fn: Callable, *args, **kwargs) -> Future:
        """``fn(*args, **kwargs)`` as a Future: run at once on the calling thread when ``inline`` finds
        the thread idle (the Future is then done), else queued for the thread."""
        return self._inline(lambda: fn(*args, **kwargs)) if self._idle() else self.submit(fn, *args, **kwargs)

    def run(self, fn: Callable, *args, **kwargs) -> Any:
        return self.start(fn, *args, **kwargs).result()

    def start_batch(self, kind: Hashable, item: Any, runner: Callable[[list], Sequence[Any]]) -> Future:
        """``item``'s result as a Future: ``runner([item, ...])`` together with like items queued meanwhile. ``runner``
        returns one result per item, in order; an ``Exception`` result is raised to that item's caller alone."""
        return self.start_many(kind, [item], runner)[0]

    def start_many(self, kind: Hashable, items: Sequence[Any], runner: Callable[[list], Sequence[Any]]) -> list[Future]:
        """Each of ``items``' results as a Future, like ``start_batch`` for each, but queued at once (a round call's
        steps, ``servicer.serve_round``): the thread takes them as one batch (up to ``max_batch``) with like
        items queued meanwhile; run inline, as one runner call, when ``inline`` finds the thread idle."""
        if not items:
            return []
        if not self._idle():
            return self._put(*(_Job(fn=None, kind=kind, item=item, runner=runner) for item in items))
        futures = [Future() for _ in items]
        for f in futures:
            f.set_running_or_notify_cancel()
        done = self._inline(lambda: self._deliver(futures, runner, list(items)))
        for f in futures:
            if not f.done():  # the runner itself failed: every item hears it
                f.set_exception(done.exception())
        return futures

    def _deliver(self, futures: list[Future], runner: Callable[[list], Sequence[Any]], items: list) -> None:
        """One runner call for ``items``: each result (or exception) to its own future."""
        self.batches += 1
        self.batched_items += len(items)
        results = list(runner(items))
        if len(results) != len(items):
            raise RuntimeError(f"batch runner returned {len(results)} results for {len(items)} items")
        for f, r in zip(futures, results):
            f.set_exception(r) if isinstance(r, BaseException) else f.set_result(r)

    def batch(self, kind: Hashable, item: Any, runner: Callable[[list], Sequence[Any]]) -> Any:
        """``start_batch``, waited for."""
        return self.start_batch(kind, item, runner).result()

    def progress(self) -> Progress:
        """Jobs finished and model work's CPU time now (see the module docstring); compare two with
        ``Progress.since``."""
        return Progress(self.completed, *self._cpu.read(), time.monotonic())

    def _model_threads(self) -> list[int]:
        """Native ids of the Python threads running model work: this one's thread, an inline job's."""
        worker = self._worker
        return [self._thread.native_id, *([worker] if worker is not None else [])]

    def _inline(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` now on the calling thread, which holds the work lock (``_idle``); a done Future."""
        future: Future = Future()
        future.set_running_or_notify_cancel()
        self._worker = threading.get_native_id()
        try:
            settle(future, fn)
        finally:
            self._worker = None
            self.completed += 1
            self._work.release()
        return future

    @property
    def queued(self) -> int:
        """Jobs submitted and not yet started (a job run inline is never queued)."""
        return self._pending

    def _idle(self) -> bool:
        """With ``inline``: True (and the work lock taken) when no job is queued and none runs."""
        if not self.inline or self._pending or self._stopped or not self._work.acquire(blocking=False):
            return False
        if self._pending:  # one was queued meanwhile (or taken, the thread now waiting for the lock): it goes first
            self._work.release()
            return False
        return True

    def _put(self, *jobs: _Job) -> list[Future]:
        with self._cv:
            if self._stopped:
                raise RuntimeError("compute thread is shut down")
            self._jobs.extend(jobs)
            self._pending += len(jobs)
            self._cv.notify()
        return [j.future for j in jobs]

    def shutdown(self) -> None:
        with self._cv:
            self._stopped = True
            for job in self._jobs:
                job.future.cancel()
            self._jobs.clear()
            self._cv.notify()

    def _take(self) -> list[_Job] | None:
        with self._cv:
            while not self._jobs and not self._stopped:
                self._cv.wait()
            if self._stopped:
                return None
            first = self._jobs.popleft()
            if first.fn is not None or self.max_batch == 1:
                return [first]
            group, rest = [first], deque()
            while self._jobs:
                job = self._jobs.popleft()
                if (
                    job.fn is None
                    and (job.kind, job.runner) == (first.kind, first.runner)
                    and len(group) < self.max_batch
                ):
                    group.append(job)
                else:
                    rest.append(job)
            self._jobs = rest
            return group

    def _loop(self) -> None:
        me = threading.get_native_id()
        while (group := self._take()) is not None:
            with self._work:
                with self._cv:
                    self._pending -= len(group)
                self._worker = me
                try:
                    self._run(group)
                finally:
                    self._worker = None
                    self.completed += 1

    def _run(self, group: list[_Job]) -> None:
        group = [j for j in group if j.future.set_running_or_notify_cancel()]
        if not group:
            return
        if group[0].fn is not None:
            settle(group[0].future, group[0].fn)
            return
        try:
            self._deliver([j.future for j in group], group[0].runner, [j.item for j in group])
        except BaseException as exc:  # noqa: BLE001 - the whole batch failed: every caller hears it
            for j in group:
                j.future.set_exception(exc)


def settle(future: Future, fn: Callable) -> None:
    try:
        result = fn()
    except BaseException as exc:  # noqa: BLE001 - the caller waiting on the future hears it
        future.set_exception(exc)
    else:
        future.set_result(result)


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
    with suppress(OSError, ValueError, IndexError), open(f"{task}/schedstat", "rb") as f:
        if ns := int(f.read().split()[0]):
            return ns / 1e9
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
    with suppress(OSError, ValueError), open(f"{task}/children", "rb") as f:
        return [int(pid) for pid in f.read().split()]
    return []


def _stat_seconds(path: str) -> float:
    """utime + stime of a ``stat`` file (fields 14 and 15 of proc(5)); 0.0 once it is gone."""
    with suppress(OSError, ValueError, IndexError), open(path, "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICKS
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
