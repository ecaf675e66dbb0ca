"""Split (verifier + drafter + orchestrator processes) vs colocated vs mlx-lm greedy AR, and the API's edges.

Five real servers for the whole module: a verifier (session limit 3), a
drafter, a split orchestrator reaching both over gRPC, a split orchestrator
reaching the verifier with its drafter in-process (torch, beside the MLX
verifier: ``split_here``), and a colocated orchestrator holding the same tiny
pair in-process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kakeya.wire import codec
from kakeya.wire.kakeya.v1 import cache_pb2, drafter_pb2, generate_pb2, sampling_pb2, verifier_pb2

from .conftest import (
    ROOT,
    TINY,
    TINY_MLX,
    channel,
    drafter_info,
    drafter_stub,
    generate,
    generation_stub,
    request,
    scrape,
    sessions_freed,
    start_all,
    verifier_info,
    verifier_stub,
    wait_until,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # real processes: bounded, never hanging

PROMPT = [2, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60]
LONG = 300  # the tiny target's sliding window is 32: the ring wraps 9+ times
MAX_SESSIONS = 3
LIMIT = 2000  # --max-tokens-limit of the orchestrators


@pytest.fixture(scope="module")
def servers(server_factory):
    # --reclaim-idle 0: the session-limit test holds idle sessions and expects the limit to refuse
    verifier = server_factory(
        "verifier", ["verifier", *TINY_MLX, "--max-sessions", str(MAX_SESSIONS), "--reclaim-idle", "0", "--grace", "5"]
    )
    drafter = server_factory("drafter", ["drafter", *TINY_MLX, "--grace", "5"])
    colocated = server_factory(
        "colocated", ["orchestrator", *TINY_MLX, "--max-tokens-limit", str(LIMIT), "--grace", "5"]
    )
    start_all([verifier, drafter, colocated])
    split = server_factory(
        "split",
        [
            "orchestrator",
            "--verifier",
            verifier.addr,
            "--drafter",
            drafter.addr,
            "--max-tokens-limit",
            str(LIMIT),
            "--grace",
            "5",
        ],
    )
    here = ["orchestrator", "--verifier", verifier.addr, *TINY, "--backend", "torch", "--grace", "5"]
    split_here = server_factory("split_here", [*here, "--max-tokens-limit", str(LIMIT)])
    start_all([split, split_here])
    return {"verifier": verifier, "drafter": drafter, "split": split, "split_here": split_here, "colocated": colocated}


@pytest.fixture(scope="module")
def reference(mlx_target):
    from kakeya.verifier.mlx_backend.reference import greedy_reference

    ids, _, _ = greedy_reference(mlx_target.model, PROMPT, LONG)
    return ids


def test_every_server_is_serving_with_health_and_reflection(servers):
    for name, s in servers.items():
        ch = channel(s.addr)
        health = health_pb2_grpc.HealthStub(ch)
        assert (
            health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
            == health_pb2.HealthCheckResponse.SERVING
        ), name
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        resp = next(
            refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        )
        names = {x.name for x in resp.list_services_response.service}
        assert "grpc.health.v1.Health" in names, name
        want = {"verifier": "kakeya.v1.VerifierService", "drafter": "kakeya.v1.DrafterService"}.get(
            name, "kakeya.v1.Generation"
        )
        assert want in names, (name, names)
        assert (
            health.Check(health_pb2.HealthCheckRequest(service=want), timeout=5).status
            == health_pb2.HealthCheckResponse.SERVING
        )


def test_auto_block_size_is_lossless_split_and_colocated(servers, reference):
    """block_size 0: each block sized from the measured cost curve and the acceptance seen so far."""
    for name in ("split", "split_here", "colocated"):
        ids, _, complete, _ = generate(
            servers[name].addr, request(PROMPT, max_tokens=LONG, ignore_eos=True, block_size=0)
        )
        st = complete.stats
        assert ids == reference, name
        assert st.block_size == 0 and sum(st.acceptance_lengths) == LONG - 1 and not st.drafter_fallback


def test_split_equals_colocated_equals_mlx_lm_greedy_ar_past_ring_wraps(servers, reference):
    assert len(set(reference)) > 50, "degenerate reference: the comparison would prove little"
    results = {}
    for name in ("split", "split_here", "colocated"):
        ids, _, complete, chunks = generate(servers[name].addr, request(PROMPT, max_tokens=LONG, ignore_eos=True))
        st = complete.stats
        assert complete.finish_reason == generate_pb2.FINISH_REASON_LENGTH
        assert complete.completion_tokens == LONG and complete.prompt_tokens == len(PROMPT)
        assert list(complete.prompt_token_ids) == PROMPT
        assert sum(st.acceptance_lengths) == LONG - 1 and st.block_size == 8 and not st.drafter_fallback
        assert chunks == len(st.acceptance_lengths) + 1  # one chunk per committed block
        assert st.verifier_kv_bytes_sliding > 0 and st.verifier_kv_bytes_full > 0 and not st.degenerate
        results[name] = ids
    assert results["split"] == reference
    assert results["split_here"] == reference  # the drafter in the orchestrator's process: one round trip a block
    assert results["colocated"] == reference


def test_bounded_quantized_policy_crosses_the_wire_intact(servers, mlx_target, aux_layers):
    """sink-window + 8-bit full layers, asked for over the public API: every field reaches the verifier."""
    from kakeya.core.request import CachePolicy
    from kakeya.orchestrator.decode.loop import run
    from kakeya.verifier.session import LocalVerifierSession

    wire = _policy(kind=cache_pb2.CACHE_KIND_SINK_WINDOW, sink=4, window=16, full_kv_bits=8)
    local = CachePolicy("sink-window", sink=4, window=16, full_kv_bits=8)
    expected = run(LocalVerifierSession(mlx_target, aux_layers, local), None, PROMPT, 150, 1).token_ids
    for name in ("split", "colocated"):
        req = request(PROMPT, max_tokens=150, ignore_eos=True)
        req.cache_policy.CopyFrom(wire)
        ids, _, complete, _ = generate(servers[name].addr, req)
        assert complete.stats.cache_policy == local.label, name
        assert ids == expected, name


def test_client_cli_prints_the_same_json_as_generate(servers, capsys):
    from kakeya.app.main import main

    args = ["--json", "--max-tokens", "24", "--block-size", "4", "--prompt", "def f(x):"]
    # the servers run the tiny pair on MLX (TINY_MLX); `generate` with no flags would use the demo pair
    from kakeya.checkpoints.tiny import default_pair

    tiny = ["--target", str(default_pair().target), "--draft", str(default_pair().draft), "--backend", "mlx"]
    assert main(["generate", *tiny, *args]) == 0
    local = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    res = subprocess.run(
        [sys.executable, "-m", "kakeya.app.main", "client", "--addr", servers["split"].addr, "generate", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    remote = json.loads(res.stdout.strip().splitlines()[-1])
    assert remote.keys() == local.keys()
    for key in ("target", "draft"):  # the server names its checkpoints, `generate` shows the paths it was given
        assert remote[key] == Path(local[key]).name, key
    for key in ("prompt_token_ids", "token_ids", "text", "finish_reason", "block_size",
                "acceptance_lengths", "verifier_kv_bytes", "cache_policy", "quality", "drafter_fallback"):  # fmt: skip
        assert remote[key] == local[key], key
    assert remote["backend"] == "grpc" and local["backend"] == "mlx"  # a public caller never sees the address


def test_stop_strings_and_stop_token_ids(servers):
    addr = servers["split"].addr
    full_ids, full_text, _, _ = generate(addr, request(text="def fibonacci(n):", max_tokens=60))
    # a stop string from the middle of the output (not at its very start)
    clean = full_text.replace("\ufffd", "")
    stop = next(
        clean[i : i + 3]
        for i in range(10, len(clean) - 3)
        if "\ufffd" not in clean[i : i + 3] and clean[i : i + 3].strip()
    )
    cut = full_text.index(stop)
    ids, text, complete, _ = generate(addr, request(text="def fibonacci(n):", max_tokens=60, stop=[stop]))
    assert text == full_text[:cut] and stop not in text
    assert complete.finish_reason == generate_pb2.FINISH_REASON_STOP
    assert ids == full_ids[: len(ids)] and 0 < len(ids) < len(full_ids)
    # stop token ids: generation ends on (and includes) the first one
    stop_tok = full_ids[20]
    ids, _, complete, _ = generate(addr, request(text="def fibonacci(n):", max_tokens=60, stop_token_ids=[stop_tok]))
    assert ids == full_ids[: full_ids.index(stop_tok) + 1]
    assert complete.finish_reason == generate_pb2.FINISH_REASON_STOP


def test_model_and_server_info(servers):
    stub = generation_stub(servers["split"].addr)
    m = stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=5)
    assert m.vocab_size == 1024 and m.default_block_size == 8 and m.max_tokens_limit == LIMIT and m.has_tokenizer
    assert (m.target_model, m.draft_model) == ("target", "draft")  # the checkpoints' names, never the server's paths
    s = stub.GetServerInfo(generate_pb2.GetServerInfoRequest(), timeout=5)
    assert s.deployment == "split" and s.verifier_backend == "grpc"  # never the verifier's address
    c = generation_stub(servers["colocated"].addr).GetServerInfo(generate_pb2.GetServerInfoRequest(), timeout=5)
    assert c.deployment == "colocated" and c.verifier_backend == "mlx"


def test_cancelled_stream_frees_verifier_and_drafter_sessions(servers):
    v, d = servers["verifier"].addr, servers["drafter"].addr
    wait_until(lambda: sessions_freed(v, d), what="idle backends")
    call = generation_stub(servers["split"].addr).Generate(request(PROMPT, max_tokens=LIMIT, block_size=4), timeout=120)
    for _ in range(3):
        assert next(call).HasField("chunk")
    vi, di = verifier_info(v), drafter_info(d)
    assert vi.live_sessions == 1 and vi.live_kv_bytes > 0
    assert di.live_sessions == 1 and di.live_kv_bytes > 0
    call.cancel()
    wait_until(lambda: sessions_freed(v, d), what="sessions freed after cancel")


def test_deadline_propagates_to_the_backends(servers):
    v, d = servers["verifier"].addr, servers["drafter"].addr
    call = generation_stub(servers["split"].addr).Generate(request(PROMPT, max_tokens=LIMIT, block_size=4), timeout=1.5)
    with pytest.raises(grpc.RpcError) as err:
        for _ in call:
            pass
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: sessions_freed(v, d), what="sessions freed after the deadline")


# --------------------------------------------------------------------------- bad requests


def _policy(**kw):
    return cache_pb2.CachePolicy(**kw)


BAD_GENERATE = [
    ("no prompt", request(), "prompt"),
    ("empty text", request(text=""), "prompt.text"),
    ("empty ids", request(ids=[]), "prompt.tokenized.ids"),
    ("id = vocab", request(ids=[2, 1024]), "prompt.tokenized.ids"),
    ("negative id", request(ids=[2, -1]), "prompt.tokenized.ids"),
    ("max_tokens < 0", request(PROMPT, max_tokens=-1), "sampling_params.max_tokens"),
    ("max_tokens > limit", request(PROMPT, max_tokens=LIMIT + 1), "sampling_params.max_tokens"),
    ("block size 17", request(PROMPT, block_size=17), "block_size"),
    ("block size -1", request(PROMPT, block_size=-1), "block_size"),
    ("negative temperature", request(PROMPT, temperature=-0.5), "sampling_params.temperature"),
    ("nan temperature", request(PROMPT, temperature=float("nan")), "sampling_params.temperature"),
    ("temperature 1e-39", request(PROMPT, temperature=1e-39), "sampling_params.temperature"),
    ("unknown sampling rule", request(PROMPT, temperature=1.0, rule=9), "sampling_params.rule"),
    ("top_k < 0", request(PROMPT, temperature=1.0, top_k=-5), "sampling_params.top_k"),
    ("top_p > 1", request(PROMPT, temperature=1.0, top_p=1.5), "sampling_params.top_p"),
    ("min_p > 1", request(PROMPT, temperature=1.0, min_p=2.0), "sampling_params.min_p"),
    ("stop id outside vocab", request(PROMPT, stop_token_ids=[5000]), "sampling_params.stop_token_ids"),
    ("empty stop string", request(PROMPT, stop=[""]), "sampling_params.stop"),
]


def _with_policy(**kw):
    r = request(PROMPT)
    r.cache_policy.CopyFrom(_policy(**kw))
    return r


BAD_GENERATE += [
    ("restore without a kind", _with_policy(restore_path="/x"), "cache_policy.kind"),
    (
        "restore with native",
        _with_policy(kind=cache_pb2.CACHE_KIND_NATIVE, restore_path="/x"),
        "cache_policy.restore_path: needs kind",
    ),
    ("slack < block", _with_policy(kind=cache_pb2.CACHE_KIND_SINK_WINDOW, slack=4), "cache_policy.slack"),
    ("unknown cache kind", _with_policy(kind=7), "cache_policy.kind"),
]


def _good(servers):
    ids, _, complete, _ = generate(servers["split"].addr, request(PROMPT, max_tokens=12))
    assert len(ids) == 12 and complete.finish_reason == generate_pb2.FINISH_REASON_LENGTH


@pytest.mark.parametrize("deployment", ["split", "colocated"])
@pytest.mark.parametrize("case", BAD_GENERATE, ids=[c[0] for c in BAD_GENERATE])
def test_bad_generate_request_then_a_good_one(servers, case, deployment):
    _, req, field = case
    with pytest.raises(grpc.RpcError) as err:
        generate(servers[deployment].addr, req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()
    _good(servers)


def _aux(rows=3, width=128, dtype=np.float32):
    return codec.to_proto(np.zeros((rows, width), dtype=dtype))


V = verifier_pb2.VerifierRequest
D = drafter_pb2.DrafterRequest
OPEN_V = V(open=V.Open())
OPEN_D = D(open=D.Open())
_corrupt = _aux()
_corrupt.data = _corrupt.data[:-4]

BAD_VERIFIER = [
    ("first not open", [V(prefill=V.Prefill(token_ids=[2]))], grpc.StatusCode.FAILED_PRECONDITION, "open"),
    (
        "prefill id outside vocab",
        [OPEN_V, V(prefill=V.Prefill(token_ids=[2, 4096]))],
        grpc.StatusCode.INVALID_ARGUMENT,
        "prefill.token_ids",
    ),
    ("empty prefill", [OPEN_V, V(prefill=V.Prefill())], grpc.StatusCode.INVALID_ARGUMENT, "prefill.token_ids"),
    (
        "verify before prefill",
        [OPEN_V, V(verify=V.Verify(block_ids=[2]))],
        grpc.StatusCode.FAILED_PRECONDITION,
        "prefill",
    ),
    (
        "block too long",
        [OPEN_V, V(prefill=V.Prefill(token_ids=[2])), V(verify=V.Verify(block_ids=[3] * 17))],
        grpc.StatusCode.INVALID_ARGUMENT,
        "verify.block_ids",
    ),
    (
        "verify id outside vocab",
        [OPEN_V, V(prefill=V.Prefill(token_ids=[2])), V(verify=V.Verify(block_ids=[3, 4096]))],
        grpc.StatusCode.INVALID_ARGUMENT,
        "verify.block_ids",
    ),
    (
        "aux layer out of range",
        [V(open=V.Open(target_layer_ids=[1, 9]))],
        grpc.StatusCode.INVALID_ARGUMENT,
        "open.target_layer_ids",
    ),
    (
        "quantised kv bits 3",
        [V(open=V.Open(cache_policy=_policy(full_kv_bits=3)))],
        grpc.StatusCode.INVALID_ARGUMENT,
        "open.cache_policy",
    ),
]
_DRAFT = D(draft=D.Draft(new_aux=_aux(), last_token=2, block_size=4))  # a first draft, bringing the prompt's aux

BAD_DRAFTER = [
    ("first not open", [D(draft=D.Draft(new_aux=_aux(), last_token=2))], grpc.StatusCode.FAILED_PRECONDITION, "open"),
    ("int32 aux", [OPEN_D, D(draft=D.Draft(new_aux=_aux(dtype=np.int32), last_token=2))], grpc.StatusCode.INVALID_ARGUMENT, "draft.new_aux"),
    ("aux wrong width", [OPEN_D, D(draft=D.Draft(new_aux=_aux(width=100), last_token=2))], grpc.StatusCode.INVALID_ARGUMENT, "draft.new_aux"),
    ("aux 3-d", [OPEN_D, D(draft=D.Draft(new_aux=codec.to_proto(np.zeros((1, 3, 128), np.float32)), last_token=2))], grpc.StatusCode.INVALID_ARGUMENT, "draft.new_aux"),
    ("aux bytes short", [OPEN_D, D(draft=D.Draft(new_aux=_corrupt, last_token=2))], grpc.StatusCode.INVALID_ARGUMENT, "draft.new_aux"),
    ("empty first aux", [OPEN_D, D(draft=D.Draft(new_aux=_aux(rows=0), last_token=2))], grpc.StatusCode.INVALID_ARGUMENT, "draft.new_aux"),
    ("last token outside vocab", [OPEN_D, D(draft=D.Draft(new_aux=_aux(), last_token=1024))], grpc.StatusCode.INVALID_ARGUMENT, "draft.last_token"),
    ("block size 100", [OPEN_D, D(draft=D.Draft(new_aux=_aux(), last_token=2, block_size=100))], grpc.StatusCode.INVALID_ARGUMENT, "draft.block_size"),
    ("predraft first", [OPEN_D, D(predraft=D.Predraft(new_aux=_aux(), block_ids=[2, 3], block_size=4))], grpc.StatusCode.FAILED_PRECONDITION, "predraft"),
    ("predraft id outside vocab", [OPEN_D, _DRAFT, D(predraft=D.Predraft(block_ids=[1024], block_size=4))], grpc.StatusCode.INVALID_ARGUMENT, "predraft.block_ids"),
    ("predraft aux wrong width", [OPEN_D, _DRAFT, D(predraft=D.Predraft(new_aux=_aux(width=100), block_ids=[2, 3], block_size=4))], grpc.StatusCode.INVALID_ARGUMENT, "predraft.new_aux"),
]  # fmt: skip


def _session(stub, msgs):
    """Send ``msgs`` on one Session stream; return the responses (the RpcError propagates)."""
    return list(stub.Session(iter(msgs), timeout=30))


@pytest.mark.parametrize("case", BAD_VERIFIER, ids=[c[0] for c in BAD_VERIFIER])
def test_bad_verifier_stream_then_a_good_request(servers, case):
    _, msgs, code, field = case
    with pytest.raises(grpc.RpcError) as err:
        _session(verifier_stub(servers["verifier"].addr), msgs)
    assert err.value.code() == code and field in err.value.details(), err.value.details()
    _good(servers)


@pytest.mark.parametrize("case", BAD_DRAFTER, ids=[c[0] for c in BAD_DRAFTER])
def test_bad_drafter_stream_then_a_good_request(servers, case):
    _, msgs, code, field = case
    with pytest.raises(grpc.RpcError) as err:
        _session(drafter_stub(servers["drafter"].addr), msgs)
    assert err.value.code() == code and field in err.value.details(), err.value.details()
    _good(servers)


def test_a_good_raw_verifier_session(servers):
    out = _session(
        verifier_stub(servers["verifier"].addr),
        [OPEN_V, V(prefill=V.Prefill(token_ids=PROMPT)), V(verify=V.Verify(block_ids=[5, 6, 7])), V(close=V.Close())],
    )  # fmt: skip
    assert [r.WhichOneof("response") for r in out] == ["opened", "prefilled", "verified", "closed"]
    aux = codec.from_proto(out[1].prefilled.aux)
    assert aux.shape == (len(PROMPT), 128) and aux.dtype == np.float32  # the model's dtype, 2 aux layers x 64
    verified = out[2].verified  # one step: verified and committed
    assert 0 <= verified.accepted <= 2 and 0 <= verified.next_token < 1024
    assert codec.from_proto(verified.aux).shape == (verified.accepted + 1, 128)
    assert verified.stats.positions == out[3].closed.stats.positions == len(PROMPT) + verified.accepted + 1


def test_a_deprecated_predraft_only_extends_the_context_and_answers_no_block(servers):
    """An older orchestrator's Predraft (pre-drafting was removed): the server takes its new aux, so the client's
    fresh draft has no gap in its context, and answers with no block (a miss)."""
    out = _session(
        drafter_stub(servers["drafter"].addr),
        [OPEN_D, _DRAFT, D(predraft=D.Predraft(block_ids=[2, 3, 4, 5], block_size=4)),
         D(predraft=D.Predraft(new_aux=_aux(rows=4), block_ids=[6, 7], block_size=8)), D(close=D.Close())],
    )  # fmt: skip
    assert [r.WhichOneof("response") for r in out] == ["opened", "drafted", "predrafted", "predrafted", "closed"]
    assert not any(r.predrafted.token_ids or r.predrafted.outcomes for r in out[2:4])
    assert out[3].predrafted.stats.context_positions == out[4].closed.stats.context_positions == 3 + 4


def test_session_limit_is_resource_exhausted_then_recovers(servers):
    v, d = servers["verifier"].addr, servers["drafter"].addr
    wait_until(lambda: sessions_freed(v, d), what="idle backends")
    stub = verifier_stub(v)
    release = threading.Event()

    def held():  # an open session that sends nothing more until released
        yield OPEN_V
        yield V(prefill=V.Prefill(token_ids=PROMPT))
        release.wait(60)

    holders = []
    for _ in range(MAX_SESSIONS):
        call = stub.Session(held(), timeout=60)
        assert next(call).HasField("opened")
        holders.append(call)
    wait_until(lambda: verifier_info(v).live_sessions == MAX_SESSIONS, what="sessions held")
    with pytest.raises(grpc.RpcError) as err:
        generate(servers["split"].addr, request(PROMPT, max_tokens=8))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "session limit" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        _session(stub, [OPEN_V])
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    release.set()
    for call in holders:
        call.cancel()
    wait_until(lambda: sessions_freed(v, d), what="sessions freed")
    _good(servers)


def test_client_cli_reports_status_and_exits_non_zero(servers):
    def client(*args):
        return subprocess.run(
            [sys.executable, "-m", "kakeya.app.main", "client", *args],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    res = client("--addr", servers["split"].addr, "generate", "--prompt", "")
    assert res.returncode == 1 and "INVALID_ARGUMENT" in res.stderr and "prompt.text" in res.stderr
    # sampling flags are checked before sending, as `kakeya generate` checks them: exit 2 naming the flag
    res = client("--addr", servers["split"].addr, "generate", "--prompt", "x", "--top-p", "1.5")
    assert res.returncode == 2 and "--top-p: must be in (0, 1]" in res.stderr
    res = client("--addr", servers["split"].addr, "generate", "--prompt", "x", "--temperature", "1e-39")
    assert res.returncode == 2 and "--temperature: must be 0 (greedy) or at least" in res.stderr
    res = client("--addr", "127.0.0.1:1", "--timeout", "5", "generate", "--prompt", "x")
    assert res.returncode == 1 and "UNAVAILABLE" in res.stderr
    res = client("--addr", servers["split"].addr, "health")
    assert res.returncode == 0 and res.stdout.strip() == "SERVING"


def test_concurrent_streams_are_isolated_sessions(servers, reference):
    """Three generations at once on each deployment, different block sizes: each equals greedy AR."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = [(name, b) for name in ("split", "colocated") for b in (1, 4, 8)]
    with ThreadPoolExecutor(len(jobs)) as ex:
        outs = list(
            ex.map(lambda j: generate(servers[j[0]].addr, request(PROMPT, max_tokens=80, block_size=j[1]))[0], jobs)
        )
    for job, ids in zip(jobs, outs):
        assert ids == reference[:80], job


