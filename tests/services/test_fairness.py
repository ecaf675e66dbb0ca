"""One caller cannot hold every session (issue "Zero trust inside the cluster").

The red team opened 300 idle verifier sessions: 64 were admitted and every
public request failed with RESOURCE_EXHAUSTED until ``--idle-timeout``. Now a
per-peer cap (``--max-sessions-per-peer``) bounds what one caller holds, and
when a limit would refuse a new session the longest-idle sessions (silent for
``--reclaim-idle``) are ended first, with ABORTED and the reason; expiry says
why too. The registry is tested directly, then on real servers.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from kakeya.runtime.admission import SessionLimitError, SessionRegistry
from kakeya.wire.kakeya.v1 import verifier_pb2

from .conftest import TINY_MLX, generate, request, start_all, verifier_info, verifier_stub, wait_until

PROMPT = [2, 40, 41, 42, 43, 44]
V = verifier_pb2.VerifierRequest


class _Session:
    closed = False

    def close(self):
        self.closed = True


def _open(registry: SessionRegistry, peer: str, idle_s: float = 0.0):
    """A session of ``peer`` that has waited ``idle_s`` on its client; records how it was ended."""
    entry = registry.open(peer)
    entry.session = _Session()
    entry.ended = None
    entry.end = lambda code, why, e=entry: setattr(e, "ended", (code, why))
    if idle_s:
        entry.waiting, entry.last_active = True, time.monotonic() - idle_s
    return entry


# --------------------------------------------------------------------------- the registry


def test_a_peer_is_capped_and_others_still_get_in():
    r = SessionRegistry(max_sessions=10, max_per_peer=2)
    _open(r, "ipv4:10.0.0.1"), _open(r, "ipv4:10.0.0.1")
    with pytest.raises(SessionLimitError, match="--max-sessions-per-peer"):
        r.open("ipv4:10.0.0.1")
    _open(r, "ipv4:10.0.0.2")
    assert r.live == 3


def test_a_full_server_reclaims_the_longest_idle_session_first():
    r = SessionRegistry(max_sessions=3, reclaim_idle_s=1.0)
    busy = _open(r, "a")  # working: never reclaimed
    older, newer = _open(r, "b", idle_s=9.0), _open(r, "b", idle_s=3.0)
    fresh = _open(r, "c")  # admitted in the room of the longest idle
    assert older.closed and older.session is None and older.ended[0] == grpc.StatusCode.ABORTED
    assert "reclaimed" in older.ended[1] and "--reclaim-idle" in older.ended[1]
    assert not (busy.closed or newer.closed or fresh.closed) and r.live == 3 and r.reclaimed == 1


def test_sessions_idle_less_than_reclaim_idle_are_kept_and_the_limit_refuses():
    r = SessionRegistry(max_sessions=2, reclaim_idle_s=5.0)
    a, b = _open(r, "a", idle_s=1.0), _open(r, "a", idle_s=2.0)
    with pytest.raises(SessionLimitError, match="--max-sessions"):
        r.open("b")
    assert not (a.closed or b.closed)
    off = SessionRegistry(max_sessions=1, reclaim_idle_s=0.0)  # 0: never reclaim
    _open(off, "a", idle_s=100.0)
    with pytest.raises(SessionLimitError):
        off.open("b")


def test_the_per_peer_cap_reclaims_only_that_peers_own_idle_sessions():
    r = SessionRegistry(max_sessions=10, max_per_peer=1, reclaim_idle_s=1.0)
    other = _open(r, "victim", idle_s=50.0)
    mine = _open(r, "hog", idle_s=5.0)
    _open(r, "hog")
    assert mine.closed and not other.closed


def test_the_kv_budget_reclaims_idle_reservations_and_growth_never_waits():
    r = SessionRegistry(max_sessions=10, max_kv_bytes=100, queue=4, queue_timeout_s=5.0, reclaim_idle_s=1.0)
    idle = _open(r, "a", idle_s=10.0)
    r.reserve(idle, 80)
    working = _open(r, "b")
    r.reserve(working, 60)  # fits only once the idle session's 80 bytes are reclaimed
    assert idle.closed and r.reserved_bytes == 60
    r.reserve(working, 90)  # a session's own reservation grows in place
    other = _open(r, "c")
    with pytest.raises(SessionLimitError, match="--max-kv-bytes") as err:
        r.reserve(other, 20, wait=False)  # growth of a live session: refused at once, never queued
    assert "--queue" not in str(err.value)  # it never waited: one that waits is refused naming --queue-timeout,
    q = SessionRegistry(max_kv_bytes=100, queue=1, queue_timeout_s=0.01)
    q.reserve(_open(q, "a"), 80)
    with pytest.raises(SessionLimitError, match="--queue-timeout"):
        q.reserve(_open(q, "b"), 50)  # as a new session's reservation does


def test_a_session_that_alone_outgrows_the_budget_takes_no_one_elses_room():
    """Refused OUT_OF_RANGE at once: reclaiming idle sessions or waiting in the queue could never make it fit."""
    r = SessionRegistry(max_kv_bytes=100, queue=2, queue_timeout_s=60.0, reclaim_idle_s=1.0)
    idle = _open(r, "a", idle_s=30.0)
    r.reserve(idle, 10)
    with pytest.raises(SessionLimitError, match="more than the whole budget") as err:
        r.reserve(_open(r, "b"), 101)
    assert err.value.code == grpc.StatusCode.OUT_OF_RANGE and "--queue" not in str(err.value)
    assert not idle.closed and r.reclaimed == 0 and r.waiting == 0
    r.reserve(_open(r, "c"), 95)  # one that fits once the idle session's room is reclaimed takes it
    assert idle.closed and r.reclaimed == 1


def test_a_queued_session_gets_the_room_of_one_that_idles_meanwhile():
    r = SessionRegistry(max_sessions=1, queue=1, queue_timeout_s=60.0, reclaim_idle_s=0.5)
    held = _open(r, "a")
    with ThreadPoolExecutor(1) as pool:
        newcomer = pool.submit(_open, r, "b")
        wait_until(lambda: r.waiting == 1, what="the newcomer waiting in the queue")
        assert not held.closed  # held works: nothing to reclaim yet
        idle_since = time.monotonic()
        held.last_active, held.waiting = idle_since, True  # now it waits on its client
        newcomer.result(timeout=60)
    assert held.closed and held.ended[0] == grpc.StatusCode.ABORTED
    assert time.monotonic() - idle_since >= 0.5  # not before it had idled --reclaim-idle


def test_idle_expiry_says_why():
    r = SessionRegistry(idle_timeout_s=0.4)
    e = _open(r, "a", idle_s=0.0)
    e.waiting = True
    wait_until(lambda: e.closed, what="the idle session expired")
    wait_until(lambda: e.ended is not None, what="its stream ended")
    assert e.ended[0] == grpc.StatusCode.DEADLINE_EXCEEDED and "--idle-timeout" in e.ended[1] and e.session is None


def test_a_session_attached_after_its_entry_ended_is_still_freed():
    r = SessionRegistry(max_sessions=2)
    e = _open(r, "a")
    r.close(e)
    late = e.session = _Session()  # a step that finished after the stream ended
    r.close(e)
    assert late.closed and e.session is None


# --------------------------------------------------------------------------- real servers


@pytest.fixture(scope="module")
def servers(server_factory):
    # "localhost": 127.0.0.1 and ::1, so one test client can be two peers
    v = server_factory("verifier", ["verifier", *TINY_MLX, "--host", "localhost", "--max-sessions", "3",
                                    "--max-sessions-per-peer", "2", "--reclaim-idle", "1", "--grace", "1"])  # fmt: skip
    start_all([v])
    port = v.addr.rsplit(":", 1)[1]
    o = server_factory("orchestrator", ["orchestrator", "--verifier", f"127.0.0.1:{port}", "--max-sessions-per-peer", "1",
                                        "--grace", "1"])  # fmt: skip
    start_all([o])
    return {"v4": f"127.0.0.1:{port}", "v6": f"[::1]:{port}", "orchestrator": o}


class _Held:
    """A verifier session that opens, prefills, then sends nothing until released."""

    def __init__(self, addr: str):
        self.release = threading.Event()

        def requests():
            yield V(open=V.Open(max_positions=64))
            yield V(prefill=V.Prefill(token_ids=PROMPT))
            self.release.wait(60)

        self.call = verifier_stub(addr).Session(requests(), timeout=60)

    def first(self):
        return next(self.call).WhichOneof("response")

    def end(self) -> grpc.RpcError:
        """How the server ended the stream."""
        with pytest.raises(grpc.RpcError) as err:
            for _ in self.call:
                pass
        self.release.set()
        return err.value


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_one_peer_cannot_hold_every_session(servers):
    hog = [_Held(servers["v4"]) for _ in range(2)]
    assert [h.first() for h in hog] == ["opened", "opened"]
    third = _Held(servers["v4"])
    err = third.end()
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-sessions-per-peer" in err.details()
    other = _Held(servers["v6"])  # another caller still gets the room that is left
    assert other.first() == "opened"
    for h in (*hog, other):
        h.call.cancel()
        h.release.set()
    wait_until(lambda: verifier_info(servers["v4"]).live_sessions == 0, what="sessions freed")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_idle_sessions_held_by_a_hostile_client_cannot_make_a_public_request_fail(servers):
    held = []  # the verifier's 3 sessions (which one is idle longest: the registry tests above)
    for addr in (servers["v4"], servers["v4"], servers["v6"]):
        held.append(_Held(addr))
        assert [held[-1].first(), held[-1].first()] == ["opened", "prefilled"]  # its last message was handled
    wait_until(lambda: verifier_info(servers["v4"]).live_sessions == 3, what="every session held")
    # refused (RESOURCE_EXHAUSTED) until one of them has idled --reclaim-idle (1 s), then served
    ids, _, complete, _ = wait_until(lambda: _generated(servers["orchestrator"].addr, 8), what="a public request")
    assert len(ids) == 8 and complete.finish_reason

    def settled():  # the request's own session closed, and the one that made room for it ended
        ended = [h for h in held if h.call.done()]
        return ended if ended and verifier_info(servers["v4"]).live_sessions == 2 else None

    reclaimed = wait_until(settled, what="one held session ended, the others still live")
    assert len(reclaimed) == 1  # one made room, the rest stay
    ended = reclaimed[0].end()  # ... and was told why
    assert (
        ended.code() == grpc.StatusCode.ABORTED
        and "reclaimed" in ended.details()
        and "--reclaim-idle" in ended.details()
    )
    for h in held:
        h.call.cancel()
        h.release.set()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_public_api_caps_one_caller_too(servers):
    addr = servers["orchestrator"].addr
    from .conftest import generation_stub

    stream = generation_stub(addr).Generate(request(PROMPT, max_tokens=400, block_size=1), timeout=60)
    assert next(stream).HasField("chunk")  # one generation in flight from this caller
    with pytest.raises(grpc.RpcError) as err:
        generate(addr, request(PROMPT, max_tokens=4))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-sessions-per-peer" in err.value.details()
    stream.cancel()
    wait_until(lambda: _generates(addr), what="the caller's slot back")


def _generated(addr: str, n: int):
    """A generation of ``n`` tokens, or None when the verifier's sessions are all taken (RESOURCE_EXHAUSTED)."""
    try:
        return generate(addr, request(PROMPT, max_tokens=n))
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (exc.code(), exc.details())
        return None


def _generates(addr: str) -> bool:
    try:
        return len(generate(addr, request(PROMPT, max_tokens=4))[0]) == 4
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        return False
