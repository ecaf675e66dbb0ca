"""Drains: a verifier or drafter told to stop (SIGTERM) hands its live sessions over at their next step.

A verifier and a drafter servicer (the tiny pair, MLX) on one in-process loopback server with gRPC health,
as ``run_server`` serves them; ``_drain`` is what SIGTERM calls there (``ServerSpec.before_drain``, after
health went NOT_SERVING). From then on every answer says ``draining`` (the answer itself valid); the client
(``remote/streams.py``) ends a session that may move (``SessionOptions.movable``: its caller takes sessions
over) before its next step while another replica answers SERVING -- here the same server's health stands
for that other replica -- and one that may not, or has nowhere to go, finishes where it is. The process
level (a rolling restart of every backend under 8 streams) is ``test_hosts.py``, a SIGTERM'd process's exit
below; an orchestrator's drain (its streams finish, then it exits though a health Watch stays), here and in
``test_faults.py``.
"""

from __future__ import annotations

import json
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2

from kakeya.core.contract import Draft, SessionOptions
from kakeya.orchestrator.remote.drafter import GrpcDrafter
from kakeya.orchestrator.remote.streams import BackendError
from kakeya.orchestrator.remote.verifier import GrpcVerifier
from kakeya.runtime.metrics import ServerMetrics
from kakeya.wire.kakeya.v1 import verifier_pb2

from ..waiting import holds_for, wait_until
from .conftest import in_process_mlx_pair, verifier_stub

PROMPT = [2, 40, 41, 42, 43, 44, 45, 46]
MOVABLE = SessionOptions(movable=True)
V = verifier_pb2.VerifierRequest


@pytest.fixture(scope="module")
def served(tiny_pair, aux_layers):
    yield from in_process_mlx_pair(tiny_pair, aux_layers)


@pytest.fixture
def node(served):
    """The server SERVING and not draining, as each test starts; its sessions all gone when it ends."""
    served["health"].set("", health_pb2.HealthCheckResponse.SERVING)
    yield served
    wait_until(lambda: served["verifier"].registry.live == 0 and served["drafter"].registry.live == 0,
               what="every session freed")  # fmt: skip
    served["verifier"].draining = served["drafter"].draining = False


def _serving(node, ok: bool) -> None:
    """Another replica answers SERVING (``ok``), or none does (the draining one is the last)."""
    status = health_pb2.HealthCheckResponse
    node["health"].set("", status.SERVING if ok else status.NOT_SERVING)


def _clients(node):
    drafter = GrpcDrafter(node["addr"])
    return GrpcVerifier(node["addr"], aux_layers=drafter.target_layer_ids), drafter


def _rounds(verifier, n: int, drain=None, at: int = 0, options: SessionOptions = MOVABLE, sessions: int = 1):
    """``n`` verify rounds of ``sessions`` sessions (two or more: their blocks travel in ``VerifyRound`` calls
    while they may), ``drain()`` called before round ``at``: each round's verdicts ``(accepted, next_token)``,
    and the errors of the round that ended them early (None: none did)."""
    opened = [verifier.open_session(options=options) for _ in range(sessions)]
    lasts = [s.prefill(PROMPT)[0] for s in opened]
    rounds = []
    try:
        for k in range(n):
            if k == at and drain is not None:
                drain()
            out = verifier.decide_batch([(s, last, Draft([7, 8])) for s, last in zip(opened, lasts)])
            errors = [x for x in out if isinstance(x, Exception)]
            if errors:
                return rounds, errors
            rounds.append([(x.accepted, x.next_token) for x in out])
            lasts = [x.next_token for x in out]
    finally:
        for s in opened:
            s.close()
    return rounds, None


def test_every_answer_says_draining_and_stays_valid(node):
    """The answer to the step in hand when the drain begins is the one an undrained server gives."""
    stub = verifier_stub(node["addr"])

    def session():  # the block opens with any token: the verifier takes it as committed
        steps = {"open": V.Open(request_id="r"), "prefill": V.Prefill(token_ids=PROMPT),
                 "verify": V.Verify(block_ids=[PROMPT[-1], 7, 8]), "close": V.Close()}  # fmt: skip
        return list(stub.Session(iter([V(**{k: m}) for k, m in steps.items()]), timeout=60))

    plain = session()
    node["verifier"]._drain()
    drained = session()
    assert [r.WhichOneof("response") for r in drained] == ["opened", "prefilled", "verified", "closed"]
    assert all(r.draining for r in drained) and not any(r.draining for r in plain)
    assert drained[1].prefilled.next_token == plain[1].prefilled.next_token
    assert (drained[2].verified.accepted, drained[2].verified.next_token) == (
        plain[2].verified.accepted, plain[2].verified.next_token)  # fmt: skip


