"""The compute thread: FIFO for plain jobs, like batchable jobs that queue up meanwhile run as one batch."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from kakeya.runtime.compute import ComputeThread

from ..waiting import wait_until


def _blocked(ct: ComputeThread) -> threading.Event:
    """Occupy the thread until the returned event is set (so jobs queue up behind it)."""
    release, started = threading.Event(), threading.Event()
    ct.submit(lambda: (started.set(), release.wait(60)))
    assert started.wait(60)
    return release


def test_plain_jobs_run_in_order_and_return_or_raise():
    ct = ComputeThread("t")
    seen = []
    futs = [ct.submit(seen.append, i) for i in range(20)]
    for f in futs:
        f.result(5)
    assert seen == list(range(20))
    with pytest.raises(ZeroDivisionError):
        ct.run(lambda: 1 / 0)
    assert ct.run(lambda: 7) == 7  # the thread survives a failed job
    ct.shutdown()


def _submit_batch_items(ct, n, runner, kind="verify"):
    ex = ThreadPoolExecutor(n)
    futs = [ex.submit(ct.batch, kind, i, runner) for i in range(n)]
    return ex, futs


def _wait_queued(ct: ComputeThread, n: int) -> None:
    wait_until(lambda: ct.queued >= n, interval=0.01, what=f"{n} jobs queued")


def test_like_jobs_that_queue_up_run_as_one_batch_with_results_in_item_order():
    ct = ComputeThread("t")
    calls = []

    def runner(items):
        calls.append(list(items))
        return [x * 10 for x in items]

    release = _blocked(ct)
    ex, futs = _submit_batch_items(ct, 6, runner)
    _wait_queued(ct, 6)
    release.set()
    assert sorted(f.result(5) for f in futs) == [0, 10, 20, 30, 40, 50]
    assert [f.result() for f in futs] == [10 * i for i in range(6)]  # each caller gets its own item's result
    assert len(calls) == 1 and sorted(calls[0]) == list(range(6))
    assert (ct.batches, ct.batched_items) == (1, 6)
    ex.shutdown()
    ct.shutdown()


def test_max_batch_caps_a_batch_and_one_means_serialised():
    for max_batch, expect in ((4, [4, 4, 2]), (1, [1] * 10)):
        ct = ComputeThread("t", max_batch=max_batch)
        sizes = []
        release = _blocked(ct)
        ex, futs = _submit_batch_items(ct, 10, lambda items, sizes=sizes: (sizes.append(len(items)), items)[1])
        _wait_queued(ct, 10)
        release.set()
        assert sorted(f.result(5) for f in futs) == list(range(10))
        assert sizes == expect
        ex.shutdown()
        ct.shutdown()


def test_an_exception_result_fails_only_its_own_caller_and_a_failed_runner_fails_all():
    ct = ComputeThread("t")
    release = _blocked(ct)
    ex, futs = _submit_batch_items(ct, 3, lambda items: [ValueError(f"bad {x}") if x == 1 else x for x in items])
    _wait_queued(ct, 3)
    release.set()
    with pytest.raises(ValueError, match="bad 1"):
        futs[1].result(5)
    assert futs[0].result(5) == 0 and futs[2].result(5) == 2

    def broken(items):
        raise RuntimeError("device lost")

    with pytest.raises(RuntimeError, match="device lost"):
        ct.batch("verify", 0, broken)
    with pytest.raises(RuntimeError, match="returned 0 results"):
        ct.batch("verify", 0, lambda items: [])
    assert ct.run(lambda: "alive") == "alive"
    ex.shutdown()
    ct.shutdown()


def test_other_kinds_and_plain_jobs_are_not_merged_and_keep_their_order():
    ct = ComputeThread("t")
    log = []
    release = _blocked(ct)
    ex = ThreadPoolExecutor(4)

    def verify(items):  # one runner for the kind (a group is one runner's)
        log.append(("verify", list(items)))
        return items

    fa = ex.submit(ct.batch, "verify", "a", verify)
    _wait_queued(ct, 1)
    fp = ct.submit(log.append, ("plain",))
    fd = ex.submit(ct.batch, "draft", "d", lambda items: (log.append(("draft", list(items))), items)[1])
    _wait_queued(ct, 3)
    fb = ex.submit(ct.batch, "verify", "b", verify)
    _wait_queued(ct, 4)
    release.set()
    for f in (fa, fp, fd, fb):
        f.result(5)
    # "b" joined "a"'s batch; the plain job and the other kind ran after it, in their order
    assert log == [("verify", ["a", "b"]), ("plain",), ("draft", ["d"])]
    ex.shutdown()
    ct.shutdown()


def test_jobs_of_one_kind_with_other_runners_never_run_anothers_runner():
    """A group is one runner's: a job queued under the same kind with another runner (two call sites that
    answer different types) runs its own, never the group's first's; jobs with the same runner still merge,
    a bound method of one object counting as the same runner however often it is looked up."""
    ct = ComputeThread("t")

    class Site:
        def __init__(self, tag):
            self.tag, self.calls = tag, []

        def run(self, items):
            self.calls.append(list(items))
            return [(self.tag, x) for x in items]

    tuples, protos = Site("tuple"), Site("proto")
    release = _blocked(ct)
    ex = ThreadPoolExecutor(6)
    futs = []
    for i, site in enumerate([tuples, protos, tuples, protos, tuples]):
        futs.append((site, i, ex.submit(ct.batch, "draft", i, site.run)))  # a fresh bound method each time
        _wait_queued(ct, i + 1)
    many = ct.start_many("draft", [10, 11], protos.run)
    release.set()
    for site, i, f in futs:
        assert f.result(5) == (site.tag, i)
    assert [f.result(5) for f in many] == [("proto", 10), ("proto", 11)]
    assert tuples.calls == [[0, 2, 4]] and protos.calls == [[1, 3, 10, 11]]
    ex.shutdown()
    ct.shutdown()


def test_shutdown_refuses_new_work():
    ct = ComputeThread("t")
    ct.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        ct.submit(lambda: 1)
    with pytest.raises(ValueError):
        ComputeThread("t", max_batch=0)


def test_inline_runs_a_lone_job_on_its_callers_thread_and_jobs_that_queue_still_batch():
    ct = ComputeThread("t")
    ct.inline = True
    me = threading.get_ident()
    assert ct.run(threading.get_ident) == me  # nothing queued, nothing running: no hand-off
    assert ct.batch("verify", 3, lambda items: [(threading.get_ident(), x) for x in items]) == (me, 3)
    with pytest.raises(RuntimeError, match="returned 0 results"):
        ct.batch("verify", 0, lambda items: [])
    with pytest.raises(ValueError, match="bad"):
        ct.batch("verify", 0, lambda items: [ValueError("bad")])
    calls = []
    release = _blocked(ct)  # the thread is busy: callers queue, and what queued runs as one batch there
    ex, futs = _submit_batch_items(
        ct, 5, lambda items: (calls.append(list(items)), [threading.get_ident()] * len(items))[1]
    )
    _wait_queued(ct, 5)
    release.set()
    assert len({f.result(5) for f in futs}) == 1 and futs[0].result() != me
    assert len(calls) == 1 and sorted(calls[0]) == list(range(5))
    ex.shutdown()
    ct.shutdown()


def test_progress_counts_finished_jobs_inline_or_not():
    ct = ComputeThread("t")
    before = ct.progress()
    ct.run(lambda: None)
    with pytest.raises(ZeroDivisionError):
        ct.batch("verify", 0, lambda items: 1 / 0)  # a failed job is finished work too
    ct.inline = True
    ct.run(lambda: None)  # on this thread
    assert ct.start(lambda: 7).result(0) == 7  # inline: done before start returns
    after = ct.progress()
    assert after.done == before.done + 4 and after.since(before)
    assert not after.since(after)
    ct.shutdown()


def _look(ct: ComputeThread, seconds: float = 0.3) -> bool:
    """Whether ``ct`` made progress over the next ``seconds``, as a waiting stream judges it."""
    before = wait_until(lambda: (p := ct.progress()).cpu_s is not None and p, what="a CPU reading")
    threading.Event().wait(seconds)  # the window a stream's look covers (not ordering anything)
    return ct.progress().since(before)


@pytest.mark.skipif(sys.platform != "linux", reason="CPU time is read from /proc")
def test_progress_moves_while_a_job_computes_or_compiles_and_not_while_one_is_blocked():
    ct = ComputeThread("t")
    started, stop = threading.Event(), threading.Event()

    def burn():  # computes on the compute thread itself, without the GIL (as model work does)
        started.set()
        block = b"x" * (1 << 20)
        while not stop.is_set():
            hashlib.sha256(block).digest()

    ct.submit(burn)
    assert started.wait(60)
    assert _look(ct)  # nothing finished: the CPU time alone shows the work
    stop.set()
    # a job waiting on a child process that computes (MLX's CPU backend compiles kernels with g++ so)
    child = ct.submit(subprocess.run, [sys.executable, "-c", "while True: pass"], timeout=2.0)
    wait_until(lambda: ct.queued == 0 and not child.done(), what="the compiling job running")
    assert _look(ct, 0.5)
    with pytest.raises(subprocess.TimeoutExpired):
        child.result(60)
    release = _blocked(ct)  # a job that waits for good: nothing finishes, no CPU time is spent
    assert not any(_look(ct) for _ in range(3))
    release.set()
    ct.shutdown()


def test_inline_or_not_model_work_never_overlaps():
    ct = ComputeThread("t")
    ct.inline = True
    lock, running, most, order = threading.Lock(), [0], [0], []

    def runner(items):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        threading.Event().wait(0.001)
        with lock:
            running[0] -= 1
        order.extend(items)
        return items

    def session(k):  # one stream: its steps in order, each waiting for the last
        return [ct.batch("verify", (k, i), runner) for i in range(30)]

    with ThreadPoolExecutor(6) as ex:
        results = list(ex.map(session, range(6)))
    assert most[0] == 1
    assert results == [[(k, i) for i in range(30)] for k in range(6)]
    for k in range(6):
        assert [i for kk, i in order if kk == k] == list(range(30))  # each session's steps in order
    ct.shutdown()


@pytest.mark.parametrize(
    "backend, device, inline",
    [
        ("torch", "cpu", True),  # torch on a CPU runs a lone step inline
        ("torch", "cuda", False),  # no gain measured on a GPU (docs/design.md, "History: removed, and why")
        ("mlx", "cpu", False),  # MLX arrays stay on their thread
    ],
)
def test_inline_steps_for_torch_on_a_cpu_only(backend, device, inline):
    from types import SimpleNamespace

    from kakeya.runtime.servicer import SessionServicer

    server = SimpleNamespace(device=device, compute=SimpleNamespace(inline=None))
    SessionServicer._inline_if_safe(server, backend)
    assert server.compute.inline is inline
