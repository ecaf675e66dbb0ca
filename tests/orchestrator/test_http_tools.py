"""Tool calls on the HTTP front (``http_params.py``, ``tools/calls.py``, ``http_api.Answer``) with the official client.

Two fronts. The tiny pair, colocated and real: a request with tools and a tool-call history renders through
the checkpoint's template (its prompt holds the declaration and the call, in Gemma-4's syntax) and its text
comes back as content -- the tiny models were never trained to call a tool, so no real run here writes one.
So the calls themselves are planted: :class:`Planted` stands at the front's boundary in the place of the
generation service (``servicer.stream``) and commits a text the test chose, in blocks of the sizes it chose;
everything from the request's body to the answer's JSON and server-sent events is the front's own code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Literal

import pytest
from pydantic import BaseModel

from kakeya.core.generation import Block, Report
from kakeya.core.request import Chat, Request
from kakeya.orchestrator.assembly import build_local_engine
from kakeya.orchestrator.fronts.grpc_server import GenerationServicer
from kakeya.orchestrator.fronts.http_server import HttpCall, HttpFront
from kakeya.runtime.metrics import ServerMetrics
from kakeya.wire.kakeya.v1 import generate_pb2 as pb

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
CALL = '<|tool_call>call:get_weather{city:<|"|>Paris, <é>{x}<|"|>,unit:<|"|>c<|"|>}<tool_call|>'
ARGS = {"city": "Paris, <é>{x}", "unit": "c"}
USER = [{"role": "user", "content": "Weather in Paris?"}]


@dataclass
class Planted:
    """The generation service's place at the front: each request commits ``text`` in blocks of ``sizes``
    characters (cycled), then ends with ``finish``; the requests it was handed are kept."""

    text: str = ""
    sizes: tuple[int, ...] = (1,)
    finish: str = "stop"
    requests: list = field(default_factory=list)
    engine: object = True
    ready: bool = True
    auth_token: str | None = None
    metrics: ServerMetrics = field(default_factory=lambda: ServerMetrics("orchestrator"))  # counts its 4xx

    def stream(self, req: Request, call):
        self.requests.append(req)
        at, i = 0, 0
        while at < len(self.text):
            n = self.sizes[i % len(self.sizes)]
            block = Block(list(range(at, min(at + n, len(self.text)))), 0, 0)
            block.text = self.text[at : at + n]
            yield block
            at, i = at + n, i + 1
        yield Report("t", "d", "planted", (2,), tuple(range(len(self.text))), self.text, self.finish, 0)


@pytest.fixture(scope="module")
def planted():
    service = Planted()
    http = HttpFront(service, 0, "planted")
    port = http.start("127.0.0.1")
    yield service, f"http://127.0.0.1:{port}"
    http.drain()
    http.join(5)


def _client(base):
    from openai import OpenAI

    return OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)


def test_a_call_comes_back_as_tool_calls(planted):
    service, base = planted
    service.text, service.finish = "Let me look. " + CALL, "stop"
    r = _client(base).chat.completions.create(model="planted", messages=USER, tools=[WEATHER])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look. "
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == ARGS
    req = service.requests[-1]
    assert isinstance(req.prompt, Chat) and req.prompt.tools[0].name == "get_weather"
    assert (
        req.prompt.tool_choice == "auto" and req.stop_strings == ()
    )  # the client's stops; the checks add the server's


def test_two_calls_and_no_content(planted):
    service, base = planted
    service.text = CALL + CALL.replace("Paris", "Rome")
    r = _client(base).chat.completions.create(model="planted", messages=USER, tools=[WEATHER], tool_choice="auto")
    choice = r.choices[0]
    assert choice.message.content is None and choice.finish_reason == "tool_calls"
    assert [json.loads(c.function.arguments)["city"][:5] for c in choice.message.tool_calls] == ["Paris", "Rome,"]
    assert len({c.id for c in choice.message.tool_calls}) == 2


@pytest.mark.parametrize(
    ("text", "tools"),
    [(CALL, [WEATHER]), ("Sure. " + CALL, [WEATHER]), ("Sure.", None),
     ("\n" + CALL, [WEATHER])],
)  # fmt: skip
def test_the_sdks_streamed_message_is_the_whole_message(planted, text, tools):
    """The ``openai`` SDK's stream accumulator (``ChatCompletionStreamState``, behind ``chat.completions.stream``)
    joined a call-only answer's chunks to ``content: ""`` where the whole answer said ``null``: the opening chunk
    said ``content: ""`` and the last ``{"content": ""}``. As OpenAI's: the opening says null where calls are read,
    the last chunk's delta is empty, so the stream's message is the whole one's, content and calls. White space
    the model wrote before a call is content in both (the whole answer dropped it, the stream sent it)."""
    from openai.lib.streaming.chat import ChatCompletionStreamState

    service, base = planted
    service.text, service.sizes, service.finish = text, (5,), "stop"
    kw = {"model": "planted", "messages": USER} | ({"tools": tools} if tools else {})
    client, state = _client(base), ChatCompletionStreamState()
    chunks = list(client.chat.completions.create(**kw, stream=True))
    for chunk in chunks:
        state.handle_chunk(chunk)
    streamed, whole = state.get_final_completion().choices[0], client.chat.completions.create(**kw).choices[0]
    assert streamed.message.content == whole.message.content and streamed.finish_reason == whole.finish_reason
    calls = [
        [(c.function.name, c.function.arguments) for c in m.tool_calls or ()] for m in (streamed.message, whole.message)
    ]
    assert calls[0] == calls[1] and chunks[-1].choices[0].delta.model_dump(exclude_none=True) == {}


@pytest.mark.parametrize("sizes", [(1,), (2,), (3,), (5, 1), (7,), (13,), (1000,)])
def test_streamed_deltas_join_to_the_same_call_whatever_the_blocks(planted, sizes):
    service, base = planted
    service.text, service.sizes = "Sure. " + CALL + CALL.replace("Paris", "Oslo"), sizes
    stream = _client(base).chat.completions.create(model="planted", messages=USER, tools=[WEATHER], stream=True)
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            if d.id is not None:  # a call's first chunk: its id, type and name, arguments ""
                assert d.index not in calls and d.type == "function" and d.function.arguments == ""
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            else:
                calls[d.index]["arguments"] += d.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    assert content == "Sure. " and finish == "tool_calls"  # no piece of a marker leaked into the content
    assert [c["name"] for c in calls.values()] == ["get_weather"] * 2
    assert [json.loads(c["arguments"]) for c in calls.values()] == [ARGS, ARGS | {"city": "Oslo, <é>{x}"}]


@pytest.mark.parametrize("sizes", [(1,), (3,), (5, 1), (1000,)])
@pytest.mark.parametrize("held", ["required", "strict"])
def test_grammar_held_calls_stream_their_arguments_as_they_are_written(planted, sizes, held):
    """tool_choice required, or auto with a strict tool: every call is well-formed (a grammar holds it), so each one opens as soon as its
    name is written and its arguments follow block by block, as OpenAI streams them; joined, they are the
    whole answer's arguments, character for character."""
    service, base = planted
    service.text, service.sizes, service.finish = CALL + CALL.replace("Paris", "Oslo"), (1000,), "stop"
    kw = {"model": "planted", "messages": USER, "tools": [WEATHER], "tool_choice": "required"}
    if held == "strict":  # auto, with a strict tool
        kw |= {
            "tools": [{"type": "function", "function": WEATHER["function"] | {"strict": True}}],
            "tool_choice": "auto",
        }
    whole = _client(base).chat.completions.create(**kw).choices[0].message.tool_calls
    service.sizes = sizes
    calls, pieces, order = {}, 0, []
    for chunk in _client(base).chat.completions.create(**kw, stream=True):
        if not chunk.choices:
            continue
        assert not chunk.choices[0].delta.content  # nothing of a call leaks into the content
        for d in chunk.choices[0].delta.tool_calls or []:
            if d.id is not None:
                assert d.index not in calls and d.function.arguments == ""
                calls[d.index] = {"name": d.function.name, "arguments": ""}
            else:
                calls[d.index]["arguments"] += d.function.arguments
                pieces += 1
            order.append(d.index)
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [(c.function.name, c.function.arguments)
                                                                      for c in whole]  # fmt: skip
    assert order == sorted(order)  # the second call opens after the first one's last piece
    if sizes[0] < 100:
        assert pieces > 2 * len(whole)  # arguments in pieces, not whole at the call's end


