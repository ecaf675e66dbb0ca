"""A slow backend is told from a hung one by progress, not by how long a step takes.

A verifier and a drafter servicer (the tiny pair, MLX) on one in-process loopback server; the tests
occupy their compute threads directly. A session asks for Progress messages (``Open.progress_ms``)
and the server sends them while a step waits, but only while its compute gets work done: jobs
finishing, or CPU time spent on one. A client whose step deadline is 1 s (``--backend-timeout 1``)
then rides out steps many times that long, and still calls a wedged compute thread hung after 1 s of
silence. The process-level case (a SIGSTOPped backend) is ``test_hung_backends.py``.
"""

from __future__ import annotations

import hashlib
import queue
import sys
import threading
import time

import grpc
import pytest

from kakeya.core.contract import Draft
from kakeya.orchestrator.remote.deadlines import StepClock
from kakeya.orchestrator.remote.drafter import GrpcDrafter
from kakeya.orchestrator.remote.streams import BackendError
from kakeya.orchestrator.remote.verifier import GrpcVerifier
from kakeya.wire.kakeya.v1 import verifier_pb2

from ..waiting import holds_for, wait_until
from .conftest import in_process_mlx_pair, verifier_stub

FLOOR_S = 1.0  # the clients' step deadline (--backend-timeout): Progress is asked for every 0.1 s
SLOW_S = 4 * FLOOR_S  # a slow step: four deadlines long
PROMPT = [2, 40, 41, 42, 43, 44]
V = verifier_pb2.VerifierRequest
linux_cpu_time = pytest.mark.skipif(
    sys.platform != "linux", reason="a thread's CPU time is read from /proc (elsewhere only finished jobs count)"
)


@pytest.fixture(scope="module")
def served(tiny_pair, aux_layers):
    yield from in_process_mlx_pair(tiny_pair, aux_layers)


def _clients(addr):
    """A fresh drafter and verifier client (fresh step clocks: a slow step of one test must not lengthen
    the next test's deadline through the median)."""
    drafter = GrpcDrafter(addr, clock=StepClock(FLOOR_S))
    return GrpcVerifier(addr, aux_layers=drafter.target_layer_ids, clock=StepClock(FLOOR_S)), drafter


# --------------------------------------------------------------------------- occupying a compute thread


def _computing(compute, seconds: float):
    """Occupy ``compute`` with one job that computes (its CPU time grows) for ``seconds``, without the GIL
    (as MLX and torch compute: a Python loop would also starve the server's other threads)."""
    started = threading.Event()
    block = b"x" * (1 << 20)

    def burn():
        started.set()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            hashlib.sha256(block).digest()  # hashes a megabyte with the GIL released

    done = compute.submit(burn)
    assert started.wait(60)
    return done


def _finishing(compute, seconds: float, each_s: float = 0.05):
    """Occupy ``compute`` with short jobs that sleep (no CPU time) but finish, one after another."""
    jobs = [compute.submit(time.sleep, each_s) for _ in range(round(seconds / each_s))]
    return jobs[-1]


def _wedged(compute) -> threading.Event:
    """Block ``compute`` (no job finishes, no CPU time) until the returned event is set."""
    release, started = threading.Event(), threading.Event()
    compute.submit(lambda: (started.set(), release.wait(120)))
    assert started.wait(60)
    return release


# --------------------------------------------------------------------------- the client: slow is not hung


@pytest.mark.parametrize("busy", [pytest.param(_computing, marks=linux_cpu_time), _finishing])
def test_a_verify_behind_long_work_hears_progress_and_is_not_hung(served, busy):
    verifier, _ = _clients(served["addr"])
    s = verifier.open_session()
    first, _aux = s.prefill(PROMPT)
    done, before = busy(served["verifier"].compute, SLOW_S), s._s.progress
    t0 = time.monotonic()
    verdict = s.decide(first, Draft([7, 8, 9]))  # queued behind SLOW_S of work: four deadlines
    waited = time.monotonic() - t0
    assert done.done() and waited > 2 * FLOOR_S, waited  # it did wait behind the work, past two deadlines
    assert 0 <= verdict.accepted <= 3 and s._s.progress - before >= 2, (before, s._s.progress)
    s.close()


@linux_cpu_time
def test_a_draft_behind_long_work_hears_progress_and_is_not_hung(served):
    verifier, drafter = _clients(served["addr"])
    v = verifier.open_session()
    first, aux = v.prefill(PROMPT)
    d = drafter.open_session()
    done = _computing(served["drafter"].compute, SLOW_S)
    draft = d.draft(aux, first, 4)  # the stream opens with it: every Progress it heard was this step's
    assert done.done() and len(draft.tokens) == 3 and d._s.progress >= 2, d._s.progress
    assert drafter.backoff.failures == 0
    d.close()
    v.close()


