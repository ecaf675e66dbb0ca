"""Constrained decoding split over gRPC (torch verifier and drafter servicers on loopback): the constraint
travels in the verifier's Open, and the split output equals the colocated constrained AR output."""

from __future__ import annotations

import pytest

from kakeya.core.request import Request

from ..services.test_torch_servers import _serve
from .cases import PROMPTS, constraints

pytestmark = [pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def served(demo_pair):
    gen = _serve(demo_pair)
    addr, _, _ = next(gen)
    yield addr
    next(gen, None)


@pytest.fixture(scope="module")
def split(demo_pair, served):
    from kakeya.orchestrator.assembly import split_engine

    return split_engine(served, served, str(demo_pair.target), wait_s=60)


@pytest.mark.parametrize(
    ("opened", "why"),
    [({"ranked": 17}, "open.ranked must be 0..16"), ({"ranked": 4, "temperature": 1.0}, "open.ranked: ")],
)
def test_a_drafter_refuses_ranks_it_cannot_give_by_name(served, opened, why):
    import grpc

    from kakeya.wire.kakeya.v1 import drafter_pb2 as pb
    from kakeya.wire.kakeya.v1 import drafter_pb2_grpc

    open_ = pb.DrafterRequest.Open(ranked=opened["ranked"])
    if "temperature" in opened:
        open_.sampling.temperature = opened["temperature"]
        open_.sampling.seed = 1
    with grpc.insecure_channel(served) as channel:
        stream = drafter_pb2_grpc.DrafterServiceStub(channel).Session(iter([pb.DrafterRequest(open=open_)]))
        with pytest.raises(grpc.RpcError) as err:
            list(stream)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and why in err.value.details()


@pytest.mark.parametrize("name", ["person", "phone", "choice"])
def test_split_equals_colocated_constrained_ar(engine, split, name):
    c = constraints()[name]
    assert split.verifier.constrains
    prompt = engine.codec.encode(PROMPTS[0])
    ar = engine.generate(Request(prompt, max_tokens=64, block_size=1, constraint=c))
    for b in (1, 8):
        got = split.generate(Request(prompt, max_tokens=64, block_size=b, constraint=c))
        assert got.token_ids == ar.token_ids, (name, b)
    # the drafter's ranks travel (Open.ranked, Drafted.ranked_ids): the split drafts the colocated blocks
    here = engine.generate(Request(prompt, max_tokens=64, block_size=8, constraint=c))
    assert [(x.drafted, x.accepted) for x in got.blocks] == [(x.drafted, x.accepted) for x in here.blocks]
