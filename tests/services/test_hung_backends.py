"""A hung (SIGSTOPped) or dead backend is noticed within seconds, and health follows the verifier.

Own servers: the tests stop and continue them. Every SIGSTOP is undone in a
``finally`` (and the fixture kills the process groups whatever happens).
"""

from __future__ import annotations

import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .conftest import TINY_MLX, ar_fallbacks, channel, generate, holds_for, request, start_all, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPT = [2, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def servers(server_factory):
    v = server_factory("verifier", ["verifier", *TINY_MLX, "--grace", "2"])
    d = server_factory("drafter", ["drafter", *TINY_MLX, "--grace", "2"])
    start_all([v, d])
    o = server_factory("orchestrator", ["orchestrator", "--verifier", v.addr, "--drafter", d.addr, "--backend-timeout", "1",
                                        "--metrics-port", "0", "--grace", "2"])  # fmt: skip
    start_all([o])
    return {"verifier": v, "drafter": d, "orchestrator": o}


@pytest.fixture(scope="module")
def reference(mlx_target):
    from kakeya.verifier.mlx_backend.reference import greedy_reference

    return greedy_reference(mlx_target.model, PROMPT, 40)[0]


def _health(addr):
    try:
        return health_pb2_grpc.HealthStub(channel(addr)).Check(health_pb2.HealthCheckRequest(), timeout=3).status
    except grpc.RpcError:
        return None


def test_a_stopped_drafter_falls_back_to_ar_within_seconds(servers, reference):
    orch, drafter = servers["orchestrator"], servers["drafter"]
    ids, _, complete, _ = generate(orch.addr, request(PROMPT, max_tokens=40))
    assert ids == reference and not complete.stats.drafter_fallback
    drafter.signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        ids, _, complete, _ = generate(orch.addr, request(PROMPT, max_tokens=40), timeout=30)
        took = time.monotonic() - t0
        assert ids == reference and complete.stats.drafter_fallback
        assert took < 10, f"fallback took {took:.1f} s"
        assert _health(orch.addr) == SERVING  # a drafter down only costs speed
        assert ar_fallbacks(orch.info["metrics_port"], "drafter_failed") >= 1  # a real failure is counted as one
    finally:
        drafter.signal(signal.SIGCONT)

    def speculating():
        ids, _, complete, _ = generate(orch.addr, request(PROMPT, max_tokens=40))
        assert ids == reference
        return not complete.stats.drafter_fallback

    wait_until(speculating, interval=0.5, what="speculation to resume")


def test_a_stopped_verifier_fails_fast_and_health_follows_it(servers, reference):
    orch, verifier = servers["orchestrator"], servers["verifier"]
    assert _health(orch.addr) == SERVING
    verifier.signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            generate(orch.addr, request(PROMPT, max_tokens=20), timeout=60)
        took = time.monotonic() - t0
        assert err.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
        # noticed by the 1-s step deadline, then the take-over looks for another replica (decode/takeover.py:
        # TRIES opens, each bounded by the step deadline, ~3 s of backoff between them) before it gives up
        assert "verifier" in err.value.details() and took < 20, (took, err.value.details())
        wait_until(lambda: _health(orch.addr) == NOT_SERVING, what="NOT_SERVING while the verifier hangs")
        for _ in range(3):  # known down: each request refused at once (never tried: no step to time out)
            with pytest.raises(grpc.RpcError) as err:
                generate(orch.addr, request(PROMPT, max_tokens=20), timeout=60)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
            assert "verifier unavailable (its health checks fail)" in err.value.details()
    finally:
        verifier.signal(signal.SIGCONT)
    wait_until(lambda: _health(orch.addr) == SERVING, what="SERVING once the verifier answers again")
    assert generate(orch.addr, request(PROMPT, max_tokens=40))[0] == reference


def test_health_follows_a_dead_verifier_but_not_a_dead_drafter(servers, reference):
    orch, verifier, drafter = servers["orchestrator"], servers["verifier"], servers["drafter"]
    drafter.signal(signal.SIGKILL)
    drafter.wait(10)
    holds_for(lambda: _health(orch.addr) == SERVING, 2.5, what="SERVING without a drafter")  # a few watch periods
    assert generate(orch.addr, request(PROMPT, max_tokens=40))[0] == reference
    verifier.signal(signal.SIGKILL)
    verifier.wait(10)
    wait_until(lambda: _health(orch.addr) == NOT_SERVING, what="NOT_SERVING without a verifier")
    verifier.start().wait_ready()
    wait_until(lambda: _health(orch.addr) == SERVING, what="SERVING with the verifier back")
    start_all([drafter])