def test_text_that_only_looks_like_a_call_is_content(planted):
    service, base = planted
    service.sizes = (3,)
    for text, finish in [("a <|tool_ca", "stop"), ("<|tool_call>call:get_weather{city:Paris}<tool_call|>", "stop")]:
        service.text, service.finish = text, finish
        client = _client(base)
        whole = client.chat.completions.create(model="planted", messages=USER, tools=[WEATHER]).choices[0]
        assert (whole.message.content, whole.message.tool_calls, whole.finish_reason) == (text, None, finish)
        chunks = list(client.chat.completions.create(model="planted", messages=USER, tools=[WEATHER], stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


@pytest.mark.parametrize("choice", ["auto", "required"])
@pytest.mark.parametrize(
    ("text", "finish"),
    [(CALL[:45], "stop"), (CALL + CALL[:30], "stop"), (CALL, "tool_calls")],
)  # fmt: skip
def test_a_call_cut_by_a_stop_string_is_no_finished_call(planted, text, finish, choice):
    """Found driving the demo pair with ``stop`` beside ``tool_choice: "required"`` (``"stop": ["Par"]``): the
    client's stop string cut the call inside its arguments and the answer said ``finish_reason: "tool_calls"``
    beside arguments ``{"city": "`` (the ``openai`` SDK's ``parse`` then fails on the JSON, as if the model had
    finished a broken call). A call the text ends inside is no call the model finished: ``"stop"`` (the client's
    stop), whole and streamed; a run that stopped right after its calls still says ``"tool_calls"``."""
    service, base = planted
    service.text, service.sizes, service.finish = text, (7,), "stop"
    kw = {"model": "planted", "messages": USER, "tools": [WEATHER], "tool_choice": choice, "stop": ["Pa"]}
    client = _client(base)
    whole = client.chat.completions.create(**kw).choices[0]
    streamed = [c.choices[0].finish_reason for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    assert (whole.finish_reason, streamed[-1]) == (finish, finish) and whole.message.tool_calls


@pytest.mark.parametrize("held", [False, True])
@pytest.mark.parametrize("cut", [CALL[:20], CALL[:45], CALL[:-3], "Sure. " + CALL + CALL[:30]])
def test_a_call_cut_by_max_tokens_is_the_same_call_whole_and_streamed(planted, cut, held):
    """Issue 58: a call cut by max_tokens came back whole as template text in ``content`` (streamed: as a
    call). Both now answer the call so far -- its name, its arguments as far as written -- with finish reason
    "length", as OpenAI reports a call cut by the length limit; no marker ever reaches the content."""
    service, base = planted
    service.text, service.sizes, service.finish = cut, (4,), "length"
    kw = {"model": "planted", "messages": USER, "tools": [WEATHER]} | ({"tool_choice": "required"} if held else {})
    client = _client(base)
    whole = client.chat.completions.create(**kw).choices[0]
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(**kw, stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        content += (delta and delta.content) or ""
        for d in (delta and delta.tool_calls) or ():
            c = calls.setdefault(d.index, {"name": "", "arguments": ""})
            c["name"] += d.function.name or ""
            c["arguments"] += d.function.arguments or ""
        finish = (chunk.choices and chunk.choices[0].finish_reason) or finish
    named = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or ()]
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == named
    assert (whole.message.content or "") == content and whole.finish_reason == finish == "length"
    for text in (content, whole.message.content or ""):
        assert "<|tool_call>" not in text and '<|"|>' not in text and "call:" not in text
    if cut.startswith(CALL[:45]):
        assert named[0][0] == "get_weather" and named[0][1].startswith('{"city": "Paris')


@pytest.mark.parametrize(
    ("text", "choice", "content"),
    [(CALL + "<", "required", ""), (CALL + "<|tool_re", "required", ""), ("<|tool_c", "required", ""),
     (CALL + "<|tool_re", "auto", ""), ("Sure <", "auto", "Sure <"), ("Sure <|tool_re", "auto", "Sure <|tool_re")],
)  # fmt: skip
def test_a_held_call_cut_as_the_next_marker_opens_leaks_no_content(planted, text, choice, content):
    """Found by driving the demo pair over HTTP: tool_choice "required", max_tokens 20..28 cut the model while it
    wrote the marker after its call (the demo tokenizer spells markers in several tokens), and the answer was
    ``content: "<|tool_re"`` beside the call. Under a held choice no text outside the calls is content; nor, under
    ``auto``, a mark's start cut right after a call (where only another call or the results could follow). After
    the model's own text, a cut "<" stays content: it may be text."""
    service, base = planted
    service.text, service.sizes, service.finish = text, (4,), "length"
    kw = {"model": "planted", "messages": USER, "tools": [WEATHER], "tool_choice": choice}
    client = _client(base)
    whole = client.chat.completions.create(**kw).choices[0]
    assert len(whole.message.tool_calls or ()) == text.count(CALL) and whole.finish_reason == "length"
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True)
                       if c.choices)  # fmt: skip
    assert (whole.message.content or "", streamed) == (content, content)
    assert whole.message.content is not None or content == ""


def test_tool_choice_none_reads_no_call(planted):
    service, base = planted
    service.text, service.sizes, service.finish = CALL, (4,), "stop"
    r = _client(base).chat.completions.create(model="planted", messages=USER, tools=[WEATHER], tool_choice="none")
    assert r.choices[0].message.content == CALL and r.choices[0].finish_reason == "stop"
    assert "<|tool_response>" not in service.requests[-1].stop_strings


HISTORY = USER + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]  # fmt: skip


