"""Resumable streams on real processes: a Generate that carries the tokens its client already received
(``resume_token_ids``) continues exactly where its stream broke, on any orchestrator.

One verifier, one drafter and two orchestrators in front of them. An orchestrator SIGKILLed while
``kakeya client --addr A,B`` streams from it: the client resumes on the other and its output is the
uninterrupted run's (0 tokens lost or repeated), greedy and seeded. Then the request's field itself:
every split point gives the exact remainder, and what cannot resume exactly is refused by name.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import grpc
import pytest

from kakeya.wire.kakeya.v1 import generate_pb2

from .conftest import ROOT, TINY_MLX, generate, request, scrape, start_all, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPT = [2, *range(40, 62)]
N = 200
SEEDED = {"temperature": 0.8, "seed": 77}


@pytest.fixture(scope="module")
def backends(server_factory):
    verifier = server_factory("verifier", ["verifier", *TINY_MLX])
    drafter = server_factory("drafter", ["drafter", *TINY_MLX])
    start_all([verifier, drafter])
    return verifier, drafter


def _orchestrator_argv(backends, *extra: str) -> list[str]:
    verifier, drafter = backends
    return ["orchestrator", "--verifier", verifier.addr, "--drafter", drafter.addr, "--metrics-port", "0", *extra]


@pytest.fixture(scope="module")
def servers(server_factory, backends):
    orchs = [server_factory(f"orch-{k}", _orchestrator_argv(backends)) for k in range(2)]
    start_all(orchs)
    return orchs


@pytest.fixture(scope="module")
def reference(servers):
    out = {}
    for name, sampling in (("greedy", {}), ("seeded", SEEDED)):
        ids, _, complete, _ = generate(servers[1].addr, request(PROMPT, max_tokens=N, **sampling))
        assert len(ids) == N and complete.finish_reason == generate_pb2.FINISH_REASON_LENGTH
        out[name] = ids
    return out


def _blocks_streamed(server) -> float:
    m = scrape(server.info["metrics_port"])
    return m.get(("kakeya_inter_token_latency_seconds_count", ()), 0.0)


def _client_across(first, second, name: str, interrupt) -> tuple[dict, str]:
    """``kakeya client generate --json`` over ``first,second``; ``interrupt(first)`` once its stream is under way.
    The client's final JSON report and its stderr, after checking it exited 0."""
    before = _blocks_streamed(first)
    sampling = ["--temperature", "0.8", "--seed", "77"] if name == "seeded" else []
    cmd = [sys.executable, "-m", "kakeya.app.main", "client", "--addr", f"{first.addr},{second.addr}", "generate",
           "--prompt-ids", ",".join(map(str, PROMPT)), "--max-tokens", str(N), "--ignore-eos", "--block-size", "8",
           "--json", *sampling]  # fmt: skip
    client = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: _blocks_streamed(first) >= before + 3, interval=0.02, what="the stream to be under way")
        interrupt(first)
        out, err = client.communicate(timeout=240)
    finally:
        if client.poll() is None:
            client.kill()
    assert client.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1]), err


def _kill(server) -> None:
    server.signal(signal.SIGKILL)
    server.wait(10)


@pytest.mark.parametrize("name", ["greedy", "seeded"])
def test_the_client_resumes_on_another_orchestrator_when_its_own_dies(servers, reference, name, tmp_path):
    first, second = servers
    if not first.alive():
        first.start().wait_ready()
    report, err = _client_across(first, second, name, _kill)
    assert "resuming after" in err, f"the stream was not broken mid-way: {err}"
    assert report["token_ids"] == reference[name], "tokens lost or repeated across the resume"
    assert report["finish_reason"] == "length"


@pytest.mark.parametrize("name", ["greedy", "seeded"])
def test_the_client_resumes_a_stream_its_draining_orchestrator_aborted(
    servers, backends, reference, server_factory, name
):
    """A rolling update of the orchestrators: one told to stop (SIGTERM) with a stream still running past its
    --grace ends it with FINISH_REASON_ABORT, a clean prefix. The client goes on with it on the next address as
    with a broken stream and ends with the uninterrupted run's tokens, never with the prefix as the answer."""
    draining = server_factory(f"orch-grace-{name}", _orchestrator_argv(backends, "--grace", "1"))
    draining.start().wait_ready()
    # --grace 1: its streams end with FINISH_REASON_ABORT at once
    report, err = _client_across(draining, servers[1], name, lambda s: s.signal(signal.SIGTERM))
    assert "FINISH_REASON_ABORT; resuming after" in err, f"the stream was not aborted mid-way: {err}"
    assert report["token_ids"] == reference[name], "the aborted prefix was taken for the whole generation"
    assert report["finish_reason"] == "length"


@pytest.mark.parametrize("name", ["greedy", "seeded"])
def test_every_split_point_gives_the_exact_remainder(servers, reference, name):
    orch = servers[1]
    sampling = SEEDED if name == "seeded" else {}
    for k in (1, 7, 64, N - 1, N):  # N: broken before its Complete, which comes alone
        req = request(PROMPT, max_tokens=N, **sampling)
        req.resume_token_ids.extend(reference[name][:k])
        ids, _, complete, _ = generate(orch.addr, req)
        assert ids == reference[name][k:], f"resumed after {k}: not the remainder"
        assert complete.finish_reason == generate_pb2.FINISH_REASON_LENGTH and complete.completion_tokens == N


def test_what_cannot_resume_exactly_is_refused_by_name(servers, reference):
    orch = servers[1]
    cases = [
        (request(PROMPT, max_tokens=8), reference["greedy"][:9], "max_tokens"),  # 8: the Complete alone
        (request(PROMPT, max_tokens=N, temperature=0.8), reference["seeded"][:4], "seed"),
        (request(PROMPT, max_tokens=N, stop_token_ids=[reference["greedy"][2]]), reference["greedy"][:4], "stop token"),
        (request(PROMPT, max_tokens=N), [10**9], "vocabulary"),
    ]
    for req, resumed, why in cases:
        req.resume_token_ids.extend(resumed)
        with pytest.raises(grpc.RpcError) as err:
            generate(orch.addr, req)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert "resume_token_ids" in err.value.details() and why in err.value.details(), err.value.details()
    assert generate(orch.addr, request(PROMPT, max_tokens=8))[0] == reference["greedy"][:8]  # still serving
