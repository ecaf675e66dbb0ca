"""Tool calls on the public gRPC API: ``ChatMessages.tool_choice`` and the parsed calls of ``Complete``.

Two servers on loopback, each a real gRPC server (``add_servicer``, as ``kakeya serve`` registers it) called
through the generated stub. The tiny pair, colocated, also behind the HTTP front: ``required`` and a named
function hold the (untrained) model to calls whose arguments follow their schemas, and the gRPC answer is the
HTTP answer for the same request, token for token and call for call; refusals name the gRPC field. And a
planted service (``test_http_tools.Planted``: a text the test chose, in blocks it chose) in the place of the
generation service, for calls an untrained model never writes under ``auto``, and ``none``.
"""

from __future__ import annotations

import json
from concurrent import futures

import grpc
import pytest

from kakeya.app.main import main
from kakeya.orchestrator.assembly import build_local_engine
from kakeya.orchestrator.fronts.grpc_server import GenerationServicer
from kakeya.orchestrator.fronts.http_server import HttpFront
from kakeya.runtime.security.guard import add_servicer
from kakeya.wire.kakeya.v1 import generate_pb2 as pb
from kakeya.wire.kakeya.v1 import generate_pb2_grpc
from kakeya.wire.kakeya.v1 import sampling_pb2 as spb

from .test_http_tools import ARGS, CALL, FLAG, USER, WEATHER, Planted, _client

SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, FLAG)}


def _serve(servicer):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    add_servicer(server, servicer, pb.DESCRIPTOR.services_by_name["Generation"])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def _request(tools=(WEATHER, FLAG), mode=None, function=None, max_tokens=120, **extra) -> pb.GenerateRequest:
    req = pb.GenerateRequest(sampling_params=pb.SamplingParams(temperature=0, max_tokens=max_tokens), **extra)
    for m in USER:
        req.messages.messages.add(role=m["role"], content=m["content"])
    for t in tools:
        f = t["function"]
        req.messages.tools.add(name=f["name"], description=f.get("description", ""),
                               parameters_json=json.dumps(f["parameters"]))  # fmt: skip
    if mode is not None:
        req.messages.tool_choice.mode = mode
    if function is not None:
        req.messages.tool_choice.function = function
    return req


def _generate(addr: str, req: pb.GenerateRequest) -> tuple[list[int], str, pb.GenerateResponse.Complete]:
    """The chunks' token ids and text, and the Complete."""
    with grpc.insecure_channel(addr) as channel:
        answers = list(generate_pb2_grpc.GenerationStub(channel).Generate(req, timeout=120))
    chunks = [a.chunk for a in answers if a.HasField("chunk")]
    assert answers[-1].HasField("complete") and len(chunks) == len(answers) - 1
    return [t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks), answers[-1].complete


