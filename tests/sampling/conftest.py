"""The sampling tests' models: a small-vocabulary pair (vocab 48, ids only) whose sampled outputs can be
enumerated exactly, and the tiny pair in process (both backends) and split over gRPC."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from kakeya.core.request import SamplingParams
from kakeya.wire.kakeya.v1 import drafter_pb2_grpc, verifier_pb2_grpc
from kakeya.wire.limits import server_options

SMALL_VOCAB = 48
PROMPT = [2, 10, 20]
BACKENDS = ["mlx", "torch"]
# Temperature 2 flattens the random target enough that the drafter (another random model) often
# disagrees with it, so rejections, residual draws and the broken rule all show.
SETTINGS = {
    "top-k": SamplingParams(2.0, top_k=6),
    "top-p": SamplingParams(2.0, top_p=0.6),
}


@pytest.fixture(scope="session")
def small_pair(tmp_path_factory):
    from kakeya.checkpoints.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("small_vocab"), vocab_size=SMALL_VOCAB)


@pytest.fixture(scope="session")
def small_models(small_pair):
    """{backend: (verifier, drafter)} on the small pair, loaded once (torch on one thread: 2 shared cores)."""
    import torch

    from kakeya.checkpoints.config import load_draft_config
    from kakeya.drafter.loader import local_drafter
    from kakeya.verifier.loader import local_verifier

    torch.set_num_threads(1)
    layers = load_draft_config(small_pair.draft)["dflash_config"]["target_layer_ids"]
    return {
        be: (
            local_verifier(str(small_pair.target), layers, be),
            local_drafter(str(small_pair.draft), str(small_pair.target), be),
        )
        for be in BACKENDS
    }


def _local(backend, tiny_pair, aux_layers):
    from kakeya.drafter.loader import local_drafter
    from kakeya.verifier.loader import local_verifier

    return local_verifier(str(tiny_pair.target), list(aux_layers), backend), local_drafter(
        str(tiny_pair.draft), str(tiny_pair.target), backend
    )


@pytest.fixture(scope="session")
def local(tiny_pair, aux_layers):
    import torch

    torch.set_num_threads(1)
    return {be: _local(be, tiny_pair, aux_layers) for be in ("mlx", "torch")}


@pytest.fixture(scope="session")
def split(tiny_pair, aux_layers):
    """Verifier servicers (torch and MLX) and an MLX drafter servicer on one loopback server."""
    from kakeya.drafter.local import MLXDrafter
    from kakeya.drafter.server import DrafterServicer
    from kakeya.orchestrator.remote.drafter import GrpcDrafter
    from kakeya.orchestrator.remote.verifier import GrpcVerifier
    from kakeya.verifier.loader import local_verifier
    from kakeya.verifier.server import VerifierServicer

    servers, out = [], {}
    for name, backend in (("torch", "torch"), ("mlx", "mlx")):
        v, d = VerifierServicer(), DrafterServicer()
        v.compute.run(
            v._setup,
            lambda b=backend: local_verifier(str(tiny_pair.target), list(aux_layers), b),
            tiny_pair.target,
            tuple(aux_layers),
        )
        d.compute.run(
            d._setup,
            lambda **shared: MLXDrafter(tiny_pair.draft, tiny_pair.target, **shared),
            str(tiny_pair.draft),
            str(tiny_pair.target),
            "mlx",
        )
        v.ready = d.ready = True
        server = grpc.server(ThreadPoolExecutor(8), options=server_options())
        verifier_pb2_grpc.add_VerifierServiceServicer_to_server(v, server)
        drafter_pb2_grpc.add_DrafterServiceServicer_to_server(d, server)
        addr = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        server.start()
        servers.append((server, v, d))
        drafter = GrpcDrafter(addr)
        out[name] = (GrpcVerifier(addr, aux_layers=drafter.target_layer_ids), drafter)
    yield out
    for server, v, d in servers:
        server.stop(0).wait()
        v.compute.shutdown()
        d.compute.shutdown()
