"""`/metrics` and JSON logs of a real `serve all`: the counters are the generation's own figures,
and one request id appears in the logs of all three processes, whichever front (gRPC or HTTP) the request came by."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys

import grpc
import pytest

from .conftest import ROOT, TINY_ALL_MLX, ar_fallbacks, generate, generation_stub, request, scrape, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPT = [2, 40, 41, 42, 43, 44, 45, 46, 47, 48]


@pytest.fixture(scope="module")
def served(server_factory):
    return (
        server_factory(
            "all-obs",
            ["all", *TINY_ALL_MLX, "--grace", "5", "--metrics-port", "0", "--log-format", "json", "--http-port", "0"],
        )
        .start()
        .wait_ready()
    )


def expected_spec_counts(acceptance_lengths, max_tokens: int, block_size: int) -> dict:
    """What the loop drafted and accepted, rebuilt from the Complete's acceptance lengths."""
    produced, drafts, drafted, per_pos = 1, 0, 0, {}
    for n in acceptance_lengths:
        b = min(block_size, max_tokens - produced)
        if b > 1:
            drafts, drafted = drafts + 1, drafted + b - 1
        for pos in range(n - 1):
            per_pos[str(pos)] = per_pos.get(str(pos), 0) + 1
        produced += n
    return {
        "drafts": drafts,
        "drafted": drafted,
        "accepted": sum(n - 1 for n in acceptance_lengths),
        "per_pos": per_pos,
    }


def test_metrics_count_what_the_generation_did(served):
    ports = served.info["metrics_ports"]
    assert set(ports) == {"orchestrator", "verifier", "drafter"} and len(set(ports.values())) == 3
    before = scrape(ports["orchestrator"])
    assert before[("kakeya_spec_decode_num_drafts_total", ())] == 0  # the warm-up is not counted

    max_tokens, block = 40, 4
    req = request(PROMPT, max_tokens=max_tokens, block_size=block)
    req.request_id = "req-metrics-1"
    ids, _, complete, _ = generate(served.addr, req)
    assert len(ids) == max_tokens and not complete.stats.drafter_fallback
    want = expected_spec_counts(list(complete.stats.acceptance_lengths), max_tokens, block)
    assert want["drafts"] > 0

    m = scrape(ports["orchestrator"])
    assert m[("kakeya_spec_decode_num_drafts_total", ())] == want["drafts"]
    assert m[("kakeya_spec_decode_num_draft_tokens_total", ())] == want["drafted"]
    assert m[("kakeya_spec_decode_num_accepted_tokens_total", ())] == want["accepted"]
    per_pos = {
        dict(k[1])["position"]: v
        for k, v in m.items()
        if k[0] == "kakeya_spec_decode_num_accepted_tokens_per_pos_total"
    }
    assert per_pos == want["per_pos"]
    assert m[("kakeya_request_success_total", (("finished_reason", "length"),))] == 1
    assert m[("kakeya_generation_tokens_total", ())] == max_tokens
    assert m[("kakeya_prompt_tokens_total", ())] == len(PROMPT)
    assert m[("kakeya_time_to_first_token_seconds_count", ())] == 1
    assert m[("kakeya_inter_token_latency_seconds_count", ())] == len(complete.stats.acceptance_lengths)
    for phase in ("draft", "verify", "wire"):
        assert m[("kakeya_block_latency_seconds_count", (("phase", phase),))] == len(complete.stats.acceptance_lengths)
    assert m[("kakeya_num_requests_running", ())] == 0 and m[("kakeya_num_requests_waiting", ())] == 0
    assert ar_fallbacks(ports["orchestrator"]) == 0  # whatever the reason

    # The servers close a session when its stream ends, which may land just after the client's last message:
    # wait for it (a session that is never freed times out here), then read the rest.
    v = wait_until(lambda: (m := scrape(ports["verifier"]))[("kakeya_sessions_live", ())] == 0 and m, 10.0,
                   what="the verifier to close the session")  # fmt: skip
    assert v[("kakeya_sessions_total", ())] >= 2  # warm-up + ours
    assert (
        v[("kakeya_kv_cache_bytes", (("kind", "sliding"),))] == 0
        and v[("kakeya_kv_cache_bytes", (("kind", "full"),))] == 0
    )
    d = wait_until(lambda: (m := scrape(ports["drafter"]))[("kakeya_sessions_live", ())] == 0 and m, 10.0,
                   what="the drafter to close the session")  # fmt: skip
    assert d[("kakeya_sessions_total", ())] >= 2
    # sessions closed and round calls done are no errors, though the orchestrator lets go of each once read
    assert not [k for k in (*v, *d) if k[0] == "kakeya_errors_total"]