# --------------------------------------------------------------------------- the client: hung is hung


def test_a_wedged_verifier_is_hung_after_one_deadline_of_silence(served):
    verifier, _ = _clients(served["addr"])
    s = verifier.open_session()
    first, _aux = s.prefill(PROMPT)
    release = _wedged(served["verifier"].compute)
    try:
        t0 = time.monotonic()
        with pytest.raises(BackendError) as err:
            s.decide(first, Draft([7, 8, 9]))
        waited = time.monotonic() - t0
    finally:
        release.set()
    assert err.value.step_timeout and err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, err.value
    assert "no verified answer or progress for 1.0 s, after 0 progress messages" in str(err.value)
    assert waited >= FLOOR_S  # silent from the start ("after 0 progress messages"), and given its whole deadline
    again = verifier.open_session()  # the thread unwedged: the verifier serves again
    assert again.prefill(PROMPT)[0] == first
    again.close()


def test_a_wedged_drafter_is_hung_after_one_deadline_of_silence(served):
    verifier, drafter = _clients(served["addr"])
    v = verifier.open_session()
    first, aux = v.prefill(PROMPT)
    d = drafter.open_session()
    verdict = v.decide(first, d.draft(aux, first, 4))  # the stream is open: the next draft is a plain step
    release = _wedged(served["drafter"].compute)
    try:
        with pytest.raises(BackendError) as err:
            d.draft(verdict.aux, verdict.next_token, 4)
    finally:
        release.set()
    assert err.value.step_timeout and "no drafted answer or progress" in str(err.value)
    assert drafter.backoff.failures == 1  # a hang counts against the drafter (the run falls back to AR)
    v.close()


# --------------------------------------------------------------------------- the wire: when Progress comes


class _Raw:
    """A verifier Session stream: requests sent one by one, responses gathered by a reader thread."""

    def __init__(self, addr: str, progress_ms: int):
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self.responses: queue.SimpleQueue = queue.SimpleQueue()
        self.call = verifier_stub(addr).Session(iter(self._requests.get, None), timeout=120)
        self.send(V(open=V.Open(progress_ms=progress_ms)))
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        try:
            for resp in self.call:
                self.responses.put(resp)
        except grpc.RpcError as exc:
            self.responses.put(exc)

    def send(self, req) -> None:
        self._requests.put(req)

    def until(self, kind: str) -> list:
        """The responses up to and including the next ``kind`` one (Progress messages before it included)."""
        got = []
        while not got or got[-1].WhichOneof("response") != kind:
            resp = self.responses.get(timeout=120)
            if isinstance(resp, grpc.RpcError):
                raise resp
            got.append(resp)
        return got

    def close(self) -> None:
        self.call.cancel()
        self._requests.put(None)


def _kinds(responses) -> list[str]:
    return [r.WhichOneof("response") for r in responses]


@linux_cpu_time
def test_progress_comes_only_when_asked_and_only_while_compute_gets_work_done(served):
    compute = served["verifier"].compute
    asked, silent = _Raw(served["addr"], progress_ms=100), _Raw(served["addr"], progress_ms=0)
    try:
        for s in (asked, silent):
            s.send(V(prefill=V.Prefill(token_ids=PROMPT)))
        assert [k for k in _kinds(asked.until("prefilled")) if k != "progress"] == ["opened", "prefilled"]
        assert _kinds(silent.until("prefilled")) == ["opened", "prefilled"]  # never a Progress unasked
        # computing: Progress every 0.1 s to the session that asked, none to the other
        done = _computing(compute, 1.5)
        for s in (asked, silent):
            s.send(V(verify=V.Verify(block_ids=[PROMPT[-1], 7])))
        got, quiet = asked.until("verified"), silent.until("verified")
        assert done.done() and _kinds(quiet) == ["verified"]
        beats = [r.progress.waited_s for r in got[:-1]]
        assert _kinds(got[:-1]) == ["progress"] * len(beats) and len(beats) >= 3, beats
        assert beats == sorted(beats) and beats[0] > 0, beats  # each says how long the step has waited so far
        # wedged: nothing moves, nothing is said
        release = _wedged(compute)
        asked.send(V(verify=V.Verify(block_ids=[7, 8])))
        try:
            holds_for(asked.responses.empty, 1.0, what="silence while the compute thread is wedged")
        finally:
            release.set()
        assert _kinds(asked.until("verified"))[-1] == "verified"
    finally:
        asked.close()
        silent.close()
    wait_until(lambda: served["verifier"].registry.live == 0, what="both sessions freed")


def test_a_negative_progress_interval_is_refused_naming_the_field(served):
    s = _Raw(served["addr"], progress_ms=-5)
    try:
        with pytest.raises(grpc.RpcError) as err:
            s.until("opened")
    finally:
        s.close()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "open.progress_ms" in err.value.details()