def test_a_tool_history_reaches_the_request(planted):
    service, base = planted
    service.text = "It is sunny."
    r = _client(base).chat.completions.create(model="planted", messages=HISTORY, tools=[WEATHER])
    assert r.choices[0].message.content == "It is sunny." and r.choices[0].finish_reason == "stop"
    assistant, tool = service.requests[-1].prompt.messages[1:]
    assert assistant.content == "" and assistant.tool_calls[0].name == "get_weather"
    assert json.loads(assistant.tool_calls[0].arguments) == {"city": "Paris"}
    assert (tool.role, tool.tool_call_id, tool.content) == ("tool", "call_1", "sunny, 21 C")


BAD = [
    ({"tools": {"a": 1}}, "tools", "must be a list"),
    ({"tools": [{"type": "function"}]}, "tools[0]", "must be"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name", "1-64"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "declared twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters", "must be a JSON schema"),
    ({"tools": [{"type": "function", "function": WEATHER["function"] | {"strict": "yes"}}]},
     "tools[0].function.strict", "true or false"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"required": 5}}}]},
     "tools[0].function.parameters.required", "a list of strings"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": []}}}]},
     "tools[0].function.parameters.properties", "an object"),
    ({"tool_choice": "auto"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice", "must be"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not one of the tools"),
    ({"messages": USER + [{"role": "tool", "content": "x"}]}, "messages[1].tool_call_id", "needs the id"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]},
     "messages[0].tool_calls[0].function.arguments", "JSON object"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls", "only an assistant"),
    ({"functions": [{"name": "f"}]}, "functions", "tools and tool_choice"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "param", "says"), BAD)
