"""Faults on real processes: a drafter SIGKILLed mid-stream, a verifier gone, SIGTERM draining.

This module's servers are its own: the tests kill and restart them (in this order).
"""

from __future__ import annotations

import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kakeya.runtime.lifecycle import LIVENESS
from kakeya.wire.kakeya.v1 import generate_pb2

from .conftest import TINY_MLX, channel, generate, generation_stub, request, start_all, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # real processes: bounded, never hanging

PROMPT = [2, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60]
N = 200


@pytest.fixture(scope="module")
def servers(server_factory):
    verifier = server_factory("verifier", ["verifier", *TINY_MLX, "--grace", "5"])
    drafter = server_factory("drafter", ["drafter", *TINY_MLX, "--grace", "5"])
    start_all([verifier, drafter])
    orch = server_factory(
        "orchestrator", ["orchestrator", "--verifier", verifier.addr, "--drafter", drafter.addr, "--grace", "20"]
    )
    start_all([orch])
    return {"verifier": verifier, "drafter": drafter, "orchestrator": orch}


@pytest.fixture(scope="module")
def reference(mlx_target):
    from kakeya.verifier.mlx_backend.reference import greedy_reference

    ids, _, _ = greedy_reference(mlx_target.model, PROMPT, N)
    return ids


def _server_info(addr):
    return generation_stub(addr).GetServerInfo(generate_pb2.GetServerInfoRequest(), timeout=5)


def _health(addr, service: str = ""):
    stub = health_pb2_grpc.HealthStub(channel(addr))
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_drafter_killed_mid_stream_falls_back_then_reconnects(servers, reference):
    orch, drafter = servers["orchestrator"], servers["drafter"]
    ids, _, complete, _ = generate(orch.addr, request(PROMPT, max_tokens=N))
    assert ids == reference and not complete.stats.drafter_fallback

    call = generation_stub(orch.addr).Generate(request(PROMPT, max_tokens=N), timeout=120)
    got, after_kill, complete = [], 0, None
    for resp in call:
        if resp.HasField("chunk"):
            got.extend(resp.chunk.token_ids)
            if drafter.alive() and len(got) >= 5:
                drafter.signal(signal.SIGKILL)
                drafter.wait(10)
            elif not drafter.alive():
                after_kill += 1
        else:
            complete = resp.complete
    assert after_kill > 10, "the drafter died too late to test a mid-stream failure"
    assert got == reference  # the verifier finished alone, same tokens
    assert complete.finish_reason == generate_pb2.FINISH_REASON_LENGTH and complete.stats.drafter_fallback
    assert 1 in complete.stats.acceptance_lengths
    assert _health(orch.addr) == health_pb2.HealthCheckResponse.SERVING

    # While the drafter is down, requests still succeed (verifier alone) and say so.
    ids, _, complete, _ = generate(orch.addr, request(PROMPT, max_tokens=20))
    assert ids == reference[:20] and complete.stats.drafter_fallback
    assert _server_info(orch.addr).extra["drafter_state"] != "ok"

    # Back on the same port: later requests use it again.
    drafter.start().wait_ready()

    def speculating():
        ids, _, complete, _ = generate(orch.addr, request(PROMPT, max_tokens=20))
        assert ids == reference[:20]
        return not complete.stats.drafter_fallback

    wait_until(speculating, interval=0.5, what="the orchestrator to use the restarted drafter")
    assert _server_info(orch.addr).extra["drafter_state"] == "ok"


