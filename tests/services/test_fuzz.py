"""Property-based requests against every RPC: never INTERNAL or UNKNOWN, never a crash, always a clear status.

Real servers (verifier, drafter, split orchestrator); ``hypothesis`` draws
random fields, sizes, message orders, malformed tensors and raw bytes. Each
property: at most 60 examples (derandomized: the same ones every run), a
deadline on every call; afterwards a good request still succeeds and every
process is still alive.
"""

from __future__ import annotations

import json
import re

import grpc
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kakeya.core.constraints import valid_unicode
from kakeya.wire.kakeya.v1 import cache_pb2, drafter_pb2, generate_pb2, tensor_pb2, verifier_pb2

from .. import fuzz_shapes as shapes
from .conftest import TINY_MLX, channel, drafter_stub, generate, generation_stub, request, start_all, verifier_stub

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CLEAR = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.UNIMPLEMENTED,
}
FUZZ = settings(
    max_examples=60, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)  # fmt: skip
PROMPT = [2, 40, 41, 42, 43]

i32 = st.one_of(st.integers(-3, 40), st.sampled_from([-(2**31), 2**31 - 1, 1024, 4097, 10**6]))
ids = st.lists(st.one_of(st.integers(0, 1023), i32), max_size=24)


@pytest.fixture(scope="module")
def servers(server_factory):
    v = server_factory("verifier", ["verifier", *TINY_MLX, "--max-context", "2048", "--grace", "1"])
    d = server_factory("drafter", ["drafter", *TINY_MLX, "--grace", "1"])
    start_all([v, d])
    o = server_factory(
        "orchestrator",
        [
            "orchestrator",
            "--verifier",
            v.addr,
            "--drafter",
            d.addr,
            "--max-tokens-limit",
            "64",
            "--default-max-tokens",
            "8",
            "--grace",
            "1",
        ],
    )
    start_all([o])
    yield {"verifier": v, "drafter": d, "orchestrator": o}
    for s in (v, d, o):
        assert s.alive(), f"{s.name} died:\n{s.log()}"
    ids_, _, complete, _ = generate(o.addr, request(PROMPT, max_tokens=8))
    assert len(ids_) == 8 and not complete.stats.drafter_fallback


def _clear(exc: grpc.RpcError):
    assert exc.code() in CLEAR, (exc.code(), exc.details())
    assert exc.details(), "a status without a message"


policies = st.builds(
    cache_pb2.CachePolicy,
    kind=st.integers(0, 4), sink=i32, window=i32, slack=i32,
    full_kv_bits=st.sampled_from([0, 1, 4, 8, 16]), full_kv_group_size=st.sampled_from([0, 16, 32, 64, 128, 7]),
    restore_path=st.sampled_from(["", "default", "/etc", "x" * 300]),
)  # fmt: skip


@st.composite
def generate_requests(draw):
    req = generate_pb2.GenerateRequest(
        request_id=draw(st.one_of(st.just(""), st.text(max_size=40), st.text(alphabet="abc-_9", max_size=140))),
        block_size=draw(i32),
    )
    if draw(st.booleans()):
        req.text = draw(st.text(max_size=200))
    elif draw(st.booleans()):
        req.tokenized.ids.extend(draw(ids))
        req.tokenized.SetInParent()
    else:
        req.tokenized.ids.extend([7] * draw(st.sampled_from([0, 1, 9000, 20000])))
    sp = req.sampling_params
    sp.temperature = draw(st.sampled_from([0.0, 0.0, -1.0, 0.5, float("nan"), float("inf")]))
    sp.top_p = draw(st.sampled_from([0.0, 1.0, 0.5, -2.0, float("nan")]))
    sp.top_k = draw(st.sampled_from([0, 1, 5, -1]))
    sp.max_tokens = draw(st.one_of(st.integers(-2, 12), st.sampled_from([65, 2**31 - 1, -(2**31)])))
    sp.stop.extend(draw(st.lists(st.text(max_size=5), max_size=3)))
    sp.stop_token_ids.extend(draw(st.lists(i32, max_size=4)))
    sp.ignore_eos = draw(st.booleans())
    if draw(st.booleans()):
        req.cache_policy.CopyFrom(draw(policies))
    return req