def test_bad_tools_are_400_naming_the_parameter(planted, extra, param, says):
    import openai

    _, base = planted
    body = {"model": "planted", "messages": USER} | extra
    with pytest.raises(openai.BadRequestError) as err:
        _client(base).chat.completions.create(**body)
    error = err.value.body
    assert error["param"] == param and says in error["message"], error


# --------------------------------------------------------------------------- the tiny pair, for real


@pytest.fixture(scope="module")
def real(tiny_pair):
    servicer = GenerationServicer(
        lambda: build_local_engine(str(tiny_pair.target), str(tiny_pair.draft), "mlx"), colocated=True
    )
    servicer.load()
    servicer.ready = True
    http = HttpFront(servicer, 0, "tiny")
    port = http.start("127.0.0.1")
    yield servicer, f"http://127.0.0.1:{port}"
    http.drain()
    http.join(5)


def test_the_template_renders_tools_and_calls_into_the_prompt(real):
    servicer, base = real
    client = _client(base)
    kw = {"model": "tiny", "max_tokens": 4, "temperature": 0, "extra_body": {"ignore_eos": True}}
    plain = client.chat.completions.create(messages=USER, **kw)
    declared = client.chat.completions.create(messages=USER, tools=[WEATHER], **kw)
    history = client.chat.completions.create(messages=HISTORY, tools=[WEATHER], **kw)
    codec = servicer.engine.codec
    tokens = {name: r.usage.prompt_tokens for name, r in [("plain", plain), ("declared", declared), ("h", history)]}
    assert tokens["plain"] < tokens["declared"] < tokens["h"]
    rendered = codec.encode_chat(USER, tools=[WEATHER])
    assert len(rendered) == tokens["declared"]
    text = codec.tokenizer.decode(rendered, skip_special_tokens=False)
    assert "<|tool>declaration:get_weather{" in text and text.endswith("<start_of_turn>model\n")
    for r in (declared, history):  # the untrained model writes no call: its text is content
        assert r.choices[0].finish_reason == "length" and r.choices[0].message.tool_calls is None
        assert r.choices[0].message.content == codec.decode(r.model_extra["kakeya"]["token_ids"])