def test_verifier_unreachable_is_unavailable_and_the_server_recovers(servers, server_factory, reference):
    orch, verifier, drafter = servers["orchestrator"], servers["verifier"], servers["drafter"]
    verifier.signal(signal.SIGKILL)
    verifier.wait(10)
    with pytest.raises(grpc.RpcError) as err:
        generate(orch.addr, request(PROMPT, max_tokens=8))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "verifier" in err.value.details()
    # still up and answering: its health watch (polled each second) turns NOT_SERVING while the verifier is down
    wait_until(
        lambda: _health(orch.addr) == health_pb2.HealthCheckResponse.NOT_SERVING,
        what="the orchestrator to report its verifier down",
    )
    assert _health(orch.addr, LIVENESS) == health_pb2.HealthCheckResponse.SERVING  # no livenessProbe restarts it

    # A new orchestrator started while its verifier is down: up, but NOT_SERVING until it can warm up.
    late = server_factory("late", ["orchestrator", "--verifier", verifier.addr, "--drafter", drafter.addr]).start()
    wait_until(lambda: _health_or_none(late), what="the late orchestrator to listen")
    assert _health(late.addr) == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(grpc.RpcError) as err:
        generate(late.addr, request(PROMPT, max_tokens=8))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE

    verifier.start().wait_ready()
    ids = wait_until(lambda: _try(orch.addr), interval=0.5, what="the verifier to be reachable again")
    assert ids == reference[:8]
    late.wait_ready(60)
    assert _health(late.addr) == health_pb2.HealthCheckResponse.SERVING
    assert generate(late.addr, request(PROMPT, max_tokens=8))[0] == reference[:8]


def _health_or_none(server):
    """The health status once the process listens (its log names the port), else None."""
    import re

    m = re.search(r"listening on (\S+)", server.log())
    if not m:
        return None
    server.addr = m.group(1)
    return _health(server.addr) is not None


def _try(addr):
    try:
        return generate(addr, request(PROMPT, max_tokens=8))[0]
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.UNAVAILABLE
        return None


def test_grace_expiry_ends_streams_with_abort(servers, server_factory, reference):
    """A generation longer than --grace ends with FINISH_REASON_ABORT and a clean prefix, then the server exits."""
    v, d = servers["verifier"].addr, servers["drafter"].addr
    orch = (
        server_factory("short-grace", ["orchestrator", "--verifier", v, "--drafter", d, "--grace", "2"])
        .start()
        .wait_ready()
    )
    call = generation_stub(orch.addr).Generate(request(PROMPT, max_tokens=4000, block_size=4), timeout=120)
    got, complete, signalled = [], None, False
    for resp in call:
        if resp.HasField("chunk"):
            got.extend(resp.chunk.token_ids)
            if len(got) >= 3 and not signalled:
                orch.signal(signal.SIGTERM)
                signalled = True
        else:
            complete = resp.complete
    assert complete is not None and complete.finish_reason == generate_pb2.FINISH_REASON_ABORT
    assert 3 <= len(got) < 4000 and got[:N] == reference[: len(got[:N])]
    assert complete.completion_tokens == len(got)
    assert orch.wait(20) == 0


def _refused(addr) -> bool:
    """A new request is refused with UNAVAILABLE. False: it was served, or CANCELLED (it came in just as the
    server stopped taking calls); any other failure fails the test."""
    try:
        generate(addr, request(PROMPT, max_tokens=4), timeout=30)
    except grpc.RpcError as exc:
        assert exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), (exc.code(), exc.details())
        return exc.code() == grpc.StatusCode.UNAVAILABLE
    return False


def test_sigterm_drains_in_flight_streams_then_exits(servers, reference):
    orch = servers["orchestrator"]
    call = generation_stub(orch.addr).Generate(request(PROMPT, max_tokens=N), timeout=120)
    got, complete = [], None
    t_term = None
    for resp in call:
        if resp.HasField("chunk"):
            got.extend(resp.chunk.token_ids)
            if t_term is None and len(got) >= 3:
                orch.signal(signal.SIGTERM)
                t_term = time.monotonic()
                # draining: no new work is accepted (once the signal is handled: a request may pass before)
                wait_until(lambda: _refused(orch.addr), what="new requests refused while draining")
        else:
            complete = resp.complete
    assert got == reference and complete.finish_reason == generate_pb2.FINISH_REASON_LENGTH
    assert orch.wait(30) == 0
    assert time.monotonic() - t_term < 20 + 5