def _refused(addr: str, req: pb.GenerateRequest) -> str:
    with pytest.raises(grpc.RpcError) as err:
        _generate(addr, req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
    return err.value.details()


# --------------------------------------------------------------------------- the tiny pair, for real


@pytest.fixture(scope="module")
def real(tiny_pair):
    servicer = GenerationServicer(
        lambda: build_local_engine(str(tiny_pair.target), str(tiny_pair.draft), "mlx"), colocated=True
    )
    servicer.load()
    servicer.ready = True
    server, addr = _serve(servicer)
    http = HttpFront(servicer, 0, "tiny")
    port = http.start("127.0.0.1")
    yield servicer, addr, f"http://127.0.0.1:{port}"
    http.drain()
    http.join(5)
    server.stop(None)


@pytest.mark.parametrize(
    ("mode", "function", "http_choice"),
    [(pb.TOOL_CHOICE_MODE_REQUIRED, None, "required"),
     (None, "set_flag", {"type": "function", "function": {"name": "set_flag"}})],
)  # fmt: skip
def test_a_forced_call_comes_back_parsed_as_the_http_front_returns_it(real, mode, function, http_choice):
    """required / a named function: Complete.tool_calls hold calls whose arguments validate against their
    schemas, finish TOOL_CALLS; the tokens, calls and content are the HTTP answer's for the same request."""
    import jsonschema

    _, addr, base = real
    ids, text, complete = _generate(addr, _request(mode=mode, function=function))
    assert complete.finish_reason == pb.FINISH_REASON_TOOL_CALLS and complete.tool_calls, complete
    for c in complete.tool_calls:
        assert c.id.startswith("call_")
        jsonschema.validate(json.loads(c.arguments_json), SCHEMAS[c.name])
    if function is not None:
        assert [c.name for c in complete.tool_calls] == ["set_flag"]  # exactly one call, of the function named
    assert "<|tool_call>call:" in text and complete.HasField("content")  # chunks: the raw text
    r = _client(base).chat.completions.create(model="tiny", messages=USER, tools=[WEATHER, FLAG],
                                              tool_choice=http_choice, max_tokens=120, temperature=0)  # fmt: skip
    choice = r.choices[0]
    assert ids == r.model_extra["kakeya"]["token_ids"] and choice.finish_reason == "tool_calls"
    assert [(c.name, json.loads(c.arguments_json)) for c in complete.tool_calls] == [
        (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls
    ]
    assert complete.content == (choice.message.content or "")


def test_none_and_a_tool_less_chat_read_no_calls(real):
    _, addr, _ = real
    for req in (_request(mode=pb.TOOL_CHOICE_MODE_NONE, max_tokens=6), _request(tools=(), max_tokens=6)):
        req.sampling_params.ignore_eos = True
        _, text, complete = _generate(addr, req)
        assert not complete.tool_calls and not complete.HasField("content")
        assert complete.finish_reason == pb.FINISH_REASON_LENGTH and text


def test_a_chat_whose_calls_are_read_is_refused_resuming_by_name(real):
    """Complete.tool_calls and content are read out of the generation's text, and a resumed stream's holds only
    what follows resume_token_ids: a chat whose calls are read (tools, tool_choice auto) cannot resume exactly
    and is refused naming the field, as a constrained one; under none (no call read) it resumes exactly."""
    _, addr, _ = real
    forced, text, _ = _generate(addr, _request(mode=pb.TOOL_CHOICE_MODE_REQUIRED))
    assert text.startswith("<|tool_call>call:")
    auto = _request()  # tools, tool_choice unset: auto
    auto.resume_token_ids.extend(forced[:8])  # a call begun before the stream broke
    assert _refused(addr, auto).startswith("resume_token_ids: "), "its call would be missing from Complete"
    none = _request(mode=pb.TOOL_CHOICE_MODE_NONE, max_tokens=24)
    none.sampling_params.ignore_eos = True
    whole, _, _ = _generate(addr, none)
    none.resume_token_ids.extend(whole[:8])
    assert _generate(addr, none)[0] == whole[8:]


def _tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


PATTERN = {"type": "function", "function": {"name": "f", "parameters": {  # a keyword the grammar cannot hold
    "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}  # fmt: skip
BAD = [
    (dict(tools=(), mode=pb.TOOL_CHOICE_MODE_REQUIRED), "prompt.messages.tool_choice.mode: 'required' needs tools"),
    (dict(tools=(), mode=pb.TOOL_CHOICE_MODE_AUTO), "prompt.messages.tool_choice.mode: 'auto' needs tools"),
    (dict(mode=9), "prompt.messages.tool_choice.mode: unknown value 9"),
    (dict(function="nope"), "prompt.messages.tool_choice.function: names 'nope', which is not one of the tools"),
    (dict(tools=(), function="nope"), "prompt.messages.tool_choice.function: names 'nope'"),
    (dict(tools=(WEATHER | {"function": WEATHER["function"] | {"name": "auto"}},), function="auto"),
     "prompt.messages.tool_choice.function: a function named 'auto' cannot be chosen by name"),
    (dict(tools=(PATTERN,), mode=pb.TOOL_CHOICE_MODE_REQUIRED),
     "prompt.messages.tools[0].parameters_json: properties.a.uniqueItems: unique items cannot be held"),
    (dict(tools=(WEATHER, _tool("f", {"properties": {"a": {"anyOf": 5}}})), function="f"),
     "prompt.messages.tools[1].parameters_json: properties.a.anyOf: must be a non-empty list of schemas"),
    (dict(tools=(_tool("f", {"type": "array"}),)),
     'prompt.messages.tools[0].parameters_json: must be a JSON schema of "type": "object"'),
    (dict(tools=(_tool("f", {"required": 5}),), mode=pb.TOOL_CHOICE_MODE_NONE),
     "prompt.messages.tools[0].parameters_json: required: must be a list of strings"),
    (dict(tools=(_tool("f", {"properties": []}),)),
     "prompt.messages.tools[0].parameters_json: properties: must be an object"),
    (dict(tools=(_tool("bad name", {}),)), "prompt.messages.tools[0].name: must be 1-64 letters"),
    (dict(tools=(WEATHER, WEATHER)), "prompt.messages.tools[1].name: 'get_weather' is declared twice"),
    (dict(mode=pb.TOOL_CHOICE_MODE_REQUIRED, constraint=spb.Constraint(json_object=True)),
     "constraint: tool_choice 'required' constrains the output already"),
    (dict(function="set_flag", constraint=spb.Constraint(regex="a+")),
     "constraint: tool_choice 'set_flag' constrains the output already"),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "says"), BAD)
def test_a_bad_tool_choice_is_invalid_argument_naming_the_field_and_the_server_goes_on(real, fields, says):
    _, addr, _ = real
    details = _refused(addr, _request(**fields))
    assert details.startswith(says), details
    if "uniqueItems" in json.dumps(fields.get("tools", "")):
        assert "uniqueItems" in details  # the schema keyword the grammar cannot hold, by name
    _, _, complete = _generate(addr, _request(mode=pb.TOOL_CHOICE_MODE_REQUIRED))
    assert complete.finish_reason == pb.FINISH_REASON_TOOL_CALLS  # still serving


@pytest.mark.parametrize(("role", "field"), [("user", "tool_call_id"), ("assistant", "tool_call_id")])
def test_a_tool_messages_own_fields_on_another_role_are_refused_by_name(real, role, field):
    """``ChatMessage.tool_call_id`` is a "tool" message's (generate.proto): on another role's message the template
    never sees it, so it is refused naming the field rather than dropped without a word (``name`` is any
    participant's: the template gets it, test_http_front's ``test_a_messages_name_reaches_the_template...``)."""
    _, addr, _ = real
    req = _request(mode=pb.TOOL_CHOICE_MODE_NONE, max_tokens=4)
    req.messages.messages.insert(0, pb.ChatMessage(role=role, content="x", **{field: "call_1"}))
    assert _refused(addr, req).startswith(f"prompt.messages.messages[0].{field}: "), req
    _, _, complete = _generate(addr, _request(mode=pb.TOOL_CHOICE_MODE_NONE, max_tokens=4))
    assert complete.completion_tokens == 4  # still serving


def test_any_tool_choice_is_answered_or_refused_by_name_never_an_internal_error(real):
    """Fuzzed: modes (unknown values too), names (declared, undeclared, a mode's), tools and a constraint."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    _, addr, _ = real
    stub = generate_pb2_grpc.GenerationStub(grpc.insecure_channel(addr))
    names = st.sampled_from(["", "set_flag", "get_weather", "f", "auto", "none", "required", "x" * 80, "\u00e9"])

    @settings(max_examples=30, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip
    @given(st.lists(st.sampled_from([WEATHER, FLAG, PATTERN]), max_size=3), st.one_of(st.none(), st.integers(-1, 6)),
           st.one_of(st.none(), names), st.booleans())  # fmt: skip
    def prop(tools, mode, function, constrained):
        req = _request(tools=tools, mode=mode, function=function, max_tokens=8)
        if constrained:
            req.constraint.regex = "a+"
        try:
            complete = list(stub.Generate(req, timeout=60))[-1].complete
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (exc.code(), exc.details())
            assert exc.details().startswith(("prompt.messages.", "constraint")), exc.details()
            return
        assert complete.finish_reason != pb.FINISH_REASON_ERROR, complete.error_message
        assert complete.HasField("content") == (bool(tools) and req.messages.tool_choice.mode != 2)

    prop()


def test_the_http_front_refuses_the_same_choices_with_the_same_words(real):
    """One validation for both fronts (``tool_choice.py``): the HTTP front's 400s say what gRPC's say."""
    import openai

    _, _, base = real
    named_auto = WEATHER | {"function": WEATHER["function"] | {"name": "auto"}}
    cases = [
        ({"tools": [named_auto], "tool_choice": {"type": "function", "function": {"name": "auto"}}}, "tool_choice",
         "tool_choice: a function named 'auto' cannot be chosen by name"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format", "response_format: tool_choice 'required' constrains the output already"),
    ]  # fmt: skip
    for extra, param, says in cases:
        with pytest.raises(openai.BadRequestError) as err:
            _client(base).chat.completions.create(model="tiny", messages=USER, max_tokens=4, **extra)
        assert err.value.body["param"] == param and err.value.body["message"] == says, err.value.body


def test_client_generate_sends_tools_and_prints_the_parsed_calls(real, tmp_path, capsys):
    """``kakeya client generate --chat --tools FILE --tool-choice NAME``: the calls under ``tool_calls``."""
    import jsonschema

    _, addr, _ = real
    path = tmp_path / "tools.json"
    path.write_text(json.dumps([WEATHER, FLAG]))
    base = ["client", "--addr", addr, "generate", "--chat", "--prompt", USER[0]["content"], "--max-tokens", "120",
            "--temperature", "0", "--tools", str(path)]  # fmt: skip
    assert main([*base, "--tool-choice", "set_flag", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["finish_reason"] == "tool_calls" and [c["name"] for c in out["tool_calls"]] == ["set_flag"]
    jsonschema.validate(out["tool_calls"][0]["arguments"], SCHEMAS["set_flag"])
    assert "<|tool_call>call:set_flag" in out["text"] and "<|tool_call>" not in out["content"]
    assert main([*base, "--tool-choice", "required"]) == 0
    printed = capsys.readouterr()
    assert "\ntool call call_" in printed.out and "(tool_calls)" in printed.err
    assert main([*base, "--tool-choice", "nope"]) == 1
    assert "INVALID_ARGUMENT: prompt.messages.tool_choice.function: names 'nope'" in capsys.readouterr().err
    over = [*base[:-2], "--max-tokens", "999999"]  # refused by the server's limit, once the request has its id
    assert main(over) == 1
    err = capsys.readouterr().err  # the id the server made up and logged it under, from the call's trailers
    assert "INVALID_ARGUMENT: sampling_params.max_tokens" in err and "(request id " in err, err
    assert main([*over, "--request-id", "cli-refused-1"]) == 1
    assert capsys.readouterr().err.rstrip().endswith("(request id cli-refused-1)")  # what to quote to the operator
    assert main(["client", "--addr", addr, "generate", "--tools", str(path)]) == 2  # tools need --chat
    assert "--tools and --tool-choice need --chat" in capsys.readouterr().err


def test_client_generate_refuses_bad_tools_naming_the_flag(capsys):
    assert main(["client", "generate", "--chat", "--tools", '[{"type": "function"}]']) == 2
    assert "--tools: tools[0]" in capsys.readouterr().err
    assert main(["client", "generate", "--chat", "--tools", "{nope"]) == 2
    assert "--tools: not JSON" in capsys.readouterr().err


# --------------------------------------------------------------------------- planted calls


class _PlantedServicer(GenerationServicer):
    """The gRPC front over a planted generation service: what the text holds is the test's choice."""

    def __init__(self):
        super().__init__(lambda: None, colocated=False)
        self.planted = Planted()
        self.ready = True

    def stream(self, req, call):
        return self.planted.stream(req, call)


@pytest.fixture(scope="module")
def planted():
    servicer = _PlantedServicer()
    server, addr = _serve(servicer)
    yield servicer.planted, addr
    server.stop(None)


def test_auto_reads_the_calls_out_of_the_text_whatever_the_blocks(planted):
    service, addr = planted
    service.text, service.sizes, service.finish = "Let me look. " + CALL + CALL.replace("Paris", "Rome"), (3,), "stop"
    _, text, complete = _generate(addr, _request(tools=(WEATHER,)))
    assert text == service.text  # the chunks: the raw text
    assert complete.finish_reason == pb.FINISH_REASON_TOOL_CALLS and complete.content == "Let me look. "
    assert [(c.name, json.loads(c.arguments_json)) for c in complete.tool_calls] == [
        ("get_weather", ARGS), ("get_weather", ARGS | {"city": "Rome, <é>{x}"})]  # fmt: skip
    assert len({c.id for c in complete.tool_calls}) == 2
    req = service.requests[-1]
    assert req.prompt.tool_choice == "auto" and req.stop_strings == ()  # as the HTTP front's: the checks add theirs


def test_none_hands_the_text_back_as_it_is(planted):
    service, addr = planted
    service.text, service.sizes, service.finish = CALL, (4,), "stop"
    _, text, complete = _generate(addr, _request(tools=(WEATHER,), mode=pb.TOOL_CHOICE_MODE_NONE))
    assert text == CALL and not complete.tool_calls and not complete.HasField("content")
    assert complete.finish_reason == pb.FINISH_REASON_STOP
    assert "<|tool_response>" not in service.requests[-1].stop_strings


@pytest.mark.parametrize(
    ("text", "finish", "reason"),
    [("a <|tool_call>call:get_weather{city:", "length", pb.FINISH_REASON_LENGTH),
     ("<|tool_call>call:get_weather{city:Paris}<tool_call|>", "stop", pb.FINISH_REASON_STOP),
     ("no call", "stop", pb.FINISH_REASON_STOP),
     (CALL, "length", pb.FINISH_REASON_LENGTH)],
)  # fmt: skip
def test_tool_calls_is_the_finish_only_where_the_model_stopped_after_a_call(planted, text, finish, reason):
    service, addr = planted
    service.text, service.sizes, service.finish = text, (5,), finish
    _, _, complete = _generate(addr, _request(tools=(WEATHER,)))
    assert complete.finish_reason == reason
    calls = [(c.name, c.arguments_json) for c in complete.tool_calls]
    if text.startswith("a <|tool_call>"):  # cut by max_tokens: the call so far (issue 58), no template text
        assert calls == [("get_weather", '{"city": ')] and complete.content == "a "
        return
    calls = [(name, json.loads(args)) for name, args in calls]
    assert calls == ([("get_weather", ARGS)] if text == CALL else [])  # a malformed call stays content
    assert complete.content == ("" if text == CALL else text)


def test_a_marks_start_cut_after_a_call_is_no_content(planted):
    """As the HTTP answer (``test_http_tools``): cut by max_tokens as the model opens the mark after its call,
    ``Complete.content`` holds no "<|tool_re" (under a held choice no text outside the calls is content)."""
    service, addr = planted
    service.text, service.sizes, service.finish = CALL + "<|tool_re", (5,), "length"
    for mode in (None, pb.TOOL_CHOICE_MODE_REQUIRED):
        _, text, complete = _generate(addr, _request(tools=(WEATHER,), mode=mode))
        assert text == service.text and complete.content == "" and len(complete.tool_calls) == 1


def test_the_most_stop_strings_are_taken_with_tools_too(real):
    """As over HTTP (``test_http_tools``): the results mark a chat with tools stops at is the server's, so 16
    ``sampling_params.stop`` strings are taken with tools and a 17th is refused, counting the client's."""
    _, addr, _ = real
    req = _request(max_tokens=2)
    req.sampling_params.stop.extend(f"zq{i}" for i in range(16))
    assert _generate(addr, req)[2].completion_tokens <= 2
    req.sampling_params.stop.append("zq")
    assert "17 strings, at most 16" in _refused(addr, req)


def test_client_generate_prints_a_cut_call_as_its_arguments_so_far(real, tmp_path, capsys):
    """Found driving the demo pair: ``kakeya client generate --tool-choice required`` with a call cut by
    ``--max-tokens`` printed ``kakeya: error: Expecting property name enclosed in double quotes`` and exited 1: it
    parsed the cut call's ``arguments_json`` as JSON. A cut call's arguments are the JSON text so far (as the HTTP
    answer's ``arguments``), printed as that text; a whole call's, as before, its object."""
    servicer, addr, _ = real
    path = tmp_path / "tools.json"
    path.write_text(json.dumps([FLAG]))
    argv = ["client", "--addr", addr, "generate", "--chat", "--prompt", USER[0]["content"], "--temperature", "0",
            "--tools", str(path), "--tool-choice", "set_flag", "--json", "--max-tokens"]  # fmt: skip
    assert main([*argv, "120"]) == 0
    whole = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ids, decode = whole["token_ids"], servicer.engine.codec.decode
    cut = next(m for m in range(len(ids)) if decode(ids[:m]).endswith(("set_flag{h", "set_flag{u")))
    assert main([*argv, str(cut)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    [call] = out["tool_calls"]
    assert out["finish_reason"] == "length" and isinstance(call["arguments"], str)
    assert json.dumps(whole["tool_calls"][0]["arguments"]).startswith(call["arguments"]) and call["arguments"]