def test_the_most_stop_strings_are_taken_with_tools_too(real):
    """16 stop strings are taken without tools; with tools the client still sent 16: the results marker the server
    stops at is its own, not one of the client's."""
    import openai

    _, base = real
    stops = [f"zq{i}" for i in range(16)]
    client = _client(base)
    plain = client.chat.completions.create(model="tiny", messages=USER, max_tokens=2, stop=stops)
    assert plain.choices[0].finish_reason in ("length", "stop")
    r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=2, stop=stops, tools=[WEATHER])
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")
    with pytest.raises(openai.BadRequestError, match="17 strings, at most 16"):  # one more is the client's 17th
        client.chat.completions.create(model="tiny", messages=USER, max_tokens=2, stop=[*stops, "zq"], tools=[WEATHER])


def test_a_schema_the_template_cannot_write_is_a_400_not_a_500(real):
    import openai

    _, base = real
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "object", "properties": {}, "required": 5}}}}}  # fmt: skip
    with pytest.raises(openai.BadRequestError) as err:
        _client(base).chat.completions.create(model="tiny", messages=USER, tools=[tool], max_tokens=2)
    assert "chat template" in err.value.body["message"]


class _Aborted(Exception):
    pass


class _Context(HttpCall):
    """A gRPC servicer context as ``Generate`` uses it: a caller, and ``abort`` raising as grpc's does."""

    def abort(self, code, details):
        self.code, self.details = code, details
        raise _Aborted(details)

    def invocation_metadata(self):
        return ()

    def send_initial_metadata(self, metadata):  # grpc's: Generate sends the request id in it
        self.sent_metadata = metadata

    set_trailing_metadata = send_initial_metadata  # and in its trailers


