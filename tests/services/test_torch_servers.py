"""The same verifier/drafter servicers over the torch backend: split output == mlx-lm greedy AR.

In-process gRPC server on loopback (the servicers are backend-neutral; the
backend object comes from the torch factories), reached through the same
``GrpcVerifier`` / ``GrpcDrafter`` clients the orchestrator uses.
"""

from __future__ import annotations

import importlib
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

importlib.import_module("torch")

from kakeya.orchestrator.decode.loop import run
from kakeya.orchestrator.remote.drafter import GrpcDrafter
from kakeya.orchestrator.remote.verifier import GrpcVerifier
from kakeya.wire.kakeya.v1 import drafter_pb2_grpc, verifier_pb2_grpc
from kakeya.wire.limits import server_options

from .conftest import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPT = [2, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60]
N = 120  # past three wraps of the 32-position window


def _serve(pair):
    """A drafter and a verifier servicer on ``pair`` (torch), in one in-process gRPC server on loopback."""
    from kakeya.checkpoints.config import load_draft_config
    from kakeya.drafter.local import TorchDrafter
    from kakeya.drafter.server import DrafterServicer
    from kakeya.verifier.server import VerifierServicer
    from kakeya.verifier.torch_backend.target import torch_verifier

    aux_layers = tuple(load_draft_config(pair.draft)["dflash_config"]["target_layer_ids"])
    d, v = DrafterServicer(), VerifierServicer()
    d.compute.run(
        d._setup,
        lambda **shared: TorchDrafter(pair.draft, pair.target, **shared),
        str(pair.draft),
        str(pair.target),
        "torch",
    )
    v.compute.run(v._setup, lambda: torch_verifier(pair.target, aux_layers), pair.target, aux_layers)
    d.ready = v.ready = True
    server = grpc.server(ThreadPoolExecutor(16), options=server_options())
    drafter_pb2_grpc.add_DrafterServiceServicer_to_server(d, server)
    verifier_pb2_grpc.add_VerifierServiceServicer_to_server(v, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", v, d
    server.stop(0).wait()
    for s in (v, d):
        s.compute.shutdown()


@pytest.fixture(scope="module")
def torch_servers(tiny_pair):
    yield from _serve(tiny_pair)


def test_torch_backends_over_grpc_match_mlx_lm_greedy_ar(torch_servers, mlx_target):
    from kakeya.verifier.mlx_backend.reference import greedy_reference

    addr, v, d = torch_servers
    drafter = GrpcDrafter(addr)
    verifier = GrpcVerifier(addr, aux_layers=drafter.target_layer_ids)
    assert verifier.remote.backend == "torch" and drafter.remote.backend == "torch"
    ref, _, _ = greedy_reference(mlx_target.model, PROMPT, N)
    for block_size in (1, 4, 8):
        vs = verifier.open_session()
        ds = drafter.open_session() if block_size > 1 else None
        try:
            gen = run(vs, ds, PROMPT, N, block_size)
        finally:
            vs.close()
            if ds is not None:
                ds.close()
        assert gen.token_ids == ref, block_size
    assert v.registry.total >= 3 and d.registry.total >= 2
    wait_until(lambda: v.registry.live == 0 and d.registry.live == 0, what="sessions closed")


def test_ngram_copies_over_grpc_commit_what_colocated_commits(demo_pair):
    """The trained pair repeats itself on this prompt, so blocks are drafted by copy: the remote drafter then
    only extends its context (a draft of size 1), and the tokens are colocated AR's, block size by block size."""
    from kakeya.core.request import Request
    from kakeya.orchestrator.assembly import build_local_engine

    local = build_local_engine(demo_pair.target, demo_pair.draft, "torch", "cpu")
    prompt = local.codec.encode(
        "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):"
    )
    ar = local.generate(Request(prompt, max_tokens=64, block_size=1, ignore_eos=True)).token_ids
    servers = _serve(demo_pair)
    addr, _, _ = next(servers)
    try:
        drafter = GrpcDrafter(addr)
        verifier = GrpcVerifier(addr, aux_layers=drafter.target_layer_ids)
        for block_size in (4, 8, 16):
            vs, ds = verifier.open_session(), drafter.open_session()
            try:
                gen = run(vs, ds, prompt, 64, block_size, ngram=True)
            finally:
                vs.close()
                ds.close()
            assert gen.token_ids == ar and any(b.copied for b in gen.blocks), block_size
    finally:
        servers.close()