@pytest.mark.parametrize("sessions", [1, 3], ids=["on-its-stream", "in-round-calls"])
def test_a_verifier_session_that_may_move_leaves_at_its_next_step(node, sessions):
    verifier, _ = _clients(node)
    reference, none = _rounds(verifier, 4, sessions=sessions)
    assert none is None and len(reference) == 4
    rounds_before = node["verifier"].round_calls
    got, errors = _rounds(verifier, 4, node["verifier"]._drain, at=2, sessions=sessions)
    if sessions > 1:  # the rounds up to the refusal travelled as round calls (the drain said so in a Done)
        assert node["verifier"].round_calls - rounds_before >= 2
    # the round in hand when the drain began is answered and counts; the next step is refused on our side
    assert got == reference[:3]
    assert len(errors) == sessions
    for exc in errors:
        assert isinstance(exc, BackendError) and exc.drained and exc.replica_lost
        assert exc.code == grpc.StatusCode.UNAVAILABLE and exc.service == "verifier"
    wait_until(lambda: node["verifier"].registry.live == 0, what="the server to free the sessions")


def test_with_no_replica_serving_or_no_take_over_the_session_finishes_where_it_is(node):
    verifier, _ = _clients(node)
    reference, _ = _rounds(verifier, 5)

    def drain_alone():  # no other replica answers: the draining one is the last
        node["verifier"]._drain()
        _serving(node, False)

    assert _rounds(verifier, 5, drain_alone, at=1) == (reference, None)
    node["verifier"].draining = False
    _serving(node, True)
    # the channel hears SERVING on its health watch, not at once: until then a new session finds no healthy replica
    grpc.channel_ready_future(verifier.channel).result(timeout=30)
    # another replica serves, but this caller cannot take sessions over
    assert _rounds(verifier, 5, node["verifier"]._drain, at=1, options=SessionOptions()) == (reference, None)


def test_a_drafter_session_moves_without_backing_the_drafter_off(node):
    verifier, drafter = _clients(node)
    vs, ds = verifier.open_session(options=MOVABLE), drafter.open_session(options=MOVABLE)
    first, aux = vs.prefill(PROMPT)
    verdict = vs.decide(first, ds.draft(aux, first, 4))
    node["drafter"]._drain()
    verdict = vs.decide(verdict.next_token, ds.draft(verdict.aux, verdict.next_token, 4))  # answered, says draining
    with pytest.raises(BackendError) as exc:
        ds.draft(verdict.aux, verdict.next_token, 4)
    assert exc.value.drained and exc.value.replica_lost and exc.value.service == "drafter"
    assert drafter.backoff.failures == 0 and drafter.state == "ok"  # new requests still draft at once
    vs.close()
    ds.close()
    wait_until(lambda: node["drafter"].registry.live == 0, what="the drafter to free the session")


def test_the_sessions_left_at_the_end_of_the_grace_end_as_a_lost_replica(node):
    """Sessions still open when the grace is almost over end with UNAVAILABLE: a take-over moves them (a
    lost replica's), where a cut process would have failed them."""
    verifier, _ = _clients(node)
    s = verifier.open_session(options=SessionOptions())
    first, _ = s.prefill(PROMPT)
    node["verifier"]._end_sessions()
    with pytest.raises(BackendError) as exc:
        s.decide(first, Draft([7, 8]))
    assert exc.value.replica_lost and not exc.value.drained
    assert "shutting down" in exc.value.details


def test_hand_offs_are_counted_apart_from_losses():
    m = ServerMetrics("orchestrator")
    m.takeover("verifier", 0.2, drained=True)
    m.takeover("drafter", 0.1, drained=True)
    m.takeover("verifier", 0.3)
    sample = m.registry.get_sample_value
    assert sample("kakeya_drain_handoffs_total", {"role": "verifier"}) == 1
    assert sample("kakeya_drain_handoffs_total", {"role": "drafter"}) == 1
    assert sample("kakeya_takeovers_total", {"role": "verifier"}) == 1
    assert sample("kakeya_takeovers_total", {"role": "drafter"}) in (None, 0)