def _grpc_chat(servicer, tools=(), history=HISTORY, arguments=None):
    req = pb.GenerateRequest(sampling_params=pb.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    for m in history:
        calls = [pb.ToolCall(id=c["id"], name=c["function"]["name"],
                             arguments_json=arguments or c["function"]["arguments"]) for c in m.get("tool_calls") or []]  # fmt: skip
        req.messages.messages.add(role=m["role"], content=m["content"] or "", tool_calls=calls,
                                  tool_call_id=m.get("tool_call_id", ""))  # fmt: skip
    for t in tools:
        f = t["function"]
        req.messages.tools.add(name=f["name"], description=f.get("description", ""),
                               parameters_json=f["parameters"] if isinstance(f.get("parameters"), str)
                               else json.dumps(f.get("parameters") or {}))  # fmt: skip
    context = _Context()
    return list(servicer.Generate(req, context)), context


def test_grpc_takes_the_same_tools_and_tool_turns(real):
    """The gRPC API's messages carry tools and tool turns too: the same prompt as the HTTP request's."""
    servicer, base = real
    r = _client(base).chat.completions.create(model="tiny", messages=HISTORY, tools=[WEATHER], max_tokens=4,
                                              temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    answers, _ = _grpc_chat(servicer, [WEATHER])
    assert answers[-1].complete.prompt_tokens == r.usage.prompt_tokens
    ids = [t for a in answers if a.HasField("chunk") for t in a.chunk.token_ids]
    assert ids == r.model_extra["kakeya"]["token_ids"]
    with pytest.raises(_Aborted) as err:
        _grpc_chat(servicer, [WEATHER | {"function": WEATHER["function"] | {"parameters": "[1]"}}])
    assert "prompt.messages.tools[0].parameters_json" in str(err.value)
    with pytest.raises(_Aborted) as err:
        _grpc_chat(servicer, [WEATHER], arguments="not json")
    assert "prompt.messages.messages[1].tool_calls[0].arguments_json" in str(err.value)  # the proto's names
    with pytest.raises(_Aborted) as err:
        _grpc_chat(servicer, [WEATHER, WEATHER])
    assert "tools[1].name" in str(err.value)


def test_grpc_names_a_calls_arguments_that_are_no_object_by_their_field(real):
    """A call's ``arguments_json`` holding JSON that is no object (``[1]``) is refused naming that field, as HTTP
    names ``function.arguments``: it named the whole call (``...tool_calls[0]: needs a function's name and ...``)."""
    with pytest.raises(_Aborted) as err:
        _grpc_chat(real[0], [WEATHER], arguments="[1]")
    assert str(err.value).startswith("prompt.messages.messages[1].tool_calls[0].arguments_json: "), str(err.value)


FLAG = {  # a tool whose every argument is bounded: an untrained model held to a call finishes it
    "type": "function",
    "function": {
        "name": "set_flag",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"type": "string", "enum": ["c", "f"]}, "hot": {"type": "boolean"}},
            "required": ["hot", "unit"],
        },
    },
}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "set_flag"}}])
@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_is_well_formed_and_its_arguments_follow_the_schema(real, choice, stream):
    """tool_choice required / a named function: the grammar holds the (untrained) model to calls of the tools,
    each argument as its schema says; streamed deltas join to the same calls as the whole answer's."""
    import jsonschema

    _, base = real
    kw = {"model": "tiny", "messages": USER, "tools": [WEATHER, FLAG], "tool_choice": choice, "max_tokens": 120,
          "temperature": 0}  # fmt: skip
    client = _client(base)
    whole = client.chat.completions.create(**kw)
    calls = whole.choices[0].message.tool_calls
    assert calls and whole.choices[0].finish_reason == "tool_calls", whole.choices[0]
    for c in calls:
        tool = {"get_weather": WEATHER, "set_flag": FLAG}[c.function.name]
        jsonschema.validate(json.loads(c.function.arguments), tool["function"]["parameters"])
    if isinstance(choice, dict):
        assert [c.function.name for c in calls] == ["set_flag"]  # exactly one call, of the function named
    if stream:
        joined: dict[int, dict] = {}
        for chunk in client.chat.completions.create(**kw, stream=True):
            for d in chunk.choices[0].delta.tool_calls or ():
                j = joined.setdefault(d.index, {"name": "", "arguments": ""})
                j["name"] += d.function.name or ""
                j["arguments"] += d.function.arguments or ""
        assert [(j["name"], json.loads(j["arguments"])) for _, j in sorted(joined.items())] == [
            (c.function.name, json.loads(c.function.arguments)) for c in calls
        ]


def test_strict_under_auto_holds_calls_and_leaves_the_text_as_it_was(real):
    """tool_choice auto with a strict tool: a grammar holds any call the model opens (the grammar's own tests:
    ``test_tool_grammar.py``) and leaves its text free, so the (untrained, never calling) model answers with
    the very tokens it answers without strict; the request decoded under that grammar."""