def test_orchestrator_request_limit_is_resource_exhausted(servers, server_factory):
    v, d = servers["verifier"].addr, servers["drafter"].addr
    orch = server_factory("limited", ["orchestrator", "--verifier", v, "--drafter", d, "--max-sessions", "1"])
    start_all([orch])
    first = generation_stub(orch.addr).Generate(request(PROMPT, max_tokens=LIMIT, block_size=4), timeout=120)
    assert next(first).HasField("chunk")
    with pytest.raises(grpc.RpcError) as err:
        generate(orch.addr, request(PROMPT, max_tokens=4))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-sessions" in err.value.details()
    first.cancel()
    ids = wait_until(lambda: _try_generate(orch.addr), what="the slot to be free again")
    assert len(ids) == 4


def _try_generate(addr):
    try:
        return generate(addr, request(PROMPT, max_tokens=4))[0]
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        return None


def test_sampling_is_seeded_reproducible_and_reports_its_seed(servers):
    """Same seed -> same tokens, split and colocated alike; an unseeded request reports the seed it drew."""
    seeded = request(PROMPT, max_tokens=40, block_size=8, temperature=0.8, top_k=50, top_p=0.95, min_p=0.01, seed=77)
    split_ids, _, complete, _ = generate(servers["split"].addr, seeded)
    assert complete.HasField("seed") and complete.seed == 77 and len(split_ids) == 40
    assert generate(servers["split"].addr, seeded)[0] == split_ids
    assert generate(servers["colocated"].addr, seeded)[0] == split_ids
    unseeded = request(PROMPT, max_tokens=20, block_size=4, temperature=1.0)
    ids, _, complete, _ = generate(servers["split"].addr, unseeded)
    assert complete.HasField("seed")
    unseeded.sampling_params.seed = complete.seed
    assert generate(servers["colocated"].addr, unseeded)[0] == ids
    greedy = generate(servers["split"].addr, request(PROMPT, max_tokens=8))[2]
    assert not greedy.HasField("seed") and greedy.sampling_rule == sampling_pb2.SAMPLING_RULE_UNSPECIFIED


