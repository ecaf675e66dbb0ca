"""Same seed + same request -> same tokens: in-process (MLX, torch, mixed), split over gRPC
(torch verifier + MLX drafter servicers on loopback), and through the public engine API."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import grpc
import pytest

from kakeya.core.contract import Request, SamplingParams
from kakeya.orchestrator.engine import Engine
from kakeya.orchestrator.loop import run
from kakeya.wire.kakeya.v1 import drafter_pb2_grpc, verifier_pb2_grpc
from kakeya.wire.limits import server_options

PROMPT = [2, 40, 41, 42, 43, 44, 45, 46, 47, 48]
N = 48
PARAMS = SamplingParams(0.8, top_k=40, top_p=0.95, seed=1234)


def _local(backend, tiny_pair, aux_layers):
    from kakeya.drafter.loader import local_drafter
    from kakeya.verifier.loader import local_verifier

    return local_verifier(str(tiny_pair.target), list(aux_layers), backend), local_drafter(str(tiny_pair.draft), str(tiny_pair.target), backend)


@pytest.fixture(scope="module")
def local(tiny_pair, aux_layers):
    import torch

    torch.set_num_threads(1)
    return {be: _local(be, tiny_pair, aux_layers) for be in ("mlx", "torch")}


def _generate(verifier, drafter, params, block_size=8):
    vs = verifier.open_session(sampling=params)
    ds = drafter.open_session(params) if block_size > 1 else None
    try:
        return run(vs, ds, PROMPT, N, block_size).token_ids
    finally:
        vs.close()
        if ds is not None:
            ds.close()


@pytest.mark.parametrize("deployment", ["mlx", "torch", "mlx verifier + torch drafter"])
def test_in_process_same_seed_same_tokens(local, deployment):
    if deployment in local:
        v, d = local[deployment]
    else:
        v, d = local["mlx"][0], local["torch"][1]
    first = _generate(v, d, PARAMS)
    assert _generate(v, d, PARAMS) == first
    assert _generate(v, d, replace(PARAMS, seed=PARAMS.seed + 1)) != first  # the seed matters
    assert len(first) == N and all(0 <= t < v.info.vocab_size for t in first)


@pytest.fixture(scope="module")
def split(tiny_pair, aux_layers):
    """Verifier servicers (torch and MLX) and an MLX drafter servicer on one loopback server."""
    from kakeya.drafter.server import DrafterServicer
    from kakeya.drafter.session import MLXDrafter
    from kakeya.orchestrator.remote import GrpcDrafter, GrpcVerifier
    from kakeya.verifier.loader import local_verifier
    from kakeya.verifier.server import VerifierServicer

    servers, out = [], {}
    for name, backend in (("torch", "torch"), ("mlx", "mlx")):
        v, d = VerifierServicer(), DrafterServicer()
        v.compute.run(v._setup, lambda b=backend: local_verifier(str(tiny_pair.target), list(aux_layers), b), tiny_pair.target, tuple(aux_layers))
        d.compute.run(d._setup, lambda: MLXDrafter(tiny_pair.draft, tiny_pair.target), str(tiny_pair.draft), str(tiny_pair.target), "mlx")
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


def test_split_over_grpc_same_seed_same_tokens_and_equal_to_colocated(split, local):
    gv, gd = split["mlx"]
    remote = _generate(gv, gd, PARAMS)
    assert remote == _generate(gv, gd, PARAMS)
    assert remote == _generate(*local["mlx"], PARAMS)  # the same arithmetic and the same uniforms
    ar = _generate(gv, gd, PARAMS, block_size=1)  # AR sampling over the wire
    assert ar == _generate(local["mlx"][0], None, PARAMS, block_size=1)


def test_mixed_torch_verifier_mlx_drafter_over_grpc_is_reproducible(split):
    gv, gd = split["torch"]
    assert gv.remote.backend == "torch" and gd.remote.backend == "mlx"
    first = _generate(gv, gd, PARAMS)
    assert first == _generate(gv, gd, PARAMS)
    assert len(first) == N


def test_engine_draws_reports_and_honours_the_seed(local):
    v, d = local["mlx"]
    engine = Engine(v, d, codec=None)
    unseeded = Request(PROMPT, max_tokens=24, block_size=4, sampling=SamplingParams(1.0))
    gen = engine.generate(unseeded)
    seed = gen.sampling.seed
    assert seed is not None and gen.sampling.temperature == 1.0
    again = engine.generate(replace(unseeded, sampling=SamplingParams(1.0, seed=seed)))
    assert again.token_ids == gen.token_ids and again.sampling.seed == seed
    with pytest.raises(ValueError, match="^top_p "):
        engine.generate(replace(unseeded, sampling=SamplingParams(1.0, top_p=0)))


def test_greedy_is_untouched_by_sampling_support(local):
    """Temperature 0 ignores every other knob and stays the target's greedy AR."""
    v, d = local["mlx"]
    greedy = _generate(v, d, None)
    assert greedy == _generate(v, d, SamplingParams(0.0, top_k=3, top_p=0.5, seed=9))
    assert greedy == _generate(v, None, None, block_size=1)


def test_a_sampling_verifier_refuses_candidates_without_their_proposal(local):
    v, _ = local["torch"]
    s = v.open_session(sampling=PARAMS)
    first, _ = s.prefill(PROMPT)
    with pytest.raises(ValueError, match="proposal"):
        s.verify([first, 5, 6])
