"""Admission (session limit, K/V budget, wait queue), idle expiry and no leaks, on a real verifier.

The budget admits exactly one session of ``POSITIONS`` positions: its worst
case is predicted from the config by ``services/verifier/memory.py`` (the
same arithmetic the server uses), so a second is RESOURCE_EXHAUSTED naming
``--max-kv-bytes`` (or waits, with ``--queue``).
"""

from __future__ import annotations

import threading

import grpc
import pytest

from kakeya.wire.kakeya.v1 import drafter_pb2, generate_pb2, verifier_pb2

from .conftest import (
    TINY_MLX,
    drafter_info,
    drafter_stub,
    generate,
    generation_stub,
    request,
    start_all,
    verifier_info,
    verifier_stub,
    wait_until,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

POSITIONS = 600  # worst case rounds to 768 positions; a session of 8 to 256: both fit the budget, two of these do not
PROMPT = [2, 40, 41, 42, 43, 44]
V = verifier_pb2.VerifierRequest


def _worst_case(tiny_pair) -> int:
    from kakeya.checkpoints.config import load_target_config
    from kakeya.core.request import CachePolicy
    from kakeya.verifier.memory import KVShape, session_bytes

    shape = KVShape.from_config(load_target_config(tiny_pair.target))
    alloc = -(-(POSITIONS + 16) // 256) * 256
    return session_bytes(shape, CachePolicy(), alloc)["total_bytes"]


@pytest.fixture(scope="module")
def servers(server_factory, tiny_pair):
    one = _worst_case(tiny_pair)
    budget = ["--max-kv-bytes", str(one + one // 2)]
    strict = server_factory(
        "strict", ["verifier", *TINY_MLX, *budget, "--max-sessions", "8", "--idle-timeout", "3", "--grace", "1"]
    )
    # these two hold idle sessions on purpose: no reclaiming them for newcomers (test_fairness.py covers that)
    queued = server_factory(
        "queued",
        ["verifier", *TINY_MLX, *budget, "--queue", "1", "--queue-timeout", "8", "--reclaim-idle", "0", "--grace", "1"],
    )
    small = server_factory(
        "small", ["verifier", *TINY_MLX, "--max-sessions", "3", "--reclaim-idle", "0", "--grace", "1"]
    )
    drafter = server_factory("drafter", ["drafter", *TINY_MLX, "--idle-timeout", "2", "--grace", "1"])
    start_all([strict, queued, small, drafter])
    orch = server_factory("orchestrator", ["orchestrator", "--verifier", small.addr, "--grace", "1"])
    start_all([orch])
    return {"strict": strict, "queued": queued, "small": small, "drafter": drafter, "orchestrator": orch, "one": one}


class Session:
    """A verifier Session stream driven message by message."""

    def __init__(self, addr, timeout=60, max_positions=POSITIONS, progress_ms=0):
        self._q: list = []
        self._cv = threading.Condition()
        self._closed = False
        self.call = verifier_stub(addr).Session(self._requests(), timeout=timeout)
        self.send(V(open=V.Open(max_positions=max_positions, progress_ms=progress_ms)))

    def _requests(self):
        while True:
            with self._cv:
                while not self._q and not self._closed:
                    if self._cv.wait(0.5) is False and self.call.done():
                        return  # the call ended: stop feeding it (no thread left behind)
                if not self._q:
                    return
                msg = self._q.pop(0)
            yield msg

    def send(self, msg):
        with self._cv:
            self._q.append(msg)
            self._cv.notify()

    def half_close(self):
        with self._cv:
            self._closed = True
            self._cv.notify()

    def next(self):
        return next(self.call)


def _free(addr):
    i = verifier_info(addr)
    return i.live_sessions == 0 and i.live_kv_bytes == 0 and i.reserved_kv_bytes == 0


def test_the_kv_budget_admits_by_worst_case_and_names_the_limit(servers):
    addr = servers["strict"].addr
    a = Session(addr)
    assert a.next().WhichOneof("response") == "opened"
    assert verifier_info(addr).reserved_kv_bytes == servers["one"]
    b = Session(addr)
    with pytest.raises(grpc.RpcError) as err:
        b.next()
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-kv-bytes" in err.value.details()
    # a small session still fits beside it
    c = Session(addr, max_positions=8)
    assert c.next().WhichOneof("response") == "opened"
    for s in (a, c):
        s.send(V(close=V.Close()))
        assert s.next().WhichOneof("response") == "closed"
    wait_until(lambda: _free(addr), what="the budget back to 0")
    d = Session(addr)
    assert d.next().WhichOneof("response") == "opened"
    d.call.cancel()
    wait_until(lambda: _free(addr), what="a cancelled session's reservation freed")


def test_a_queued_session_waits_for_room(servers):
    addr = servers["queued"].addr
    a = Session(addr)
    assert a.next().WhichOneof("response") == "opened"
    b = Session(addr)
    wait_until(lambda: verifier_info(addr).queued_sessions == 1, what="b waiting in the queue")
    assert not b.call.done() and verifier_info(addr).live_sessions == 2  # a, and b waiting for its room
    a.call.cancel()
    assert b.next().WhichOneof("response") == "opened"  # admitted once a is gone
    # the queue holds one: a third and fourth while b is live -> one waits, one is refused at once
    c = Session(addr)
    wait_until(lambda: verifier_info(addr).queued_sessions == 1, what="c waiting in the queue")
    d = Session(addr)
    with pytest.raises(grpc.RpcError) as err:
        d.next()
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue full" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:  # c times out in the queue
        c.next()
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--queue-timeout" in err.value.details()
    b.call.cancel()
    wait_until(lambda: _free(addr), what="everything freed")


def test_a_queued_session_hears_progress_and_leaves_the_queue_with_its_client(servers):
    """A session waiting in the --queue for K/V room hears Progress (``open.progress_ms``) though no compute runs for
    anyone (its client's deadline for a silent step must not take it for a hung server); its client's cancel frees
    its place in the queue at once, not at its --queue-timeout (8 s)."""
    addr = servers["queued"].addr
    a = Session(addr)
    assert a.next().WhichOneof("response") == "opened"
    b = Session(addr, progress_ms=100)
    assert b.next().WhichOneof("response") == "progress"  # a holds the budget, idle
    assert verifier_info(addr).queued_sessions == 1
    b.call.cancel()
    wait_until(lambda: verifier_info(addr).queued_sessions == 0, timeout=4, what="b's queue place freed")
    c = Session(addr, progress_ms=100)  # the place b left is c's
    assert c.next().WhichOneof("response") == "progress"
    a.call.cancel()
    while (answer := c.next()).WhichOneof("response") == "progress":
        pass
    assert answer.WhichOneof("response") == "opened"
    c.call.cancel()
    wait_until(lambda: _free(addr), what="everything freed")


def test_a_generation_whose_verifier_session_waits_for_a_session_slot_is_served(server_factory):
    """The --max-sessions queue's twin of the K/V queue's case below: a session that waits for a slot waits after its
    stream's open (and its ``progress_ms``) is read, hearing Progress, so its orchestrator does not call the verifier
    hung after --backend-timeout ("verifier did not answer in time"). Not met by ``serve all`` (its orchestrator admits
    no more sessions than its backends hold); met by several orchestrators on a verifier with --queue."""
    one = ["--max-sessions", "1", "--queue", "2", "--queue-timeout", "8", "--reclaim-idle", "0", "--grace", "1"]
    verifier = server_factory("one-slot", ["verifier", *TINY_MLX, *one])
    drafter = server_factory("one-slot-drafter", ["drafter", *TINY_MLX, "--grace", "1"])
    start_all([verifier, drafter])
    orch = server_factory(
        "one-slot-split",
        ["orchestrator", "--verifier", verifier.addr, "--drafter", drafter.addr, "--backend-timeout", "0.5"],
    )
    start_all([orch])
    a = Session(verifier.addr)
    assert a.next().WhichOneof("response") == "opened"
    b = Session(verifier.addr, progress_ms=100)  # waits for a's slot, hearing Progress; its cancel frees its place
    assert b.next().WhichOneof("response") == "progress" and verifier_info(verifier.addr).queued_sessions == 1
    b.call.cancel()
    wait_until(lambda: verifier_info(verifier.addr).queued_sessions == 0, timeout=4, what="b's queue place freed")
    assert verifier_info(verifier.addr).live_sessions == 1
    req = generate_pb2.GenerateRequest(sampling_params=generate_pb2.SamplingParams(max_tokens=16))
    req.tokenized.ids.extend(PROMPT)
    call = generation_stub(orch.addr).Generate(req, timeout=60)
    answers: list = []
    waiter = threading.Thread(target=lambda: answers.append(_answers(call)), daemon=True)
    waiter.start()
    wait_until(lambda: verifier_info(verifier.addr).queued_sessions == 1, what="the generation's session queued")
    waiter.join(2)  # four --backend-timeouts in the queue, well within its --queue-timeout (8 s)
    a.call.cancel()
    waiter.join(60)
    assert isinstance(answers[0], list), answers[0]
    assert answers[0][-1].complete.completion_tokens == 16


def _answers(call) -> list | grpc.RpcError:
    try:
        return list(call)
    except grpc.RpcError as exc:
        return exc


def test_a_session_that_alone_outgrows_the_budget_is_out_of_range_at_once(servers):
    """No wait in the queue and no retry can make it fit: OUT_OF_RANGE (its orchestrator's caller gets a 400, not a
    429 to retry), refused while a session that fits would still wait for its room."""
    addr = servers["queued"].addr
    a = Session(addr)
    assert a.next().WhichOneof("response") == "opened"
    huge = Session(addr, max_positions=3 * POSITIONS)  # its worst case is more than the whole budget
    with pytest.raises(grpc.RpcError) as err:
        huge.next()
    assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE and "more than the whole budget" in err.value.details()
    assert verifier_info(addr).queued_sessions == 0
    a.call.cancel()
    wait_until(lambda: _free(addr), what="everything freed")


@pytest.mark.parametrize("ending", ["finished", "half-closed", "cancelled", "errored", "deadline", "idle"])
def test_every_way_a_session_ends_frees_its_memory(servers, ending):
    addr = servers["strict"].addr
    s = Session(addr, timeout=2 if ending == "deadline" else 60)
    assert s.next().WhichOneof("response") == "opened"
    s.send(V(prefill=V.Prefill(token_ids=PROMPT)))
    assert s.next().WhichOneof("response") == "prefilled"
    live = verifier_info(addr)
    assert live.live_sessions == 1 and live.live_kv_bytes > 0 and live.reserved_kv_bytes >= live.live_kv_bytes
    if ending == "finished":
        s.send(V(close=V.Close()))
        assert s.next().WhichOneof("response") == "closed"
    elif ending == "half-closed":
        s.half_close()
        with pytest.raises(StopIteration):
            s.next()
    elif ending == "cancelled":
        s.call.cancel()
    elif ending == "errored":
        s.send(V(prefill=V.Prefill(token_ids=PROMPT)))  # prefilled already: FAILED_PRECONDITION
        with pytest.raises(grpc.RpcError) as err:
            s.next()
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    elif ending == "deadline":
        with pytest.raises(grpc.RpcError) as err:
            s.next()
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    else:  # idle: the server closes a session whose client sends nothing for --idle-timeout (3 s), saying why
        with pytest.raises(grpc.RpcError) as err:  # (a session left open would end with the call's own 60-s
            s.next()  # deadline, which names no --idle-timeout)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "--idle-timeout" in err.value.details()
    wait_until(lambda: _free(addr), what=f"a {ending} session's memory freed")


def test_an_idle_drafter_session_expires(servers):
    addr = servers["drafter"].addr
    stop = threading.Event()

    def requests():
        yield drafter_pb2.DrafterRequest(open=drafter_pb2.DrafterRequest.Open())
        stop.wait(30)

    call = drafter_stub(addr).Session(requests(), timeout=30)
    assert next(call).WhichOneof("response") == "opened"
    with pytest.raises(grpc.RpcError) as err:
        next(call)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "drafter: " in err.value.details()
    assert "--idle-timeout" in err.value.details()
    stop.set()
    wait_until(lambda: drafter_info(addr).live_sessions == 0, what="the idle drafter session closed")


def test_idle_streams_beyond_the_limit_leave_the_public_api_answering(servers):
    """~128 opened-but-idle verifier streams: the limit refuses the extra ones, GetInfo/Generate still answer."""
    small, orch = servers["small"].addr, servers["orchestrator"].addr
    held, refused = [], 0
    for _ in range(128):
        s = Session(small, timeout=60)
        held.append(s)
    for s in held:
        try:
            s.next()
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            refused += 1
    assert refused == 128 - 3
    # answered, not hung: a call that hangs ends with its own deadline (DEADLINE_EXCEEDED), not these statuses
    assert verifier_info(small).live_sessions == 3
    stub = generation_stub(orch)
    assert stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=5).vocab_size > 0
    req = generate_pb2.GenerateRequest(sampling_params=generate_pb2.SamplingParams(max_tokens=4))
    req.tokenized.ids.extend(PROMPT)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(req, timeout=10))
    # the verifier's limit is the operator's: the caller learns only to retry (test_errors.py)
    assert err.value.details() == "verifier: session limit reached; retry later"
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    for s in held:
        s.call.cancel()
    wait_until(lambda: verifier_info(small).live_sessions == 0, what="the held streams freed")
    assert len(list(stub.Generate(req, timeout=30))) >= 2


def test_no_session_limit_leaves_no_thread_limit_either(server_factory):
    """``--max-sessions 0`` is no limit (deploy/mac/run.sh's default): streams beyond the 64 + 16 threads the pool
    used to keep were refused RESOURCE_EXHAUSTED by gRPC itself ("Concurrent RPC limit exceeded"), GetInfo too."""
    unbounded = server_factory("unbounded", ["drafter", *TINY_MLX, "--max-sessions", "0", "--grace", "1"])
    start_all([unbounded])
    stop = threading.Event()

    def requests():
        yield drafter_pb2.DrafterRequest(open=drafter_pb2.DrafterRequest.Open())
        stop.wait(60)

    held = [drafter_stub(unbounded.addr).Session(requests(), timeout=60) for _ in range(100)]
    try:
        opened = []
        for call in held:
            try:
                opened.append(next(call).WhichOneof("response"))
            except grpc.RpcError as exc:
                opened.append(f"{exc.code().name}: {exc.details()}")
        assert opened == ["opened"] * 100, sorted(set(opened))
        info = drafter_info(unbounded.addr)  # answered beside the 100 sessions that hold a thread each
        assert (info.max_sessions, info.live_sessions) == (0, 100)
    finally:
        stop.set()
        for call in held:
            call.cancel()


def test_auto_block_sizes_start_within_a_budget_that_holds_the_request(servers, server_factory):
    """The first auto-sized request (auto is the default) times each block size on live sessions
    (``block_sizing.measure_costs``), which opened asking for the verifier's whole context (``max_positions`` 0): a
    --max-kv-bytes budget that holds many sessions of the requests' length but not one of the whole context refused
    them, so every auto request failed "outgrows its K/V memory; ask for fewer tokens", however few it asked for."""
    orch = server_factory(
        "auto-orchestrator",
        ["orchestrator", "--verifier", servers["strict"].addr, "--drafter", servers["drafter"].addr, "--grace", "1"],
    )
    start_all([orch])
    ids, _, complete, _ = generate(orch.addr, request(PROMPT, max_tokens=8, block_size=0), timeout=120)
    assert len(ids) == 8 and complete.finish_reason == generate_pb2.FINISH_REASON_LENGTH


def test_a_generation_whose_verifier_session_waits_for_kv_room_is_served_once_there_is_room(servers, server_factory):
    """Found by a batch on `serve all --max-kv-bytes 20000000 --queue 64` (the demo pair): the verifier queued the
    sessions its budget had no room for, as --queue says, but a queued session sent its orchestrator nothing, which
    after --backend-timeout took it for a hung verifier: 14 of 40 requests ended 504 "verifier did not answer in time"
    (each one alone ran). Here the budget is held by another (busy-free) session for longer than that timeout."""
    addr = servers["queued"].addr
    orch = server_factory(
        "queued-split",
        ["orchestrator", "--verifier", addr, "--drafter", servers["drafter"].addr, "--backend-timeout", "0.5"],
    )
    start_all([orch])
    a = Session(addr)
    assert a.next().WhichOneof("response") == "opened"
    req = generate_pb2.GenerateRequest(sampling_params=generate_pb2.SamplingParams(max_tokens=POSITIONS - 8))
    req.tokenized.ids.extend(PROMPT)  # its worst case is a's: it waits for a's room
    call = generation_stub(orch.addr).Generate(req, timeout=60)
    answers: list = []

    def wait_for_it():
        try:
            answers.append(list(call))
        except grpc.RpcError as exc:
            answers.append(exc)

    waiter = threading.Thread(target=wait_for_it, daemon=True)
    waiter.start()
    wait_until(lambda: verifier_info(addr).queued_sessions == 1, what="the generation's session queued")
    waiter.join(2)  # four --backend-timeouts in the queue, well within its --queue-timeout (8 s)
    a.call.cancel()
    waiter.join(60)
    assert isinstance(answers[0], list), answers[0]  # not a hung verifier's failure, nor its take-over's
    assert answers[0][-1].complete.completion_tokens == POSITIONS - 8
    wait_until(lambda: _free(addr), what="everything freed")