def test_seeded_coupled_sampling_is_ar_sampling_at_any_block_size_split_and_colocated(servers):
    """The default rule: auto, fixed sizes and AR (block 1), split and colocated, one set of tokens."""
    params = dict(max_tokens=60, temperature=0.8, top_p=0.95, seed=42)
    want, _, complete, _ = generate(servers["colocated"].addr, request(PROMPT, block_size=1, **params))
    assert complete.sampling_rule == sampling_pb2.SAMPLING_RULE_COUPLED and len(want) == 60
    for name in ("split", "colocated"):
        for block_size in (0, 2, 8, 16):
            ids, _, complete, _ = generate(servers[name].addr, request(PROMPT, block_size=block_size, **params))
            assert ids == want, (name, block_size)
            assert (
                complete.stats.block_size == block_size and complete.sampling_rule == sampling_pb2.SAMPLING_RULE_COUPLED
            )


def test_a_rejection_rule_request_for_auto_runs_at_the_trained_block_size(servers):
    req = request(
        PROMPT, block_size=0, max_tokens=30, temperature=0.8, seed=5, rule=sampling_pb2.SAMPLING_RULE_REJECTION
    )
    ids, _, complete, _ = generate(servers["split"].addr, req)
    assert complete.sampling_rule == sampling_pb2.SAMPLING_RULE_REJECTION
    assert complete.stats.block_size == 8  # the tiny drafter's trained size, not one that timings pick
    req.block_size = 8
    assert generate(servers["colocated"].addr, req)[0] == ids


