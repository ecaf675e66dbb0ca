"""Tensors over a real in-process gRPC server and channel, with the shared limits.

A tiny echo verifier and drafter (defined here) stand in for the real services:
they speak the session protocol and use the codec exactly as servers must,
including mapping a codec ``ValueError`` to ``INVALID_ARGUMENT``.
"""

from __future__ import annotations

from concurrent import futures

import grpc
import numpy as np
import pytest
import torch

from kakeya.wire import limits
from kakeya.wire.codec import from_proto, to_proto
from kakeya.wire.kakeya.v1 import drafter_pb2, drafter_pb2_grpc, tensor_pb2, verifier_pb2, verifier_pb2_grpc

VReq, VRes = verifier_pb2.VerifierRequest, verifier_pb2.VerifierResponse
DReq, DRes = drafter_pb2.DrafterRequest, drafter_pb2.DrafterResponse
WIDTH = 2 * 1024  # aux width of the echo "model"
BIG_ROWS = 700  # 700 x 2048 x 4 bytes = 5.5 MiB > gRPC's 4 MiB default


def _aux(rows: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, WIDTH), dtype=np.float32)


class EchoVerifier(verifier_pb2_grpc.VerifierServiceServicer):
    """Prefill returns ``len(token_ids)`` rows of aux seeded by the first token."""

    def GetInfo(self, request, context):
        return verifier_pb2.VerifierInfo(model_name="echo", backend="numpy", aux_dtype=tensor_pb2.DTYPE_FLOAT32)

    def Session(self, requests, context):
        for req in requests:
            kind = req.WhichOneof("request")
            if kind == "open":
                yield VRes(opened=VRes.Opened(info=self.GetInfo(None, context), session_id="s1"))
            elif kind == "prefill":
                ids = list(req.prefill.token_ids)
                yield VRes(prefilled=VRes.Prefilled(next_token=len(ids), aux=to_proto(_aux(len(ids), ids[0]))))
            elif kind == "close":
                yield VRes(closed=VRes.Closed())
                return
            else:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"echo verifier does not do {kind}")


class EchoDrafter(drafter_pb2_grpc.DrafterServiceServicer):
    """Draft decodes new_aux and answers with its shape and a checksum as 'tokens'."""

    def Session(self, requests, context):
        rows = 0
        for req in requests:
            kind = req.WhichOneof("request")
            if kind == "open":
                yield DRes(opened=DRes.Opened(info=drafter_pb2.DrafterInfo(model_name="echo", block_size=4)))
            elif kind == "draft":
                try:
                    aux = from_proto(req.draft.new_aux, like="torch")
                except ValueError as e:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"new_aux: {e}")
                rows += aux.shape[0]
                check = int(aux.double().sum().round().item())
                stats = drafter_pb2.DrafterStats(context_positions=rows, kv_bytes=aux.numel() * aux.element_size())
                yield DRes(drafted=DRes.Drafted(token_ids=[*aux.shape, check], stats=stats))
            elif kind == "close":
                yield DRes(closed=DRes.Closed())
                return