def test_fuzz_generate(servers):
    addr = servers["orchestrator"].addr
    stub = generation_stub(addr)

    @FUZZ
    @given(generate_requests())
    def prop(req):
        try:
            out = list(stub.Generate(req, timeout=30))
        except grpc.RpcError as exc:
            _clear(exc)
            return
        complete = out[-1].complete
        assert complete.finish_reason != generate_pb2.FINISH_REASON_ERROR, complete.error_message

    prop()


def _names_a_field(details: str) -> bool:
    """Whether ``details`` opens with a path of GenerateRequest's own fields (the proto's names, oneof names
    too: ``prompt.messages.messages[1].tool_calls[0].arguments_json``), then ": "."""
    path, sep, _ = details.partition(": ")
    message = generate_pb2.GenerateRequest.DESCRIPTOR
    for part in path.split(".") if sep else ["-"]:
        name = re.sub(r"\[\d+\]$", "", part)
        if message is None:
            return False
        if name in message.oneofs_by_name:
            continue
        if name not in message.fields_by_name:
            return False
        message = message.fields_by_name[name].message_type
    return True


PLAIN = st.text(max_size=8)  # a proto string is UTF-8: lone surrogates travel escaped inside JSON texts
JSON_TEXTS = st.builds(json.dumps, shapes.VALUES) | st.sampled_from(["", "{", "[" * 5000, '{"a": "\\ud800"}', "NaN"])


@st.composite
def chat_requests(draw):
    """A GenerateRequest with a chat (messages, tool turns, tools, a tool choice), a constraint and logprobs,
    each near its valid shape (``tests/fuzz_shapes.py``)."""
    req = generate_pb2.GenerateRequest(sampling_params=generate_pb2.SamplingParams(max_tokens=draw(st.integers(0, 3))))
    chat = req.messages
    for _ in range(draw(shapes.mostly(st.integers(1, 3), st.just(0)))):
        role = draw(shapes.mostly(st.sampled_from(["user", "assistant", "tool", "system"]), PLAIN))
        m = chat.messages.add(role=role, content=draw(PLAIN))
        if role == "assistant" and draw(st.booleans()):
            args = draw(shapes.mostly(st.builds(json.dumps, st.dictionaries(shapes.KEYS, shapes.VALUES, max_size=2)),
                                      JSON_TEXTS, 4))  # fmt: skip
            m.tool_calls.add(
                id=draw(shapes.mostly(st.just("call_1"), PLAIN)), name=draw(shapes.NAMES), arguments_json=args
            )
        if role == "tool":
            m.tool_call_id = draw(st.just("call_1") | PLAIN)
    for _ in range(draw(st.integers(0, 2))):
        params = draw(shapes.mostly(st.builds(json.dumps, shapes.OBJECT_SCHEMAS), JSON_TEXTS | st.just(""), 6))
        chat.tools.add(name=draw(shapes.NAMES), description=draw(PLAIN), parameters_json=params,
                       strict=draw(st.booleans()))  # fmt: skip
    choice = draw(st.sampled_from(["unset", "mode", "mode", "function"]))
    if choice == "mode":
        chat.tool_choice.mode = draw(shapes.mostly(st.integers(0, 3), st.sampled_from([7, -1])))
    elif choice == "function":
        declared = st.sampled_from([t.name for t in chat.tools] or ["f"])
        chat.tool_choice.function = draw(shapes.mostly(declared, shapes.NAMES, 4))
    chat.SetInParent()
    kinds = ["json_schema", "json_object", "regex", "choice", "grammar"]
    kind = draw(shapes.mostly(st.just("none"), st.sampled_from(kinds), 3))
    if kind == "json_schema":
        req.constraint.json_schema = draw(st.builds(json.dumps, shapes.SCHEMAS) | JSON_TEXTS)
    elif kind == "json_object":
        req.constraint.json_object = draw(shapes.mostly(st.just(True), st.just(False), 4))
    elif kind == "regex":
        req.constraint.regex = draw(shapes.REGEXES.filter(valid_unicode))
    elif kind == "choice":
        req.constraint.choice.choices.extend(draw(st.lists(PLAIN, max_size=3)))
    elif kind == "grammar":
        req.constraint.grammar = draw(shapes.GRAMMARS.filter(valid_unicode))
    if draw(st.booleans()):
        req.sampling_params.logprobs = draw(st.integers(-1, 25) | st.sampled_from([2**31 - 1, -(2**31)]))
    return req