@pytest.mark.parametrize("block_size", [1, 4, 0])
def test_strict_under_auto_leaves_the_demo_models_text_as_it_was(demo_pair, block_size):
    """The demo model (trained on text, never on calls) answers under the auto grammar with the very tokens it
    answers without it, at every block size: the grammar held the request (its constraint) and refused
    nothing the model chose, through every block's rolled-back candidates."""
    from kakeya.orchestrator.decode.checks import check_request
    from kakeya.orchestrator.fronts.http_api import chat_request

    engine = build_local_engine(str(demo_pair.target), str(demo_pair.draft), "torch", "cpu")
    strict = {"type": "function", "function": FLAG["function"] | {"strict": True}}
    for content in ("Weather in Paris?", "def fib(n):"):
        body = {"model": "demo", "messages": [{"role": "user", "content": content}], "max_tokens": 40,
                "temperature": 0, "extra_body": None}  # fmt: skip
        out = {}
        for name, tools in (("free", [FLAG, WEATHER]), ("held", [strict, WEATHER])):
            req, _, _ = chat_request({k: v for k, v in body.items() if v is not None} | {"tools": tools}, "demo")
            req = check_request(req, engine)
            assert (req.constraint is not None) == (name == "held")
            # the server's own stop where a call's results would follow, once, however often it is checked
            assert req.stop_strings == ("<|tool_response>",) == check_request(req, engine).stop_strings
            out[name] = engine.generate(replace(req, block_size=block_size)).token_ids
        assert out["held"] == out["free"] and len(out["free"]) == 40


def test_strict_is_honoured_where_every_call_follows_its_schema(real):
    _, base = real
    strict = {"type": "function", "function": FLAG["function"] | {"strict": True}}
    r = _client(base).chat.completions.create(model="tiny", messages=USER, tools=[strict], tool_choice="required",
                                              max_tokens=60, temperature=0)  # fmt: skip
    assert r.choices[0].message.tool_calls[0].function.name == "set_flag"


def test_parallel_tool_calls_false_stops_after_one_call(real):
    """``parallel_tool_calls: false`` (issue 58; it was refused): ``required`` answers exactly one call, the
    very first call the request makes without it."""
    _, base = real
    kw = {"model": "tiny", "messages": USER, "tools": [WEATHER, FLAG], "tool_choice": "required", "max_tokens": 120,
          "temperature": 0}  # fmt: skip
    client = _client(base)
    many = client.chat.completions.create(**kw).choices[0].message.tool_calls
    [one] = client.chat.completions.create(**kw, parallel_tool_calls=False).choices[0].message.tool_calls
    assert (one.function.name, one.function.arguments) == (many[0].function.name, many[0].function.arguments)
    with pytest.raises(Exception) as err:
        client.chat.completions.create(**kw, parallel_tool_calls="no")
    assert err.value.body["param"] == "parallel_tool_calls", err.value.body


def test_langchain_structured_output_by_function_calling(real):
    """langchain's ``with_structured_output(method="function_calling")`` (a named tool_choice and
    ``parallel_tool_calls: false``; 0 of 4 before issue 58) against the HTTP front on loopback: 4 of 4
    models come back parsed and valid."""
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Flag(BaseModel):
        """Whether it is hot, and the unit."""

        hot: bool
        unit: Literal["c", "f"]

    class Rating(BaseModel):
        """A rating."""

        stars: int = Field(ge=1, le=5)
        verified: bool

    class Pick(BaseModel):
        """A pick of a colour."""

        color: Literal["red", "green", "blue"]
        count: int = Field(ge=0, le=9)
        tag: str = Field(max_length=4)

    class Point(BaseModel):
        x: int = Field(ge=0, le=9)
        y: int = Field(ge=0, le=9)

    class Route(BaseModel):
        """A route of one or two points."""

        stops: list[Point] = Field(min_length=1, max_length=2)
        mode: Literal["walk", "car"]

    _, base = real
    llm = ChatOpenAI(base_url=base + "/v1", api_key="unused", model="tiny", temperature=0, max_tokens=160,
                     max_retries=0)  # fmt: skip
    parsed = []
    for model in (Flag, Rating, Pick, Route):
        out = llm.with_structured_output(model, method="function_calling").invoke(f"Fill in a {model.__name__}.")
        assert isinstance(out, model), out
        parsed.append(model.model_validate(out.model_dump()))
    assert len(parsed) == 4


