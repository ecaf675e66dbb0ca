"""Logprobs over gRPC: split (a verifier server computes them on its device, only the committed positions'
values cross the wire to the orchestrator) equal the target's plain forward and the colocated run's, greedy and
seeded sampling; the public ``Generate`` streams them in its chunks (``SamplingParams.logprobs``), and a bad
value is INVALID_ARGUMENT naming ``sampling_params.logprobs``."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from kakeya.core.contract import SessionOptions
from kakeya.core.request import REJECTION, SamplingParams
from kakeya.orchestrator.decode.loop import run
from kakeya.orchestrator.fronts.http_server import HttpCall
from kakeya.wire.kakeya.v1 import drafter_pb2_grpc, verifier_pb2_grpc
from kakeya.wire.kakeya.v1 import generate_pb2 as pb
from kakeya.wire.kakeya.v1 import verifier_pb2 as vpb
from kakeya.wire.limits import server_options

from ..verifier.test_logprobs import PROMPT, TOL, check

N = 20
PARAMS = {
    "greedy": SamplingParams(),
    "coupled": SamplingParams(0.8, seed=42),
    "rejection": SamplingParams(0.8, seed=3, rule=REJECTION),
}


@pytest.fixture(scope="module")
def split(demo_pair):
    """A torch verifier server and a torch drafter server (demo pair) on one loopback port; their clients."""
    import torch

    from kakeya.checkpoints.config import load_draft_config
    from kakeya.drafter.local import TorchDrafter
    from kakeya.drafter.server import DrafterServicer
    from kakeya.orchestrator.remote.drafter import GrpcDrafter
    from kakeya.orchestrator.remote.verifier import GrpcVerifier
    from kakeya.verifier.loader import local_verifier
    from kakeya.verifier.server import VerifierServicer

    torch.set_num_threads(1)
    target, draft = str(demo_pair.target), str(demo_pair.draft)
    layers = tuple(load_draft_config(draft)["dflash_config"]["target_layer_ids"])
    v, d = VerifierServicer(), DrafterServicer()
    v.compute.run(v._setup, lambda: local_verifier(target, list(layers), "torch"), target, layers)
    d.compute.run(d._setup, lambda **shared: TorchDrafter(draft, target, **shared), draft, target, "torch")
    v.ready = d.ready = True
    server = grpc.server(ThreadPoolExecutor(8), options=server_options())
    verifier_pb2_grpc.add_VerifierServiceServicer_to_server(v, server)
    drafter_pb2_grpc.add_DrafterServiceServicer_to_server(d, server)
    addr = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    drafter = GrpcDrafter(addr)
    yield v.verifier, GrpcVerifier(addr, aux_layers=layers), drafter, addr, TorchDrafter(draft, target)
    server.stop(0).wait()
    v.compute.shutdown()
    d.compute.shutdown()


def _generate(verifier, drafter, params, k):
    vs = verifier.open_session(None, params, SessionOptions(logprobs=k))
    ds = drafter.open_session(params)
    try:
        gen = run(vs, ds, PROMPT, N, 4)
    finally:
        vs.close()
        ds.close()
    return gen


@pytest.mark.parametrize("name", list(PARAMS))
def test_split_logprobs_equal_the_target_and_colocated(split, name):
    local, remote, drafter, _, local_drafter = split
    gen = _generate(remote, drafter, PARAMS[name], 5)
    assert len(gen.token_ids) == N and len(gen.blocks) < N
    logprobs = [lp for b in gen.blocks for lp in b.logprobs]
    check(local, PROMPT, gen.token_ids, logprobs, k=5)
    colocated = _generate(local, local_drafter, PARAMS[name], 5)  # the same pair in this process
    assert colocated.token_ids == gen.token_ids
    there = [lp for b in colocated.blocks for lp in b.logprobs]
    np.testing.assert_allclose([lp.logprob for lp in there], [lp.logprob for lp in logprobs], atol=TOL)
    assert [lp.top[0][0] for lp in there] == [lp.top[0][0] for lp in logprobs]


def test_a_session_without_logprobs_gets_none_over_the_wire(split):
    _, remote, drafter, *_ = split
    gen = _generate(remote, drafter, PARAMS["greedy"], None)
    assert all(b.logprobs is None for b in gen.blocks)


def test_the_verifier_refuses_a_bad_open_logprobs(split):
    addr = split[3]
    stub = verifier_pb2_grpc.VerifierServiceStub(grpc.insecure_channel(addr))
    opened = vpb.VerifierRequest.Open(logprobs=21)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Session(iter([vpb.VerifierRequest(open=opened)])))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "open.logprobs" in err.value.details()


class _Context(HttpCall):
    def abort(self, code, message):
        raise grpc.RpcError(code, message)

    def invocation_metadata(self):
        return ()

    def send_initial_metadata(self, metadata):  # grpc's: Generate sends the request id in it
        self.sent_metadata = metadata

    set_trailing_metadata = send_initial_metadata  # and in its trailers


@pytest.fixture(scope="module")
def public(split):
    """The public gRPC service over the split pair."""
    from kakeya.orchestrator.assembly import split_engine
    from kakeya.orchestrator.fronts.grpc_server import GenerationServicer
    from kakeya.wire.kakeya.v1 import generate_pb2_grpc

    servicer = GenerationServicer(lambda: split_engine(split[3], split[3], None, 10.0), colocated=False)
    servicer.load()
    servicer.ready = True
    server = grpc.server(ThreadPoolExecutor(4), options=server_options())
    generate_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    servicer.public_addr = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"  # for `kakeya client`
    server.start()
    yield servicer
    server.stop(0).wait()


def test_generate_streams_logprobs_in_its_chunks(split, public):
    local = split[0]
    req = pb.GenerateRequest(
        tokenized=pb.TokenIds(ids=PROMPT), block_size=4, sampling_params=pb.SamplingParams(max_tokens=N, logprobs=3)
    )
    ids, logprobs = [], []
    for resp in public.Generate(req, _Context()):
        if resp.HasField("chunk"):
            assert len(resp.chunk.logprobs) == len(resp.chunk.token_ids)
            ids += resp.chunk.token_ids
            logprobs += resp.chunk.logprobs
    assert len(ids) == N
    from kakeya.wire.convert import logprobs_from_proto

    check(local, PROMPT, ids, [logprobs_from_proto(m) for m in logprobs], k=3)
    np.testing.assert_array_equal([m.token for m in logprobs], ids)


@pytest.mark.parametrize("k", [21, -1])
def test_generate_refuses_a_bad_logprobs_naming_it(public, k):
    req = pb.GenerateRequest(tokenized=pb.TokenIds(ids=PROMPT), sampling_params=pb.SamplingParams(logprobs=k))
    with pytest.raises(grpc.RpcError) as err:
        list(public.Generate(req, _Context()))
    code, message = err.value.args
    assert code == grpc.StatusCode.INVALID_ARGUMENT and message.startswith("sampling_params.logprobs")


def test_the_client_cli_lists_the_streamed_logprobs(split, public, capsys):
    """``kakeya client generate --logprobs K --json`` over the public API: the chunks' logprobs, joined."""
    import json

    from kakeya.app.main import main
    from kakeya.core.contract import TokenLogprobs

    ids = ",".join(map(str, PROMPT))
    args = ["client", "--addr", public.public_addr, "generate", "--prompt-ids", ids, "--json", "--max-tokens", "10"]
    assert main([*args, "--logprobs", "2"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    got = [TokenLogprobs(e["token"], e["logprob"], tuple(map(tuple, e["top"]))) for e in out["logprobs"]]
    check(split[0], PROMPT, out["token_ids"], got, k=2)
    assert main([*args, "--logprobs", "21"]) != 0
    assert "sampling_params.logprobs" in capsys.readouterr().err