def test_fuzz_generate_chat_tools_constraints_and_logprobs(servers):
    """Chats with tools, tool choices and tool turns, constraints and logprobs near their valid shapes: answered
    (never FINISH_REASON_ERROR) or refused with a clear status; an INVALID_ARGUMENT names a field of
    GenerateRequest as the proto spells it, never an HTTP parameter or a Request field."""
    stub = generation_stub(servers["orchestrator"].addr)

    @settings(FUZZ, max_examples=300)
    @given(chat_requests())
    def prop(req):
        try:
            out = list(stub.Generate(req, timeout=60))
        except grpc.RpcError as exc:
            _clear(exc)
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                assert _names_a_field(exc.details()), exc.details()
            return
        complete = out[-1].complete
        assert complete.finish_reason != generate_pb2.FINISH_REASON_ERROR, complete.error_message

    prop()


def test_fuzz_raw_bytes_on_every_public_method(servers):
    ch = channel(servers["orchestrator"].addr)
    gen = ch.unary_stream("/kakeya.v1.Generation/Generate", request_serializer=None, response_deserializer=None)
    info = ch.unary_unary("/kakeya.v1.Generation/GetModelInfo", request_serializer=None, response_deserializer=None)

    @FUZZ
    @given(st.binary(max_size=64), st.booleans())
    def prop(raw, use_info):
        try:
            if use_info:
                info(raw, timeout=10)
            else:
                list(gen(raw, timeout=30))
        except grpc.RpcError as exc:
            _clear(exc)

    prop()


V = verifier_pb2.VerifierRequest
verifier_messages = st.one_of(
    st.builds(lambda p, layers, mp, rid: V(open=V.Open(cache_policy=p, target_layer_ids=layers, max_positions=mp, request_id=rid)),
              policies, st.lists(st.integers(-1, 7), max_size=3), i32, st.sampled_from(["", "ok-id", "é", "x" * 200])),
    st.builds(lambda t: V(prefill=V.Prefill(token_ids=t)), ids),
    st.builds(lambda t: V(verify=V.Verify(block_ids=t)), ids),
    st.just(V(close=V.Close())),
    st.just(V()),
)  # fmt: skip
good_open = V(open=V.Open())


def test_fuzz_verifier_session(servers):
    stub = verifier_stub(servers["verifier"].addr)

    @FUZZ
    @given(st.booleans(), st.lists(verifier_messages, max_size=6))
    def prop(open_first, msgs):
        msgs = ([good_open, V(prefill=V.Prefill(token_ids=PROMPT))] if open_first else []) + msgs
        try:
            list(stub.Session(iter(msgs), timeout=20))
        except grpc.RpcError as exc:
            _clear(exc)

    prop()


D = drafter_pb2.DrafterRequest
tensors = st.builds(
    tensor_pb2.Tensor,
    dtype=st.integers(0, 10),
    shape=st.lists(st.one_of(st.integers(0, 4), st.sampled_from([128, 2**40, -1])), max_size=3),
    data=st.one_of(st.binary(max_size=64), st.builds(lambda n: bytes(n), st.sampled_from([0, 512, 1024, 2048]))),
)
drafter_messages = st.one_of(
    st.just(D(open=D.Open())),
    st.builds(lambda t, last, b: D(draft=D.Draft(new_aux=t, last_token=last, block_size=b)), tensors, i32, i32),
    st.just(D(close=D.Close())),
    st.just(D()),
)


def test_fuzz_drafter_session(servers):
    stub = drafter_stub(servers["drafter"].addr)
    info = stub.GetInfo(drafter_pb2.GetDrafterInfoRequest(), timeout=10)
    width = len(info.target_layer_ids) * info.hidden_size
    well_formed = st.builds(  # right shape and size, random values (NaN and inf included)
        lambda n, fill, last, b: D(draft=D.Draft(
            new_aux=tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_FLOAT32, shape=[n, width], data=fill * (n * width)),
            last_token=last, block_size=b)),
        st.integers(0, 3), st.sampled_from([b"\x00\x00\x80\x7f", b"\x00\x00\xc0\x7f", b"\x00\x00\x80?"]),
        st.integers(0, 1023), st.integers(0, 17),
    )  # fmt: skip

    @FUZZ
    @given(st.booleans(), st.lists(st.one_of(drafter_messages, well_formed), max_size=5))
    def prop(open_first, msgs):
        msgs = ([D(open=D.Open())] if open_first else []) + msgs
        try:
            list(stub.Session(iter(msgs), timeout=20))
        except grpc.RpcError as exc:
            _clear(exc)

    prop()