class Verdict(BaseModel):
    verdict: Literal["yes", "no"]


class SetFlag(BaseModel):  # FLAG's arguments
    hot: bool
    unit: Literal["c", "f"]


@pytest.mark.parametrize("strict", [True, False])
def test_tools_beside_a_response_format_answer_with_calls_or_that_json(real, strict):
    """OpenAI's model answers tools beside a ``response_format`` with calls or with that JSON: the ``openai``
    SDK's ``parse(tools=[pydantic_function_tool(M)], response_format=Model)`` and langchain's
    ``bind_tools(..., response_format=...)`` send both. They were a 400 ("a strict tool constrains the output
    already"), and beside a tool not strict the JSON grammar alone held the output: no call could be written.
    Now both are one grammar (``test_tool_grammar.py``): a call, whole and valid, or the JSON; the same
    streamed; a regex beside tools is refused by name (no call could follow one), as is ``required`` beside it."""
    import openai

    from kakeya.orchestrator.decode.checks import check_request
    from kakeya.orchestrator.fronts.http_api import chat_request

    servicer, base = real
    client = _client(base)
    tool = openai.pydantic_function_tool(SetFlag, name="set_flag") if strict else FLAG
    schema = Verdict.model_json_schema() | {"additionalProperties": False}  # no more keys: the answer ends
    rf = {"type": "json_schema", "json_schema": {"name": "v", "schema": schema}}
    kw = {"model": "tiny", "messages": USER, "tools": [tool], "max_tokens": 60, "temperature": 0}
    req, _, _ = chat_request(kw | {"response_format": rf}, "tiny")
    grammar = check_request(req, servicer.engine).constraint
    assert grammar.kind == "grammar" and "call:set_flag" in grammar.spec  # calls or the answer, one grammar
    if strict:  # the SDK's parsing helpers take strict tools only
        whole = client.chat.completions.parse(**kw, response_format=Verdict)
        with client.chat.completions.stream(**kw, response_format=Verdict) as s:
            streamed = s.get_final_completion()
        answers = (whole, streamed)
        calls = [[(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls or ()]
                 for r in answers]  # fmt: skip
        assert calls[0] == calls[1] and whole.choices[0].message.content == (
            streamed.choices[0].message.content or None
        )
    else:  # a call's arguments are any object: the untrained model may write one until max_tokens cuts it
        answers = (client.chat.completions.create(**kw, response_format=rf),)
        chunks = list(client.chat.completions.create(**kw, response_format=rf, stream=True))
        assert chunks[-1].model_extra["kakeya"]["token_ids"] == answers[0].model_extra["kakeya"]["token_ids"]
    for block_size in (1, 3):  # lossless: the greedy tokens of one token a block (AR under the grammar), and of 3
        r = client.chat.completions.create(**kw, response_format=rf, extra_body={"block_size": block_size})
        assert r.model_extra["kakeya"]["token_ids"] == answers[0].model_extra["kakeya"]["token_ids"]
    for r in answers:
        choice = r.choices[0]
        if choice.message.tool_calls:  # a call: whole and valid, or (not strict) cut by max_tokens
            assert choice.finish_reason == ("tool_calls" if strict else "length"), choice
            assert not strict or SetFlag.model_validate_json(choice.message.tool_calls[0].function.arguments)
        else:
            assert choice.finish_reason == "stop" and Verdict.model_validate_json(choice.message.content), choice
    for extra, param in [({"extra_body": {"guided_regex": "a+"}}, "guided_regex"),
                         ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format")]:  # fmt: skip
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(**kw, **extra)
        assert err.value.body["param"] == param, err.value.body
