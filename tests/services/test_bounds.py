"""Every client-controlled size and string is bounded, on real servers (issue #14's red-team findings).

A verifier (``--max-context 512``, one restoration source ``tiny``), a drafter
(``--max-context 512``) and a split orchestrator (``--max-prompt-tokens 64``).
Each bad request ends at once with INVALID_ARGUMENT (or RESOURCE_EXHAUSTED for
an oversized message) naming the field, and the servers keep serving.
"""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

from kakeya.wire import codec
from kakeya.wire.kakeya.v1 import cache_pb2, drafter_pb2, generate_pb2, verifier_pb2

from .conftest import (
    TINY_MLX,
    ar_fallbacks,
    channel,
    drafter_stub,
    generate,
    generation_stub,
    request,
    start_all,
    verifier_info,
    verifier_stub,
    wait_until,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPT = [2, 40, 41, 42, 43, 44, 45, 46]
MAX_CONTEXT = 512
MAX_PROMPT = 64
# The tiny drafter: 2 full-attention layers, 2 K/V heads of 16 float32: 256 bytes a row a layer. A context
# cache grows in steps of 256 rows (doubling), so a session of up to 240 positions takes 2 x 256 x 256 bytes:
# two such sessions fit this budget, a third or a longer one does not.
DRAFTER_BUDGET = 300_000


@pytest.fixture(scope="module")
def ftheta_dir(tmp_path_factory, tiny_pair, mlx_target):
    from kakeya.drafter.mlx_backend.model import load_dflash_mlx
    from kakeya.verifier.mlx_backend.ftheta import Restorer

    draft = load_dflash_mlx(tiny_pair.draft, tiny_pair.target)
    out = tmp_path_factory.mktemp("ftheta")
    Restorer.init(mlx_target, draft, rank=16, draft_dir=tiny_pair.draft, target_dir=tiny_pair.target, seed=1).save(out)
    return out


@pytest.fixture(scope="module")
def servers(server_factory, ftheta_dir):
    v = server_factory(
        "verifier",
        ["verifier", *TINY_MLX, "--max-context", str(MAX_CONTEXT), "--restore", f"tiny={ftheta_dir}", "--grace", "2"],
    )
    d = server_factory("drafter", ["drafter", *TINY_MLX, "--max-context", str(MAX_CONTEXT), "--grace", "2"])
    budgeted = server_factory(
        "budgeted", ["drafter", *TINY_MLX, "--max-kv-bytes", str(DRAFTER_BUDGET), "--reclaim-idle", "0", "--grace", "2"]
    )
    start_all([v, d, budgeted])
    o = server_factory(
        "orchestrator",
        [
            "orchestrator",
            "--verifier",
            v.addr,
            "--drafter",
            d.addr,
            "--max-prompt-tokens",
            str(MAX_PROMPT),
            "--grace",
            "2",
        ],
    )
    start_all([o])
    return {"verifier": v, "drafter": d, "orchestrator": o, "budgeted": budgeted}


def _code(fn):
    """(status code, details, seconds) of a call that must fail."""
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value.code(), err.value.details(), time.monotonic() - t0


def _still_serves(servers):
    ids, _, complete, _ = generate(servers["orchestrator"].addr, request(PROMPT, max_tokens=6))
    assert len(ids) == 6 and complete.finish_reason == generate_pb2.FINISH_REASON_LENGTH


def _with_policy(**policy):
    req = request(PROMPT, max_tokens=6)
    req.cache_policy.CopyFrom(cache_pb2.CachePolicy(**policy))
    return req


@pytest.mark.parametrize(
    "policy, field",
    [
        (dict(kind=cache_pb2.CACHE_KIND_SINK_WINDOW, window=2**31 - 1), "cache_policy.window"),
        (dict(kind=cache_pb2.CACHE_KIND_SINK_WINDOW, window=8, sink=2**31 - 1), "cache_policy.sink"),
    ],
)
def test_huge_cache_policy_sizes_are_refused_at_once(servers, policy, field):
    code, details, seconds = _code(lambda: generate(servers["orchestrator"].addr, _with_policy(**policy)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and field in details and seconds < 2
    # the verifier refuses it on its own too (a client may reach it directly)
    open_ = verifier_pb2.VerifierRequest.Open(cache_policy=cache_pb2.CachePolicy(**policy))
    call = verifier_stub(servers["verifier"].addr).Session(iter([verifier_pb2.VerifierRequest(open=open_)]), timeout=10)
    code, details, seconds = _code(lambda: list(call))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "open." + field in details and seconds < 2
    _still_serves(servers)


def test_prompt_length_and_context_limits(servers):
    addr = servers["orchestrator"].addr
    code, details, _ = _code(lambda: generate(addr, request([5] * (MAX_PROMPT + 1), max_tokens=4)))
    assert (
        code == grpc.StatusCode.INVALID_ARGUMENT
        and "prompt.tokenized.ids" in details
        and "--max-prompt-tokens" in details
    )
    info = generation_stub(addr).GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=10)
    assert info.max_prompt_tokens == MAX_PROMPT
    # prompt + max_tokens beyond the verifier's context: refused before any session opens
    code, details, _ = _code(lambda: generate(addr, request(PROMPT, max_tokens=MAX_CONTEXT)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in details
    ids, _, _, _ = generate(addr, request(PROMPT, max_tokens=MAX_CONTEXT - len(PROMPT)), timeout=200)
    assert len(ids) == MAX_CONTEXT - len(PROMPT)


def test_model_info_says_how_many_positions_a_request_may_fill(servers):
    """``ModelInfo.max_position_embeddings`` is what prompt + max_tokens must fit in (generate.proto): a client
    that sizes its request by it is never refused for the context. The verifier's --max-context is that limit
    here, not the model's own 131072 positions."""
    addr = servers["orchestrator"].addr
    info = generation_stub(addr).GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=10)
    assert info.max_position_embeddings == MAX_CONTEXT and info.max_prompt_tokens <= info.max_position_embeddings
    over = request(PROMPT, max_tokens=info.max_position_embeddings - len(PROMPT) + 1)
    code, details, _ = _code(lambda: generate(addr, over))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and f"exceed the context limit {MAX_CONTEXT}" in details


def test_a_drafter_whose_context_is_full_has_not_failed(servers, server_factory):
    """A drafter's --max-context below the verifier's: a request that outgrows it finishes with the verifier alone
    (the same tokens), but the drafter did not fail, it is full: it is not reported failing nor backed off for the
    other requests (the orchestrator logged "drafter ... failed", GetServerInfo said 1 failure, "retrying")."""
    short = server_factory("short-drafter", ["drafter", *TINY_MLX, "--max-context", "64", "--grace", "2"])
    start_all([short])
    orch = server_factory(
        "short-orch",
        ["orchestrator", "--verifier", servers["verifier"].addr, "--drafter", short.addr, "--metrics-port", "0"],
    )
    start_all([orch])
    ids, _, complete, _ = generate(orch.addr, request(PROMPT, max_tokens=100))
    assert ids == generate(servers["orchestrator"].addr, request(PROMPT, max_tokens=100))[0]
    assert complete.stats.drafter_fallback  # past the drafter's 64 positions the verifier went on alone
    info = generation_stub(orch.addr).GetServerInfo(generate_pb2.GetServerInfoRequest(), timeout=10)
    assert dict(info.extra) == {"drafter_state": "ok", "drafter_failures": "0"}, info.extra
    port = orch.info["metrics_port"]
    assert (ar_fallbacks(port, "drafter_full"), ar_fallbacks(port, "drafter_failed")) == (1, 0)


def test_the_verifier_holds_a_session_to_its_max_positions(servers):
    stub = verifier_stub(servers["verifier"].addr)
    msgs = [
        verifier_pb2.VerifierRequest(open=verifier_pb2.VerifierRequest.Open(max_positions=5)),
        verifier_pb2.VerifierRequest(prefill=verifier_pb2.VerifierRequest.Prefill(token_ids=PROMPT[:4])),
        verifier_pb2.VerifierRequest(verify=verifier_pb2.VerifierRequest.Verify(block_ids=[3, 4])),
    ]
    code, details, _ = _code(lambda: list(stub.Session(iter(msgs), timeout=10)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "verify.block_ids" in details and "max_positions 5" in details
    msgs = [verifier_pb2.VerifierRequest(open=verifier_pb2.VerifierRequest.Open(max_positions=MAX_CONTEXT + 1))]
    code, details, _ = _code(lambda: list(stub.Session(iter(msgs), timeout=10)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "open.max_positions" in details


def test_drafter_aux_rows_are_bounded(servers):
    info = servers["drafter"]
    width = drafter_stub(info.addr).GetInfo(drafter_pb2.GetDrafterInfoRequest(), timeout=10)
    aux_width = len(width.target_layer_ids) * width.hidden_size
    aux = codec.to_proto(np.zeros((MAX_CONTEXT + 1, aux_width), np.float32))
    msgs = [
        drafter_pb2.DrafterRequest(open=drafter_pb2.DrafterRequest.Open()),
        drafter_pb2.DrafterRequest(draft=drafter_pb2.DrafterRequest.Draft(new_aux=aux, last_token=3, block_size=4)),
    ]
    code, details, _ = _code(lambda: list(drafter_stub(info.addr).Session(iter(msgs), timeout=10)))
    assert code == grpc.StatusCode.OUT_OF_RANGE and "draft.new_aux" in details and "--max-context" in details


class _DraftSession:
    """A drafter Session driven one message at a time."""

    def __init__(self, addr, width):
        import queue

        self.width, self._q = width, queue.SimpleQueue()
        self.call = drafter_stub(addr).Session(iter(self._q.get, None), timeout=30)
        self._q.put(drafter_pb2.DrafterRequest(open=drafter_pb2.DrafterRequest.Open()))
        assert next(self.call).WhichOneof("response") == "opened"

    def draft(self, rows: int):
        aux = codec.to_proto(np.zeros((rows, self.width), np.float32))
        self._q.put(
            drafter_pb2.DrafterRequest(draft=drafter_pb2.DrafterRequest.Draft(new_aux=aux, last_token=3, block_size=4))
        )
        return next(self.call)

    def close(self):
        self._q.put(None)
        self.call.cancel()


def test_the_drafter_holds_its_context_caches_to_a_byte_budget(servers):
    """The red team's 8 sessions of 131,072 aux rows took the drafter from 268 MB to 1.4 GB: a budget bounds it."""
    addr = servers["budgeted"].addr
    info = drafter_stub(addr).GetInfo(drafter_pb2.GetDrafterInfoRequest(), timeout=10)
    width = len(info.target_layer_ids) * info.hidden_size
    huge = _DraftSession(addr, width)
    with pytest.raises(grpc.RpcError) as err:
        huge.draft(4096)
    # more than the whole budget: OUT_OF_RANGE (no retry would fit; its orchestrator goes on without the drafter)
    assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE and "--max-kv-bytes" in err.value.details()
    a, b = _DraftSession(addr, width), _DraftSession(addr, width)
    assert a.draft(100).HasField("drafted") and b.draft(100).HasField("drafted")
    c = _DraftSession(addr, width)
    with pytest.raises(grpc.RpcError) as err:
        c.draft(100)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "budget exhausted" in err.value.details()
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:  # a session that already holds a context grows only into free room
        a.draft(200)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() - t0 < 2
    assert drafter_stub(addr).GetInfo(drafter_pb2.GetDrafterInfoRequest(), timeout=10).live_kv_bytes <= DRAFTER_BUDGET
    for s in (huge, a, b, c):
        s.close()
    wait_until(lambda: drafter_stub(addr).GetInfo(drafter_pb2.GetDrafterInfoRequest(), timeout=10).live_sessions == 0,
               what="the sessions freed")  # fmt: skip
    again = _DraftSession(addr, width)
    assert again.draft(200).HasField("drafted")  # the budget is free again
    again.close()


@pytest.mark.parametrize("rid", ["é", "a\nb", "tab\there", "x" * 129, "\x00"])
def test_bad_request_ids_are_invalid_argument(servers, rid):
    req = request(PROMPT, max_tokens=4)
    req.request_id = rid
    code, details, _ = _code(lambda: generate(servers["orchestrator"].addr, req))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in details


def test_a_good_request_id_travels(servers):
    req = request(PROMPT, max_tokens=4)
    req.request_id = "req-" + "A" * 124  # 128 printable characters
    assert len(generate(servers["orchestrator"].addr, req)[0]) == 4


@pytest.mark.parametrize(
    "method, raw",
    [
        ("/kakeya.v1.Generation/Generate", b"\xff\xff\xff\xff"),
        ("/kakeya.v1.Generation/Generate", b"\x12\x02\xc3\x28"),  # `text` with invalid UTF-8
        ("/kakeya.v1.Generation/GetModelInfo", b"\x0a\x05ab"),
    ],
)
def test_undecodable_public_requests_are_invalid_argument(servers, method, raw):
    ch = channel(servers["orchestrator"].addr)
    if method.endswith("Generate"):
        call = ch.unary_stream(method, request_serializer=None, response_deserializer=None)
        code, details, _ = _code(lambda: list(call(raw, timeout=10)))
    else:
        call = ch.unary_unary(method, request_serializer=None, response_deserializer=None)
        code, details, _ = _code(lambda: call(raw, timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "cannot decode" in details


@pytest.mark.parametrize("service, name", [("verifier", "VerifierService"), ("drafter", "DrafterService")])
def test_undecodable_session_messages_are_invalid_argument(servers, service, name):
    ch = channel(servers[service].addr)
    call = ch.stream_stream(f"/kakeya.v1.{name}/Session", request_serializer=None, response_deserializer=None)
    code, details, _ = _code(lambda: list(call(iter([b"\x0a\xff\xff\xff\xff\x0f"]), timeout=10)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "cannot decode" in details


def test_an_oversized_public_request_is_refused_before_it_is_read(servers):
    req = generate_pb2.GenerateRequest(text="a" * (5 * 1024 * 1024))
    code, details, _ = _code(lambda: generate(servers["orchestrator"].addr, req))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details
    _still_serves(servers)


def test_restore_sources_are_names_configured_on_the_server(servers, ftheta_dir):
    info = verifier_info(servers["verifier"].addr)
    assert list(info.restore_sources) == ["tiny"]
    addr = servers["orchestrator"].addr
    for bad in ("/etc", str(ftheta_dir), "../tiny", "nope"):  # never a path, even the configured one
        req = _with_policy(kind=cache_pb2.CACHE_KIND_SINK_WINDOW, sink=4, window=16, restore_path=bad)
        code, details, _ = _code(lambda req=req: generate(addr, req))
        assert (
            code == grpc.StatusCode.INVALID_ARGUMENT
            and "restore_path" in details
            and "unknown restoration source" in details
        )
    req = _with_policy(kind=cache_pb2.CACHE_KIND_SINK_WINDOW, sink=4, window=16, restore_path="tiny")
    req.sampling_params.max_tokens = 40
    ids, _, complete, _ = generate(addr, req)
    assert len(ids) == 40 and complete.stats.cache_policy.endswith("+restore")
    assert str(ftheta_dir) not in str(complete)  # the server's path never reaches a client


def test_stop_lists_are_bounded(servers):
    req = request(PROMPT, max_tokens=4)
    req.sampling_params.stop_token_ids.extend([5] * 2000)
    code, details, _ = _code(lambda: generate(servers["orchestrator"].addr, req))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "stop_token_ids" in details


def test_a_nan_temperature_is_not_greedy(servers):
    req = request(PROMPT, max_tokens=4, temperature=float("nan"))
    code, details, _ = _code(lambda: generate(servers["orchestrator"].addr, req))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in details
