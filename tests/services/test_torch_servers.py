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

from kakeya.orchestrator.loop import run  # noqa: E402
from kakeya.orchestrator.remote import GrpcDrafter, GrpcVerifier  # noqa: E402
from kakeya.wire.kakeya.v1 import drafter_pb2_grpc, verifier_pb2_grpc  # noqa: E402
from kakeya.wire.limits import server_options  # noqa: E402

from .conftest import wait_until  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPT = [2, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60]
N = 120  # past three wraps of the 32-position window


@pytest.fixture(scope="module")
def torch_servers(tiny_pair, aux_layers):
    from kakeya.drafter.server import DrafterServicer
    from kakeya.drafter.session import TorchDrafter
    from kakeya.verifier.server import VerifierServicer
    from kakeya.verifier.torch_backend.target import torch_verifier

    d, v = DrafterServicer(), VerifierServicer()
    d.compute.run(d._setup, lambda: TorchDrafter(tiny_pair.draft, tiny_pair.target), str(tiny_pair.draft), str(tiny_pair.target), "torch")
    v.compute.run(v._setup, lambda: torch_verifier(tiny_pair.target, aux_layers), tiny_pair.target, tuple(aux_layers))
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
