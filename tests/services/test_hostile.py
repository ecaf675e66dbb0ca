"""The issue's hostile-input table, one reproduction per finding (issue "Zero trust inside the cluster").

Real servers: a verifier, a drafter and a split orchestrator (with /metrics).
Each test is a finding the red team measured; it failed before its fix.
"""

from __future__ import annotations

import subprocess
import sys

import grpc
import numpy as np
import pytest

from kakeya.wire.kakeya.v1 import cache_pb2, generate_pb2, sampling_pb2, verifier_pb2

from .conftest import (
    ROOT,
    TINY,
    TINY_MLX,
    ar_fallbacks,
    generate,
    generation_stub,
    request,
    scrape,
    start_all,
    verifier_stub,
    wait_until,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPT = [2, 40, 41, 42, 43, 44, 45, 46]
V = verifier_pb2.VerifierRequest


@pytest.fixture(scope="module")
def servers(server_factory):
    v = server_factory("verifier", ["verifier", *TINY_MLX, "--grace", "1"])
    d = server_factory("drafter", ["drafter", *TINY_MLX, "--grace", "1"])
    start_all([v, d])
    o = server_factory("orchestrator", ["orchestrator", "--verifier", v.addr, "--drafter", d.addr, "--metrics-port", "0",
                                        "--max-tokens-limit", "4000", "--grace", "1"])  # fmt: skip
    start_all([o])
    return {"verifier": v, "drafter": d, "orchestrator": o}


def _running(port: int) -> float:
    """The orchestrator's generations in flight (``kakeya_num_requests_running``)."""
    return scrape(port)[("kakeya_num_requests_running", ())]


def _code(fn):
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value.code(), err.value.details()


def _public_error_is_clean(details: str, servers) -> None:
    """A public error names public fields and limits: never a backend's address or an internal field."""
    for internal in (
        servers["verifier"].addr,
        servers["drafter"].addr,
        "grpc:",
        "open.",
        "verify.",
        "commit.",
        "prefill.",
    ):
        assert internal not in details, (internal, details)


# --------------------------------------------------------------------------- sampling values


@pytest.mark.parametrize("temperature", [1e-39, 1e-30, 5e-6])
def test_a_degenerate_temperature_is_invalid_argument(servers, temperature):
    """0 < temperature < 1e-5 used to reach the sampler: INTERNAL 'index -1 is out of bounds'."""
    code, details = _code(
        lambda: generate(servers["orchestrator"].addr, request(PROMPT, max_tokens=6, temperature=temperature))
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "sampling_params.temperature" in details, details
    open_ = V.Open(sampling=sampling_pb2.Sampling(temperature=temperature, seed=1))  # the verifier on its own, too
    code, details = _code(
        lambda: list(verifier_stub(servers["verifier"].addr).Session(iter([V(open=open_)]), timeout=10))
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "open.sampling.temperature" in details, details


def test_kakeya_generate_refuses_a_degenerate_temperature_without_a_traceback():
    cmd = [sys.executable, "-m", "kakeya.app.main", "generate", *TINY, "--max-tokens", "4", "--temperature", "1e-39"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2 and "temperature" in r.stderr and "Traceback" not in r.stderr, r.stderr


# --------------------------------------------------------------------------- proposals


def _sampling_session(servers, proposal: sampling_pb2.Proposal, block=(5, 6, 7)):
    """A rejection-rule verifier session (the rule that takes proposals) that verifies ``block`` with
    ``proposal`` for its candidates."""
    sampling = sampling_pb2.Sampling(temperature=1.0, seed=3, rule=sampling_pb2.SAMPLING_RULE_REJECTION)
    msgs = [V(open=V.Open(sampling=sampling)),
            V(prefill=V.Prefill(token_ids=PROMPT)),
            V(verify=V.Verify(block_ids=list(block), proposal=proposal))]  # fmt: skip
    return list(verifier_stub(servers["verifier"].addr).Session(iter(msgs), timeout=20))


def _proposal(ids, probs) -> sampling_pb2.Proposal:
    ids, probs = np.asarray(ids, np.int32), np.asarray(probs, np.float32)
    return sampling_pb2.Proposal(k=ids.shape[1], ids=ids.ravel().tolist(), probs=probs.ravel().tolist())


GOOD_IDS = [[6, 9, 11], [7, 9, 12]]


@pytest.mark.parametrize(
    "name, ids, probs",
    [
        ("rows sum to 1.8", GOOD_IDS, [[0.9, 0.5, 0.4], [0.6, 0.3, 0.1]]),
        ("rows sum to 0.2", GOOD_IDS, [[0.1, 0.05, 0.05], [0.6, 0.3, 0.1]]),
        ("duplicate ids", [[6, 6, 11], [7, 9, 12]], [[0.5, 0.3, 0.2], [0.6, 0.3, 0.1]]),
        ("negative", GOOD_IDS, [[1.2, -0.3, 0.1], [0.6, 0.3, 0.1]]),
        ("nan", GOOD_IDS, [[float("nan"), 0.5, 0.5], [0.6, 0.3, 0.1]]),
        ("id outside vocab", [[6, 9, 5000], [7, 9, 12]], [[0.5, 0.3, 0.2], [0.6, 0.3, 0.1]]),
    ],
)
def test_an_invalid_proposal_is_refused(servers, name, ids, probs):
    """Proposals that are not distributions used to be accepted silently: sampling is exact only for a valid one."""
    code, details = _code(lambda: _sampling_session(servers, _proposal(ids, probs)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "verify.proposal" in details, (name, details)


def test_a_valid_proposal_is_accepted(servers):
    out = _sampling_session(servers, _proposal(GOOD_IDS, [[0.5, 0.3, 0.2], [0.6, 0.3, 0.1]]))
    assert [r.WhichOneof("response") for r in out] == ["opened", "prefilled", "verified"]


# --------------------------------------------------------------------------- error texts


def test_an_error_echoing_a_huge_list_stays_bounded(servers):
    """10,000 target_layer_ids used to come back in the error, overflowing the trailer: RESOURCE_EXHAUSTED."""
    open_ = V.Open(target_layer_ids=list(range(10_000)))
    code, details = _code(
        lambda: list(verifier_stub(servers["verifier"].addr).Session(iter([V(open=open_)]), timeout=10))
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "open.target_layer_ids" in details and len(details) <= 1024


def test_a_cache_window_beyond_the_request_names_the_public_field_and_limit(servers):
    """It used to reach the verifier: 'open.cache_policy.window ... limit 147' at the verifier's address."""
    req = request(PROMPT, max_tokens=40)
    req.cache_policy.CopyFrom(cache_pb2.CachePolicy(kind=cache_pb2.CACHE_KIND_SINK_WINDOW, sink=4, window=100_000))
    code, details = _code(lambda: generate(servers["orchestrator"].addr, req))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "cache_policy.window" in details, details
    assert str(len(PROMPT) + 40) in details  # the limit this request has: its prompt + max_tokens
    _public_error_is_clean(details, servers)


def test_model_info_names_models_not_server_paths(servers):
    info = generation_stub(servers["orchestrator"].addr).GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=10)
    assert (info.target_model, info.draft_model) == ("target", "draft")  # the tiny pair's directories


def test_a_backend_failure_reaches_the_public_api_without_internal_details(servers, server_factory):
    """A verifier that is gone: UNAVAILABLE naming the verifier, not its address."""
    gone = server_factory("gone", ["verifier", *TINY_MLX, "--grace", "1"]).start().wait_ready()
    orch = server_factory("orphan", ["orchestrator", "--verifier", gone.addr, "--grace", "1"]).start().wait_ready()
    gone.stop()
    code, details = _code(lambda: generate(orch.addr, request(PROMPT, max_tokens=4), timeout=20))
    assert code == grpc.StatusCode.UNAVAILABLE and "verifier" in details, details
    assert gone.addr not in details and "grpc:" not in details, details


# --------------------------------------------------------------------------- cancels are not drafter failures


def test_client_cancels_and_deadlines_are_not_drafter_failures(servers):
    """40 cancels and deadlines against a healthy drafter counted 23 AR fallbacks and logged 'drafter failed'."""
    orch = servers["orchestrator"]
    port = orch.info["metrics_port"]
    before = ar_fallbacks(port)
    stub = generation_stub(orch.addr)
    for i in range(10):
        call = stub.Generate(request(PROMPT, max_tokens=3000, block_size=4), timeout=60)
        for _ in range(1 + i % 4):  # cancelled after 1 to 4 chunks: at different points of the run
            next(call)
        call.cancel()
    for i in range(10):
        with pytest.raises(grpc.RpcError) as err:
            generate(orch.addr, request(PROMPT, max_tokens=3000, block_size=4), timeout=0.3 + 0.05 * i)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: _running(port) == 0, what="every run ended (a fallback is counted as its run ends)")
    assert ar_fallbacks(port) == before
    assert "drafter failed" not in orch.log() and "AR fallback" not in orch.log()
    ids, _, complete, _ = generate(orch.addr, request(PROMPT, max_tokens=12))
    assert len(ids) == 12 and not complete.stats.drafter_fallback
