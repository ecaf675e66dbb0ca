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


def test_a_grammar_past_llguidances_budget_is_the_requests_own_refusal_on_the_split(demo_pair, served, monkeypatch):
    """A regex bomb (``X{99999997}``: seconds of lexer, then "too many expressions constructed" once a token is
    taken) on the split: a 400 naming the public field over HTTP, INVALID_ARGUMENT naming it over gRPC -- refused
    by the orchestrator's check, one step into the grammar, before any session opens; and, where a verifier meets
    it itself (a client of its own, or a check that let it by), the verifier's INVALID_ARGUMENT naming
    ``constraint``, which the orchestrator names as the public field -- never "verifier failed" (INTERNAL)."""
    import json
    import urllib.error
    import urllib.request

    import grpc

    from kakeya.core import constraints as core_constraints
    from kakeya.orchestrator.assembly import split_engine
    from kakeya.orchestrator.fronts.grpc_server import GenerationServicer
    from kakeya.orchestrator.fronts.http_server import HttpCall, HttpFront
    from kakeya.wire.kakeya.v1 import generate_pb2 as gpb
    from kakeya.wire.kakeya.v1 import verifier_pb2 as vpb
    from kakeya.wire.kakeya.v1 import verifier_pb2_grpc

    # the verifier alone, opened with a bomb by a client that never checked it
    opened = vpb.VerifierRequest.Open(target_layer_ids=[1])
    opened.constraint.regex = "d{99999995}"
    steps = [
        vpb.VerifierRequest(open=opened),
        vpb.VerifierRequest(prefill=vpb.VerifierRequest.Prefill(token_ids=[2, 40])),
    ]
    with grpc.insecure_channel(served) as channel, pytest.raises(grpc.RpcError) as err:
        list(verifier_pb2_grpc.VerifierServiceStub(channel).Session(iter(steps), timeout=120))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
    assert err.value.details().startswith("constraint: the constraint cannot be followed: "), err.value.details()

    servicer = GenerationServicer(
        lambda: split_engine(served, served, str(demo_pair.target), wait_s=60), colocated=False
    )
    servicer.load()
    servicer.ready = True
    http = HttpFront(servicer, 0, "demo")
    base = f"http://127.0.0.1:{http.start('127.0.0.1')}"

    def post(body: dict) -> tuple[int, dict]:
        request = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(),
                                         {"content-type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=120) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    class Aborted(Exception):
        pass

    class Context(HttpCall):
        def abort(self, code, details):
            self.code, self.details = code, details
            raise Aborted(details)

        def invocation_metadata(self):
            return ()

        def send_initial_metadata(self, metadata):  # grpc's: Generate sends the request id in it
            self.sent_metadata = metadata

        set_trailing_metadata = send_initial_metadata  # and in its trailers

    try:
        for regex, checked in (("e{99999994}", True), ("f{99999993}", False)):
            if not checked:  # the check lets it by: the sessions meet the budget as they run
                monkeypatch.setattr(core_constraints, "check", lambda grammar, tok: None)
            status, answer = post({"prompt": "x", "max_tokens": 4, "guided_regex": regex})
            assert status == 400 and answer["error"]["param"] == "guided_regex", answer
            assert answer["error"]["message"].startswith("guided_regex: the constraint cannot be followed: "), answer
            req = gpb.GenerateRequest(text="x", sampling_params=gpb.SamplingParams(max_tokens=4, temperature=0))
            req.constraint.regex = regex
            context = Context()
            with pytest.raises(Aborted):
                list(servicer.Generate(req, context))
            assert context.code == grpc.StatusCode.INVALID_ARGUMENT
            assert context.details.startswith("constraint.regex: the constraint cannot be followed: "), context.details
        status, answer = post({"prompt": "x", "max_tokens": 4, "guided_regex": "[a-c]+"})
        assert status == 200, answer  # still serving
    finally:
        http.drain()
        http.join(5)