def test_client_block_size_0_is_auto_and_sampled_text_equals_the_local_generates(servers):
    """`kakeya client generate --block-size 0` is auto, as everywhere; with a seed it prints what
    `kakeya generate` prints for the same pair, whatever block size either ran."""
    from kakeya.checkpoints.tiny import default_pair

    args = ["--json", "--max-tokens", "40", "--prompt", "x =", "--temperature", "0.8", "--seed", "42"]
    tiny = ["--target", str(default_pair().target), "--draft", str(default_pair().draft), "--backend", "mlx"]
    local = subprocess.run(
        [sys.executable, "-m", "kakeya.app.main", "generate", *tiny, *args, "--block-size", "3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert local.returncode == 0, local.stderr
    remote = subprocess.run(
        [sys.executable, "-m", "kakeya.app.main", "client", "--addr", servers["split"].addr, "generate", *args, "--block-size", "0"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert remote.returncode == 0, remote.stderr
    local, remote = (json.loads(r.stdout.strip().splitlines()[-1]) for r in (local, remote))
    assert remote["block_size"] == 0 and local["block_size"] == 3
    assert remote["token_ids"] == local["token_ids"] and remote["seed"] == local["seed"] == 42
    assert remote["sampling"] == local["sampling"] and remote["sampling"]["rule"] == "coupled"


def test_verifier_replicas_of_different_models_are_refused_at_start_up(servers, server_factory):
    """A --verifier list whose replicas run different checkpoints (a pod spec edited by hand, a rollout to another
    model half done): the orchestrator used to check one replica, go SERVING, then fail every session that opened
    on the other one INTERNAL (or, were the shapes equal, answer from another model)."""
    other = server_factory("demo_verifier", ["verifier", "--backend", "torch", "--device", "cpu"])
    start_all([other])
    mixed = f"ipv4:{servers['verifier'].addr},{other.addr}"
    argv = ["orchestrator", "--verifier", mixed, "--drafter", servers["drafter"].addr, "--backend-wait", "10"]
    orchestrator = server_factory("mixed", argv).start()
    assert orchestrator.wait(60) != 0
    (error,) = [line for line in orchestrator.log().splitlines() if "kakeya: error" in line]
    assert "--verifier" in error and "different models" in error


def test_a_verifier_replica_of_another_model_is_refused_and_its_session_moves(servers, server_factory):
    """A --verifier pool whose replica comes back serving another checkpoint after start-up (a rollout half done; a
    DNS name's new pod alike): each session that opens on it is refused -- the orchestrator's log says so, naming
    the pool and the model, and kakeya_takeovers_total counts the move -- and moves to a replica of the right model;
    no request is served by the other one."""
    replica = server_factory("replica", ["verifier", *TINY_MLX, "--grace", "1"])
    start_all([replica])
    pool = f"ipv4:{servers['verifier'].addr},{replica.addr}"
    argv = ["orchestrator", "--verifier", pool, "--drafter", servers["drafter"].addr, "--metrics-port", "0"]
    orchestrator = server_factory("pool", argv)
    start_all([orchestrator])
    want = generate(orchestrator.addr, request(PROMPT, max_tokens=12, block_size=4))[0]
    replica.stop()
    other = server_factory("replica_demo", ["verifier", "--backend", "torch", "--device", "cpu"], port=replica.port)
    start_all([other])

    def refused() -> bool:  # round robin reaches the new replica within a few sessions
        assert generate(orchestrator.addr, request(PROMPT, max_tokens=12, block_size=4))[0] == want
        return "serves another model" in orchestrator.log_file.read_text(errors="replace")

    wait_until(refused, what="a session refused by the other model's replica")
    line = next(x for x in orchestrator.log_file.read_text().splitlines() if "serves another model" in x)
    assert pool in line and "demo" in line, line
    moved = scrape(orchestrator.info["metrics_port"]).get(("kakeya_takeovers_total", (("role", "verifier"),)), 0)
    assert moved >= 1


def test_split_engine_asks_each_listed_verifier_replica_once(servers, monkeypatch):
    from kakeya.orchestrator.assembly import split_engine
    from kakeya.orchestrator.remote import streams

    asked, fetch_info = [], streams.fetch_info
    monkeypatch.setattr(streams, "fetch_info", lambda *a: asked.append(a[1]) or fetch_info(*a))
    engine = split_engine(f"ipv4:{servers['verifier'].addr}", None, None, 10)
    engine.verifier.close()
    assert len(asked) == 1, asked