def test_a_sigterm_backend_waits_for_its_sessions_not_for_a_health_watch(server_factory):
    """A process with a long grace: a live session holds its drain (it may still move at its next step), a
    health Watch (which no client ends; nor does a peer gone without a FIN) does not: once the session is gone
    the process exits at once, status 0, instead of waiting out --grace (the 15 s teardowns of test_hosts.py)."""
    import queue
    import signal

    from grpc_health.v1 import health_pb2_grpc

    from .conftest import TINY_MLX, channel

    server = server_factory("verifier", ["verifier", *TINY_MLX, "--grace", "60"]).start().wait_ready()
    watch = health_pb2_grpc.HealthStub(channel(server.addr)).Watch(health_pb2.HealthCheckRequest())
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    sent: queue.Queue = queue.Queue()
    for req in (V(open=V.Open(request_id="drain-exit")), V(prefill=V.Prefill(token_ids=PROMPT))):
        sent.put(req)
    session = verifier_stub(server.addr).Session(iter(sent.get, None))
    assert next(session).HasField("opened") and next(session).HasField("prefilled")
    server.signal(signal.SIGTERM)
    assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING  # the drain began
    holds_for(server.alive, 2.0, what="the draining process with a live session")
    session.cancel()  # its client moved it elsewhere
    wait_until(lambda: not server.alive(), timeout=15, what="the process to exit, its last session gone")
    assert server.proc.returncode == 0, server.log()
    assert "verifier stopped after" in server.log()
    watch.cancel()


# --------------------------------------------------------------------------- an orchestrator's drain


def test_a_draining_orchestrator_finishes_its_streams_and_refuses_the_rest(tiny_pair):
    """Colocated, HTTP: the generation in flight ends whole, the one queued behind it and any new one hear 503
    naming the drain (so their clients retry another replica), and /health says so to the load balancer."""
    import http.client

    from kakeya.orchestrator.assembly import build_local_engine
    from kakeya.orchestrator.fronts.grpc_server import GenerationServicer
    from kakeya.orchestrator.fronts.http_server import HttpFront
    from kakeya.orchestrator.fronts.service import DRAINING

    servicer = GenerationServicer(lambda: build_local_engine(str(tiny_pair.target), str(tiny_pair.draft), "mlx"),
                                  colocated=True, max_sessions=1, queue=1, queue_timeout_s=60)  # fmt: skip
    servicer.load()
    servicer.ready = True
    front = HttpFront(servicer, 0, "tiny")
    port = front.start("127.0.0.1")

    def post(max_tokens: int):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        try:
            conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
            r = conn.getresponse()
            return r.status, json.loads(r.read())
        finally:
            conn.close()

    try:
        status, alone = post(300)
        assert status == 200
        results: dict = {}
        first = threading.Thread(target=lambda: results.setdefault("first", post(300)))
        first.start()
        wait_until(lambda: servicer.active == 1, what="the first generation to start")
        queued = threading.Thread(target=lambda: results.setdefault("queued", post(8)))
        queued.start()
        wait_until(lambda: len(servicer._waiting) == 1, what="the second to wait in the queue")
        servicer.drain()
        queued.join(30)
        assert results["queued"][0] == 503 and results["queued"][1]["error"]["message"] == DRAINING
        assert post(8)[0] == 503
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 503
        conn.close()
        first.join(120)
        status, body = results["first"]
        assert status == 200 and body["choices"][0]["finish_reason"] == "length"
        assert body["choices"][0]["text"] == alone["choices"][0]["text"]  # whole, as before the drain
    finally:
        front.drain()
        front.join(5)


def test_a_sigterm_orchestrator_finishes_its_stream_then_exits_though_a_health_watch_stays(server_factory):
    """As a backend above: a load balancer's health Watch (never ended by its client) must not hold a drained
    orchestrator for its whole --grace. The generation in flight ends whole; then the process exits, status 0."""
    import signal

    from grpc_health.v1 import health_pb2_grpc

    from .conftest import TINY, channel, generation_stub, request

    orch = server_factory("orchestrator", ["orchestrator", *TINY, "--grace", "60"]).start().wait_ready()
    watch = health_pb2_grpc.HealthStub(channel(orch.addr)).Watch(health_pb2.HealthCheckRequest())
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    stream = generation_stub(orch.addr).Generate(request(PROMPT, max_tokens=200, block_size=4))
    first = next(stream)  # the generation is in flight
    orch.signal(signal.SIGTERM)
    assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING  # the drain began
    answers = [first, *stream]
    tokens = [t for r in answers if r.HasField("chunk") for t in r.chunk.token_ids]
    assert len(tokens) == 200 and answers[-1].complete.completion_tokens == 200, "the stream in flight ends whole"
    wait_until(lambda: not orch.alive(), timeout=15, what="the drained orchestrator to exit, a Watch still open")
    assert orch.proc.returncode == 0, orch.log()
    watch.cancel()