def test_errors_are_counted_by_grpc_status(served):
    port = served.info["metrics_ports"]["orchestrator"]
    key = ("kakeya_errors_total", (("code", "INVALID_ARGUMENT"),))
    before = scrape(port).get(key, 0)
    with pytest.raises(grpc.RpcError) as err:
        list(generation_stub(served.addr).Generate(request(PROMPT, max_tokens=10**6), timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert scrape(port)[key] == before + 1


def test_one_request_id_in_the_json_logs_of_all_three_processes(served):
    req = request(PROMPT, max_tokens=8, block_size=4)
    req.request_id = "req-logs-7"
    generate(served.addr, req)

    def tagged():
        out = {}
        for line in served.log_file.read_text(errors="replace").splitlines():
            if not line.startswith("{"):
                continue
            rec = json.loads(line)  # every JSON line parses
            assert {"ts", "level", "logger", "msg"} <= set(rec)
            if rec.get("request_id") == "req-logs-7":
                out.setdefault(rec["process"], rec)
        return out if len(out) == 3 else None

    found = wait_until(tagged, what="the request id in every process's log")
    assert set(found) == {"orchestrator", "verifier", "drafter"}
    assert found["verifier"].get("session_id") and found["drafter"].get("session_id")


def _request_ids(served, process: str, msg_start: str) -> list[str]:
    """The request ids of ``process``'s JSON log lines whose message starts with ``msg_start``, in order."""
    lines = (json.loads(x) for x in served.log_file.read_text(errors="replace").splitlines() if x.startswith("{"))
    return [r.get("request_id", "") for r in lines if r["process"] == process and r["msg"].startswith(msg_start)]


@pytest.mark.parametrize("proxy_id", ["", "envoy-5f1c"])
def test_a_request_has_one_id_in_every_process_whoever_names_it(served, proxy_id):
    """A request without ``request_id``: the id the orchestrator makes up is on its own lines too, or the one a
    proxy sent as ``x-request-id`` metadata (Envoy adds one to every call) names it in all three processes --
    never one id in the orchestrator's log and another in the verifier's. The call's initial metadata says it."""
    before = len(_request_ids(served, "orchestrator", "finished:"))
    metadata = (("x-request-id", proxy_id),) if proxy_id else ()
    call = generation_stub(served.addr).Generate(request(PROMPT, max_tokens=8, block_size=4), metadata=metadata)
    list(call)
    finished = wait_until(lambda: _request_ids(served, "orchestrator", "finished:")[before:], what="its line")
    rid = finished[0]
    assert rid and rid == (proxy_id or rid), finished
    assert dict(call.initial_metadata())["x-request-id"] == rid  # the client can quote it, as HTTP's header
    assert _request_ids(served, "orchestrator", "generate:")[-1] == rid
    for backend in ("verifier", "drafter"):
        wait_until(lambda: rid in _request_ids(served, backend, ""), what=f"the {backend}'s line")  # noqa: B023


def test_a_malformed_x_request_id_is_refused_by_its_name(served):
    with pytest.raises(grpc.RpcError) as err:
        list(generation_stub(served.addr).Generate(request(PROMPT), metadata=(("x-request-id", "x" * 129),)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("x-request-id metadata: "), err.value.details()


def test_a_refused_generate_names_its_request_id_as_http_does(served):
    """A refused Generate names the id it came with (its field, else its ``x-request-id`` metadata), and one the
    orchestrator made up, in the call's trailing metadata, as the HTTP front's ``X-Request-Id`` header does on
    errors: a client quotes it to the operator, whose log has the request under it."""
    stub = generation_stub(served.addr)
    for metadata, rid in (((("x-request-id", "lb-err-2"),), "lb-err-2"), ((), None)):
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request(PROMPT, max_tokens=10**6), metadata=metadata))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert err.value.details().startswith("sampling_params.max_tokens: "), err.value.details()
        sent = dict(err.value.trailing_metadata() or ()).get("x-request-id")
        assert sent == (rid or sent) and sent, err.value.trailing_metadata()


def _completion(served, body: dict, headers: dict) -> tuple[int, str | None, dict]:
    """POST /v1/completions: the status, the answer's X-Request-Id header (None: absent) and its JSON body."""
    conn = http.client.HTTPConnection("127.0.0.1", served.info["http_port"], timeout=120)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json", **headers})
        r = conn.getresponse()
        return r.status, r.getheader("X-Request-Id"), json.loads(r.read())
    finally:
        conn.close()


def test_an_http_request_carries_its_x_request_id_to_every_process_and_back(served):
    """A load balancer's ``X-Request-Id`` names the request in the logs of all three processes, as the gRPC
    front's ``x-request-id`` metadata does, and comes back in the answer's header."""
    status, rid, body = _completion(served, {"prompt": PROMPT, "max_tokens": 8}, {"X-Request-Id": "lb-http-7c2e"})
    assert status == 200 and rid == "lb-http-7c2e", (status, rid, body)
    for process in ("orchestrator", "verifier", "drafter"):
        wait_until(lambda: rid in _request_ids(served, process, ""), what=f"the {process}'s line")  # noqa: B023


def test_an_http_answer_names_its_request_id_whoever_made_it_and_on_errors(served):
    """Without ``X-Request-Id`` (nor a body ``request_id``) the answer names the id the logs have; a refused request
    still names the one it came with; the body's ``request_id`` goes first, as gRPC's field before its metadata."""
    before = len(_request_ids(served, "orchestrator", "finished:"))
    status, rid, _ = _completion(served, {"prompt": PROMPT, "max_tokens": 8}, {})
    assert status == 200 and rid
    assert wait_until(lambda: _request_ids(served, "orchestrator", "finished:")[before:], what="its line") == [rid]
    status, rid, body = _completion(served, {"prompt": PROMPT, "max_tokens": 10**6}, {"X-Request-Id": "lb-err-1"})
    assert (status, rid, body["error"]["param"]) == (400, "lb-err-1", "max_tokens"), body
    body = {"prompt": PROMPT, "max_tokens": 4, "request_id": "own-id-3"}
    assert _completion(served, body, {"X-Request-Id": "lb-3"})[:2] == (200, "own-id-3")


def test_http_errors_are_counted_by_grpc_status_as_the_grpc_apis_are(served):
    """A dashboard's error rate (``kakeya_errors_total{code}``) counts the HTTP API's refusals too, under the gRPC
    code the same refusal has there: an HTTP-only deployment showed none."""
    port = served.info["metrics_ports"]["orchestrator"]
    key = ("kakeya_errors_total", (("code", "INVALID_ARGUMENT"),))
    before = scrape(port).get(key, 0)
    assert _completion(served, {"prompt": PROMPT, "max_tokens": 10**6}, {})[0] == 400
    assert scrape(port).get(key, 0) == before + 1


def test_a_malformed_x_request_id_header_is_refused_by_its_name(served):
    status, rid, body = _completion(served, {"prompt": PROMPT, "max_tokens": 4}, {"X-Request-Id": "x" * 129})
    assert status == 400 and rid is None, (status, rid)
    assert body["error"]["param"] == "X-Request-Id" and body["error"]["message"].startswith("X-Request-Id: "), body


def test_the_http_servers_own_warnings_are_json_lines_too(served):
    """uvicorn installed its own handler (its log_config, now None: its loggers reach the process's): a malformed HTTP request's warning came out as the plain text line
    "WARNING:  Invalid HTTP request received." among the JSON ones, which a JSON log pipeline cannot parse."""
    with socket.create_connection(("127.0.0.1", served.info["http_port"]), timeout=10) as sock:
        sock.sendall(b"GARBAGE\r\n\r\n")
        assert sock.recv(64).startswith(b"HTTP/1.1 400")  # uvicorn logs its warning before it answers
    lines = served.log_file.read_text(errors="replace").splitlines()
    assert not [line for line in lines if "Invalid HTTP request" in line and not line.startswith("{")]
    records = [json.loads(line) for line in lines if line.startswith("{")]
    assert [r["logger"] for r in records if r["msg"] == "Invalid HTTP request received."] == ["uvicorn.error"]


def test_concurrent_split_streams_share_one_round_call_per_backend(served):
    """Six streams at once on `serve all`: each equals the same request alone, and their rounds reached the
    verifier and the drafter as round calls of several sessions each (``kakeya_round_*_total``)."""
    from concurrent.futures import ThreadPoolExecutor

    ports = served.info["metrics_ports"]
    reqs = [request([2, 40 + k, 41, 42, 43, 44, 45], max_tokens=48, block_size=4) for k in range(6)]
    alone = [generate(served.addr, r)[0] for r in reqs]
    before = {role: scrape(ports[role]) for role in ("verifier", "drafter")}
    with ThreadPoolExecutor(len(reqs)) as ex:
        together = list(ex.map(lambda r: generate(served.addr, r)[0], reqs))
    assert together == alone
    for role in ("verifier", "drafter"):
        m = scrape(ports[role])
        calls = m[("kakeya_round_calls_total", ())] - before[role][("kakeya_round_calls_total", ())]
        items = m[("kakeya_round_items_total", ())] - before[role][("kakeya_round_items_total", ())]
        assert calls >= 1 and items >= 2 * calls, (role, calls, items)  # every round call carried 2+ sessions


@pytest.mark.parametrize("role", ["drafter", "all"])
def test_an_unknown_log_level_is_refused_naming_kakeya_log_level(role):
    """KAKEYA_LOG_LEVEL=verbose ended in "kakeya: error: Unknown level: 'VERBOSE'": which setting it came from was
    left to guess (it is no flag of the command line)."""
    env = dict(os.environ, KAKEYA_LOG_LEVEL="verbose")
    r = subprocess.run([sys.executable, "-m", "kakeya.app.main", "serve", role, "--port", "0"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    (line,) = [x for x in r.stderr.splitlines() if x.startswith("kakeya: error:")]
    assert "KAKEYA_LOG_LEVEL" in line and "'VERBOSE'" in line and "DEBUG" in line, line