@pytest.fixture(scope="module")
def server():
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=limits.server_options())
    verifier_pb2_grpc.add_VerifierServiceServicer_to_server(EchoVerifier(), srv)
    drafter_pb2_grpc.add_DrafterServiceServicer_to_server(EchoDrafter(), srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    yield f"127.0.0.1:{port}"
    srv.stop(grace=None)


@pytest.fixture()
def channel(server):
    with grpc.insecure_channel(server, options=limits.channel_options()) as ch:
        yield ch


def test_large_aux_from_verifier_to_client(channel):
    stub = verifier_pb2_grpc.VerifierServiceStub(channel)
    requests = iter(
        [
            VReq(open=VReq.Open(request_id="r")),
            VReq(prefill=VReq.Prefill(token_ids=[7] * BIG_ROWS)),
            VReq(close=VReq.Close()),
        ]
    )
    responses = list(stub.Session(requests, timeout=60))
    assert [r.WhichOneof("response") for r in responses] == ["opened", "prefilled", "closed"]
    prefilled = responses[1].prefilled
    assert prefilled.aux.ByteSize() > 4 * 1024 * 1024
    np.testing.assert_array_equal(from_proto(prefilled.aux), _aux(BIG_ROWS, 7))
    assert prefilled.next_token == BIG_ROWS


def test_large_aux_from_client_to_drafter_as_bfloat16(channel):
    stub = drafter_pb2_grpc.DrafterServiceStub(channel)
    big = torch.from_numpy(_aux(2 * BIG_ROWS, 3)).to(torch.bfloat16)  # 5.5 MiB in bfloat16
    small = torch.ones(2, WIDTH, dtype=torch.bfloat16)
    requests = iter(
        [
            DReq(open=DReq.Open(request_id="r")),
            DReq(draft=DReq.Draft(new_aux=to_proto(big), last_token=1, block_size=4)),
            DReq(draft=DReq.Draft(new_aux=to_proto(small), last_token=2, block_size=4)),
            DReq(close=DReq.Close()),
        ]
    )
    responses = list(stub.Session(requests, timeout=60))
    assert [r.WhichOneof("response") for r in responses] == ["opened", "drafted", "drafted", "closed"]
    first, second = responses[1].drafted, responses[2].drafted
    assert list(first.token_ids) == [2 * BIG_ROWS, WIDTH, int(big.double().sum().round().item())]
    assert second.stats.context_positions == 2 * BIG_ROWS + 2


def test_bad_tensor_ends_the_session_with_invalid_argument(channel):
    stub = drafter_pb2_grpc.DrafterServiceStub(channel)
    bad = tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_FLOAT32, shape=[2, 3], data=bytes(5))
    requests = iter([DReq(open=DReq.Open()), DReq(draft=DReq.Draft(new_aux=bad, last_token=1, block_size=4))])
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Session(requests, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "new_aux: tensor data has 5 bytes but float32 shape [2, 3] needs 24" in info.value.details()


def test_default_grpc_limits_would_refuse_the_same_message(server):
    """Guards the point of limits.py: without it the 5.5 MiB aux does not get through."""
    with grpc.insecure_channel(server) as ch:
        stub = verifier_pb2_grpc.VerifierServiceStub(ch)
        requests = iter([VReq(open=VReq.Open()), VReq(prefill=VReq.Prefill(token_ids=[7] * BIG_ROWS))])
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Session(requests, timeout=30))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_limit_options(monkeypatch):
    opts = dict(limits.channel_options())
    assert opts["grpc.max_send_message_length"] == opts["grpc.max_receive_message_length"] == 256 * limits.MiB
    assert dict(limits.server_options())["grpc.max_receive_message_length"] == 256 * limits.MiB
    # a server tolerates client keepalive pings at least as often as its clients send them: a backend server the
    # orchestrator's 1 s backend channels (and any default channel), the public API the default channels only
    backend = dict(limits.channel_options(backend=True))
    assert backend["grpc.keepalive_time_ms"] < opts["grpc.keepalive_time_ms"]
    min_ping = "grpc.http2.min_ping_interval_without_data_ms"
    for client in (opts, backend):
        assert dict(limits.server_options())[min_ping] < client["grpc.keepalive_time_ms"]
    public = dict(limits.server_options(public=True))[min_ping]
    assert backend["grpc.keepalive_time_ms"] < public < opts["grpc.keepalive_time_ms"]
    assert public <= 10_000  # grpc-go's shortest client keepalive, which services in Go often set (was 30 s: GOAWAY)
    assert "grpc.keepalive_time_ms" not in dict(limits.channel_options(keepalive=False))
    assert dict(limits.channel_options(64 * limits.MiB))["grpc.max_send_message_length"] == 64 * limits.MiB
    monkeypatch.setenv(limits.ENV_MAX_MESSAGE_BYTES, str(512 * limits.MiB))
    assert dict(limits.server_options())["grpc.max_send_message_length"] == 512 * limits.MiB
    monkeypatch.setenv(limits.ENV_MAX_MESSAGE_BYTES, "lots")
    with pytest.raises(ValueError, match="must be an integer byte count"):
        limits.channel_options()
    monkeypatch.setenv(limits.ENV_MAX_MESSAGE_BYTES, str(2**31))
    with pytest.raises(ValueError, match="must be between"):
        limits.server_options()
