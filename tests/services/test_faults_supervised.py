"""Faults under `serve all`: a dead child is restarted and serving goes on (real processes, loopback).

- drafter SIGKILLed mid-stream: the stream completes through the verifier alone
  (AR fallback, identical tokens), serving goes on, the supervisor restarts the
  drafter, and a later request speculates again;
- verifier SIGKILLed: a request gets UNAVAILABLE within UNAVAILABLE_BOUND_S,
  and once it is restarted requests succeed;
- orchestrator SIGKILLed: restarted on the same port, new requests succeed; its HTTP and health ports
  (--http-port 0, --health-port 0: picked at its first start) stay its own too;
- SIGTERM still stops everything and exits 0.

The tests run in this order on one `serve all` (module scope).
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .conftest import TINY_ALL_MLX, generate, generation_stub, request, wait_until
from .test_serve_all import pid_alive

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

PROMPT = [2, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60]
N = 200
UNAVAILABLE_BOUND_S = 5.0  # docs/operations.md: a dead verifier is UNAVAILABLE within this, never a hang


@pytest.fixture(scope="module")
def served(server_factory):
    argv = ["all", *TINY_ALL_MLX, "--grace", "5", "--http-port", "0", "--health-port", "0"]
    s = server_factory("all-faults", argv).start().wait_ready()
    yield s
    s.stop()
    for pid in _info(s)["pids"].values():  # children started after a restart too
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def reference(mlx_target):
    from kakeya.verifier.mlx_backend.reference import greedy_reference

    ids, _, _ = greedy_reference(mlx_target.model, PROMPT, N)
    return ids


def _info(s) -> dict:
    try:
        return json.loads(s.ready_file.read_text())
    except (OSError, ValueError):
        return s.info


def _restarted(s, name: str, old_pid: int):
    """The serve all summary once ``name`` runs again under a new pid (SERVING)."""
    info = _info(s)
    return info if info["restarts"][name] >= 1 and info["pids"][name] != old_pid else None


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not pid_alive(pid), what=f"pid {pid} to die")


def test_dead_drafter_never_takes_serving_down(served, reference):
    drafter_pid = _info(served)["pids"]["drafter"]
    call = generation_stub(served.addr).Generate(request(PROMPT, max_tokens=N), timeout=60)
    got, after_kill, complete = [], 0, None
    for resp in call:
        if resp.HasField("chunk"):
            got.extend(resp.chunk.token_ids)
            if pid_alive(drafter_pid) and len(got) >= 5:
                _kill(drafter_pid)
            elif not pid_alive(drafter_pid):
                after_kill += 1
        else:
            complete = resp.complete
    assert after_kill > 10, "the drafter died too late to test a mid-stream failure"
    assert got == reference and complete.stats.drafter_fallback  # AR fallback, identical output

    ids, _, complete, _ = generate(served.addr, request(PROMPT, max_tokens=20), timeout=30)  # still serving
    assert ids == reference[:20]

    info = wait_until(lambda: _restarted(served, "drafter", drafter_pid), interval=0.2, what="drafter restart")
    assert info["drafter"] == served.info["drafter"]  # same address: the orchestrator finds it again

    def speculating():
        ids, _, c, _ = generate(served.addr, request(PROMPT, max_tokens=20), timeout=30)
        assert ids == reference[:20]
        return not c.stats.drafter_fallback and any(n > 1 for n in c.stats.acceptance_lengths)

    wait_until(speculating, interval=0.5, what="speculation with the restarted drafter")


def test_dead_verifier_is_unavailable_within_the_bound_then_recovers(served, reference):
    verifier_pid = _info(served)["pids"]["verifier"]
    _kill(verifier_pid)
    t0 = time.monotonic()
    try:
        ids = generate(served.addr, request(PROMPT, max_tokens=8), timeout=30)[0]
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.UNAVAILABLE
    else:  # the take-over's retries outlasted the supervisor's restart: served by the new verifier, exactly
        # (the old one is dead; the supervisor may write its summary a moment later -- the wait below checks it)
        assert ids == reference[:8]
    assert time.monotonic() - t0 < UNAVAILABLE_BOUND_S

    wait_until(lambda: _restarted(served, "verifier", verifier_pid), interval=0.2, what="verifier restart")

    def served_again():
        try:
            return generate(served.addr, request(PROMPT, max_tokens=8), timeout=30)[0]
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE  # never anything else meanwhile
            return None

    assert wait_until(served_again, interval=0.3, what="requests to succeed again") == reference[:8]


def test_dead_orchestrator_is_restarted_on_its_port(served, reference):
    orch_pid = _info(served)["pids"]["orchestrator"]
    _kill(orch_pid)
    info = wait_until(lambda: _restarted(served, "orchestrator", orch_pid), interval=0.2, what="orchestrator restart")
    assert info["addr"] == served.addr
    ids, _, complete, _ = generate(served.addr, request(PROMPT, max_tokens=N), timeout=30)
    assert ids == reference and not complete.stats.drafter_fallback


def test_a_restarted_orchestrator_keeps_its_http_and_health_ports(served):
    """With --http-port 0 a restarted orchestrator served its HTTP API on another port (41715, then 37207), and the
    health port --health-port 0 picked was in no ready file of serve all's (nor in any log line)."""
    before = _info(served)
    assert before.get("health_port") and before.get("http_port"), before
    orch_pid = before["pids"]["orchestrator"]
    _kill(orch_pid)
    after = wait_until(lambda: _restarted(served, "orchestrator", orch_pid), interval=0.2, what="orchestrator restart")
    assert (after["http_port"], after["health_port"]) == (before["http_port"], before["health_port"])
    with grpc.insecure_channel(f"127.0.0.1:{after['health_port']}") as ch:
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    conn = http.client.HTTPConnection("127.0.0.1", after["http_port"], timeout=10)
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200


def test_sigterm_still_stops_everything(served):
    pids = _info(served)["pids"]
    served.signal(signal.SIGTERM)
    assert served.wait(30) == 0
    wait_until(lambda: not any(pid_alive(p) for p in pids.values()), what="children gone")


def test_restart_backoff_doubles_from_half_a_second_to_ten():
    from kakeya.app.supervisor import backoff_delay, with_option

    assert [backoff_delay(n) for n in range(1, 8)] == [0.5, 1, 2, 4, 8, 10, 10]
    assert with_option(["--port", "0", "--x", "1"], "--port", "5") == ["--port", "5", "--x", "1"]
    assert with_option(["--x", "1"], "--metrics-port", "7") == ["--x", "1", "--metrics-port", "7"]


def test_a_child_killed_by_a_signal_is_logged_by_its_signal(tmp_path, caplog):
    """A child the OOM killer (SIGKILL) or a hangup (SIGHUP) ended was logged as "exited with status -9" / "-1":
    Popen's negated signal number, read as an exit status that no process can have."""
    from kakeya.app.supervisor import Child, Supervisor

    sup = Supervisor(grace=1)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    sup.children["drafter"] = Child("drafter", [], tmp_path / "drafter.json", proc=proc)
    proc.send_signal(signal.SIGHUP)
    proc.wait()
    sup.stop.set()  # logged, not restarted
    with caplog.at_level(logging.ERROR, logger="kakeya.all"):
        sup.poll()
    assert f"drafter (pid {proc.pid}) was killed by signal 1 (Hangup): restarting it" in caplog.text, caplog.text
