"""Failure drills on real processes, as an SRE runs them before trusting the split: what a client sees.

Each test starts its own servers with the project's own commands (``kakeya serve ...``, ``conftest.Server``), hurts
one the way an operator or a node would (SIGTERM, SIGKILL) while a stream is in flight, and checks what the docs
promise the client: a clean end, the role named, no hang.
"""

from __future__ import annotations

import http.client
import json
import signal

import pytest

from .conftest import TINY

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # real processes: bounded, never hanging

PROMPT = [2, 40, 41, 42, 43, 44, 45, 46]


def _sse(resp) -> tuple[list[dict], bool, str]:
    """A streamed HTTP answer read to its end: its events, whether ``[DONE]`` came, and how the read ended
    ("" when the server closed the stream cleanly, else the exception that cut it)."""
    events, done, cut = [], False, ""
    try:
        for raw in resp:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                events.append(json.loads(line[len("data: ") :]))
    except (http.client.IncompleteRead, ConnectionError) as exc:
        cut = f"{type(exc).__name__}: {exc}"
    return events, done, cut


def test_an_http_stream_in_flight_at_the_end_of_a_drain_ends_with_abort_not_a_cut(server_factory):
    """docs/operations.md, "Drains and rolling updates": generations still running one second before the grace
    ends stop with finish reason abort, a clean prefix. Over HTTP that is a last event with ``finish_reason``
    ``abort`` and ``[DONE]``, not a connection cut mid-stream (the openai SDK's "Connection error")."""
    orch = server_factory(
        "orchestrator", ["orchestrator", *TINY, "--backend", "torch", "--http-port", "0", "--grace", "3"]
    )
    orch.start().wait_ready()
    conn = http.client.HTTPConnection("127.0.0.1", orch.info["http_port"], timeout=60)
    body = {"prompt": PROMPT, "max_tokens": 4000, "temperature": 0, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    first = resp.readline()  # the generation is in flight
    assert first.startswith(b"data: ")
    orch.signal(signal.SIGTERM)
    events, done, cut = _sse(resp)
    conn.close()
    assert not cut, f"the stream was cut: {cut}"
    assert done and events[-1]["choices"][0]["finish_reason"] == "abort", events[-1:]
    assert 0 < len(events[-1]["kakeya"]["token_ids"]) < 4000
    assert orch.wait(30) == 0
    assert "Traceback" not in orch.log_file.read_text(errors="replace")  # uvicorn cancelled no stream at the grace


def test_one_hung_verifier_replica_of_two_leaves_the_orchestrator_serving(server_factory):
    """docs/operations.md, "Take-over": a replica that hangs does not fail the streams; with another verifier
    replica SERVING, the orchestrator stays SERVING (else readiness takes every orchestrator out of its Service
    for one hung pod) and new generations are admitted, not refused with "verifier unavailable"."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from .conftest import channel, generate, request, start_all
    from .conftest import holds_for as _holds_for

    backend = [*TINY, "--backend", "torch", "--grace", "2"]
    v0, v1 = (server_factory(n, ["verifier", *backend]) for n in ("hv0", "hv1"))
    d0 = server_factory("hd0", ["drafter", *backend])
    start_all([v0, v1, d0])
    orch = server_factory(
        "horch", ["orchestrator", "--verifier", f"ipv4:{v0.addr},{v1.addr}", "--drafter", d0.addr, "--grace", "2",
                  "--backend-timeout", "2"],
    )  # fmt: skip
    start_all([orch])
    health = health_pb2_grpc.HealthStub(channel(orch.addr))
    serving = health_pb2.HealthCheckResponse.SERVING
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == serving
    v0.signal(signal.SIGSTOP)  # hung: its connections stay open, nothing answers
    try:
        _holds_for(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == serving, 8,
                   interval=0.2, what="the orchestrator's health with one verifier replica of two hung")  # fmt: skip
        for k in range(4):  # new generations are admitted and finish (on the replica that answers)
            ids, _, complete, _ = generate(orch.addr, request([*PROMPT, k], max_tokens=8), timeout=60)
            assert len(ids) == 8, complete.error_message
    finally:
        v0.signal(signal.SIGCONT)


def test_a_non_streamed_http_generation_whose_verifiers_all_die_mid_way_is_a_503_naming_the_role(server_factory):
    """docs/operations.md: with every verifier replica gone the request fails with the role's error; over HTTP the
    status a client, a proxy or ``kakeya_errors_total{code}`` reads is the same refusal's (503 UNAVAILABLE), not an
    internal error's 500, and the answer names no internal address."""
    import threading

    from .conftest import scrape, start_all, wait_until

    backend = [*TINY, "--backend", "torch", "--grace", "2"]
    verifier, drafter = server_factory("nv", ["verifier", *backend]), server_factory("nd", ["drafter", *backend])
    start_all([verifier, drafter])
    orch = server_factory("norch", ["orchestrator", "--verifier", verifier.addr, "--drafter", drafter.addr,
                                    "--http-port", "0", "--metrics-port", "0"])  # fmt: skip
    start_all([orch])
    answer: dict = {}

    def post():
        conn = http.client.HTTPConnection("127.0.0.1", orch.info["http_port"], timeout=120)
        body = {"prompt": PROMPT, "max_tokens": 4000, "temperature": 0, "ignore_eos": True}
        conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
        r = conn.getresponse()
        answer.update(status=r.status, body=json.loads(r.read()))
        conn.close()

    t = threading.Thread(target=post)
    t.start()
    metrics = orch.info["metrics_port"]
    drafts = ("kakeya_spec_decode_num_drafts_total", ())
    wait_until(lambda: scrape(metrics).get(drafts, 0) > 0, what="the generation's first blocks")
    verifier.signal(signal.SIGKILL)
    t.join(120)
    message = answer["body"]["error"]["message"]
    assert message == "generation failed: verifier unavailable (not reachable, loading or draining); retry later"
    assert verifier.addr not in message and str(verifier.port) not in message
    assert answer["status"] == 503, answer
    errors = {dict(labels).get("code"): v for (n, labels), v in scrape(metrics).items() if n == "kakeya_errors_total"}
    assert errors.get("UNAVAILABLE") == 1 and "INTERNAL" not in errors, errors
