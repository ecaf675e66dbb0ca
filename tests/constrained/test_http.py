"""The HTTP front's constraint parameters (tiny pair, MLX, colocated): ``response_format``, vLLM's ``guided_*``
and ``structured_outputs`` are honoured (the output matches), and a malformed or doubled one is a 400 naming
the parameter the client sent."""

from __future__ import annotations

import json

import pytest

from ..orchestrator.test_http_front import BASE, CHAT, COMPLETIONS, Client, _refusal, front  # noqa: F401 - the fixture

ENUM = {
    "type": "object",
    "properties": {"a": {"enum": ["x", "yy"]}, "b": {"type": "boolean"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
CHOICES = ["red", "green", "blue sky"]


def _text(answer) -> str:
    choice = answer["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


@pytest.mark.parametrize(
    "path, extra, check",
    [
        (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "e", "schema": ENUM, "strict": True}}},
         lambda t: json.loads(t)["a"] in ("x", "yy") and isinstance(json.loads(t)["b"], bool)),
        (CHAT, {"guided_choice": CHOICES}, lambda t: t in CHOICES),
        (COMPLETIONS, {"guided_json": json.dumps(ENUM)}, lambda t: set(json.loads(t)) == {"a", "b"}),
        (COMPLETIONS, {"guided_regex": r"[0-9]{2}-[ab]"}, lambda t: len(t) == 4 and t[2] == "-" and t[3] in "ab"),
        (CHAT, {"structured_outputs": {"choice": CHOICES}}, lambda t: t in CHOICES),
        (COMPLETIONS, {"structured_outputs": {"regex": "(yes|no)!"}}, lambda t: t in ("yes!", "no!")),
        (COMPLETIONS, {"guided_grammar": 'start: "n=" /[1-9]/'}, lambda t: len(t) == 3 and t.startswith("n=")),
    ],
)  # fmt: skip
def test_constraints_are_honoured(front, path, extra, check):  # noqa: F811 - the fixture
    body = BASE[path] | {"max_tokens": 40} | extra
    status, answer = Client(front[1]).post(path, body)
    assert status == 200, answer
    assert answer["choices"][0]["finish_reason"] == "stop", answer
    assert check(_text(answer)), _text(answer)


@pytest.mark.parametrize(
    "path, extra, param",
    [
        (COMPLETIONS, {"guided_regex": "a("}, "guided_regex"),
        (COMPLETIONS, {"guided_json": "{nope"}, "guided_json"),
        (COMPLETIONS, {"guided_choice": "red"}, "guided_choice"),
        (COMPLETIONS, {"guided_choice": [1]}, "guided_choice"),
        (COMPLETIONS, {"guided_regex": 5}, "guided_regex"),
        (COMPLETIONS, {"guided_json": [1]}, "guided_json"),
        (CHAT, {"structured_outputs": {"grammar": ["x"]}}, "structured_outputs.grammar"),
        (COMPLETIONS, {"guided_grammar": "start: nothing_here"}, "guided_grammar"),
        (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "bogus"}}}},
         "response_format.json_schema.schema"),
        (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema.schema"),
        (CHAT, {"response_format": {"type": "xml"}}, "response_format"),
        (CHAT, {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        (CHAT, {"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
        (CHAT, {"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
        (COMPLETIONS, {"guided_regex": "a", "ignore_eos": True}, "ignore_eos"),
        # llama.cpp's, Together's and Fireworks' way to send a schema: honoured there, it must not be dropped here
        (CHAT, {"response_format": {"type": "json_object", "schema": ENUM}}, "response_format.schema"),
        (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"schema": ENUM, "stirct": True}}},
         "response_format.json_schema.stirct"),  # a misspelt strict
    ],
)  # fmt: skip
def test_a_bad_or_doubled_constraint_is_a_400_naming_it(front, path, extra, param):  # noqa: F811 - the fixture
    status, answer = Client(front[1]).post(path, BASE[path] | extra)
    assert status == 400 and _refusal(answer) == param, answer
    if "response_format" in extra and "guided_regex" in extra:
        assert "response_format" in answer["error"]["message"]  # both named


def _generate(servicer, constraint, context=None):
    from kakeya.orchestrator.fronts.http_server import HttpCall
    from kakeya.wire.kakeya.v1 import generate_pb2 as pb

    class GrpcCall(HttpCall):  # a gRPC servicer context as Generate reads it: a caller, no metadata
        def invocation_metadata(self):
            return ()

        def send_initial_metadata(self, metadata):  # grpc's: Generate sends the request id in it
            self.sent_metadata = metadata

        set_trailing_metadata = send_initial_metadata  # and in its trailers

    req = pb.GenerateRequest(text="x = ", sampling_params=pb.SamplingParams(max_tokens=40), constraint=constraint)
    ids, complete = [], None
    for resp in servicer.Generate(req, context or GrpcCall()):
        if resp.HasField("chunk"):
            ids.extend(resp.chunk.token_ids)
        if resp.HasField("complete"):
            complete = resp.complete
    return ids, complete


def test_grpc_generate_takes_a_constraint(front):  # noqa: F811 - the fixture
    from kakeya.wire.kakeya.v1 import sampling_pb2 as spb

    servicer = front[0]
    codec = servicer.engine.codec
    ids, _ = _generate(servicer, spb.Constraint(choice=spb.Constraint.Choices(choices=CHOICES)))
    assert codec.decode(ids) in CHOICES
    ids, complete = _generate(servicer, spb.Constraint(json_schema=json.dumps(ENUM)))
    assert set(json.loads(codec.decode(ids))) == {"a", "b"}
    assert complete.stats.forced_blocks > 0  # the keys, quotes and colons: drafted by the grammar, reported


@pytest.mark.parametrize(
    "constraint, field",
    [({"regex": "a("}, "constraint.regex"), ({"json_schema": "{"}, "constraint.json_schema"),
     ({"json_object": False}, "constraint.json_object"), ({"grammar": "start: x"}, "constraint.grammar")],
)  # fmt: skip
def test_grpc_refuses_a_bad_constraint_naming_its_field(front, constraint, field):  # noqa: F811 - the fixture
    import grpc

    from kakeya.orchestrator.fronts.http_server import HttpCall
    from kakeya.wire.kakeya.v1 import sampling_pb2 as spb

    class Context(HttpCall):
        def abort(self, code, details):
            self.code, self.details = code, details
            raise RuntimeError(details)

        def invocation_metadata(self):
            return ()

        def send_initial_metadata(self, metadata):  # grpc's: Generate sends the request id in it
            self.sent_metadata = metadata

        set_trailing_metadata = send_initial_metadata  # and in its trailers

    context = Context()
    with pytest.raises(RuntimeError):
        _generate(front[0], spb.Constraint(**constraint), context)
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT and context.details.startswith(field + ":"), context.details


def test_the_openai_clients_parse_returns_a_valid_pydantic_object(front):  # noqa: F811 - the fixture
    """``beta.chat.completions.parse`` with a pydantic model (the client sends its strict JSON schema as
    ``response_format``) and ``response_format`` with a JSON schema, through the official client."""
    from typing import Literal

    from openai import OpenAI
    from pydantic import BaseModel

    from ..orchestrator.test_http_front import TOKEN

    class Weather(BaseModel):
        unit: Literal["c", "f"]
        sunny: bool
        sky: Literal["clear", "cloudy", "grey"]

    client = OpenAI(base_url=f"http://127.0.0.1:{front[1]}/v1", api_key=TOKEN, max_retries=0)
    messages = [{"role": "user", "content": "The weather, as JSON."}]
    parsed = client.beta.chat.completions.parse(model="tiny", messages=messages, response_format=Weather,
                                                max_tokens=60, temperature=0)  # fmt: skip
    weather = parsed.choices[0].message.parsed
    assert isinstance(weather, Weather) and parsed.choices[0].finish_reason == "stop"
    schema = {"name": "weather", "schema": Weather.model_json_schema(), "strict": True}
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=60, temperature=0,
                                       response_format={"type": "json_schema", "json_schema": schema})  # fmt: skip
    assert Weather.model_validate_json(r.choices[0].message.content) == weather  # the same greedy tokens


def test_pydantic_formats_are_held_or_plain_strings_through_the_clients(front):  # noqa: F811 - the fixture
    """The ``openai`` SDK's ``parse(response_format=Model)`` and langchain's ``with_structured_output`` (JSON schema and
    function calling) with a model whose fields pydantic gives formats llguidance has no regex for (``SecretStr``,
    ``bytes``, ``Path``, ``IPv4Network``, ``IPvAnyAddress``): answered, not refused (the tiny model's strings run
    to ``max_tokens``, which both clients raise as a length error, the answer's JSON begun)."""
    import openai
    from langchain_openai import ChatOpenAI

    from ..orchestrator.test_http_front import TOKEN
    from ..orchestrator.tool_models import SignUp

    base = f"http://127.0.0.1:{front[1]}/v1"
    client = openai.OpenAI(base_url=base, api_key=TOKEN, max_retries=0)
    messages = [{"role": "user", "content": "Sign me up."}]
    with pytest.raises(openai.LengthFinishReasonError) as cut:
        client.chat.completions.parse(model="tiny", messages=messages, response_format=SignUp, max_tokens=12)
    assert cut.value.completion.choices[0].message.content.startswith('{"login": "')
    chat = ChatOpenAI(base_url=base, api_key=TOKEN, model="tiny", max_tokens=12, temperature=0, max_retries=0)
    with pytest.raises(openai.LengthFinishReasonError):  # langchain's json_schema method is the SDK's parse
        chat.with_structured_output(SignUp, method="json_schema").invoke("Sign me up.")
    chat = ChatOpenAI(
        base_url=base, api_key=TOKEN, model="tiny", max_tokens=40, temperature=0, max_retries=0
    )  # past the call's name
    answer = chat.with_structured_output(SignUp, method="function_calling", include_raw=True).invoke("Sign me up.")
    assert answer["raw"].response_metadata["finish_reason"] == "length" and answer["parsed"] is None, answer
    [call] = answer["raw"].invalid_tool_calls  # the named function's call, cut
    assert call["name"] == "SignUp" and call["args"].startswith('{"'), call


def test_a_keyword_response_format_refuses_is_named_by_its_place_as_a_tools_is(front):  # noqa: F811 - the fixture
    """pydantic writes ``uniqueItems: true`` for a ``set[str]``, which no grammar holds: ``parse(response_format=M)``
    is refused naming where it is in the schema (``$defs.Inner.properties.tags.uniqueItems``), as the same model as a
    tool is, not only the keyword (llguidance's ``Unimplemented keys: ["uniqueItems"]``)."""
    import openai
    from pydantic import BaseModel

    from ..orchestrator.test_http_front import TOKEN

    class Inner(BaseModel):
        tags: set[str]

    class Outer(BaseModel):
        name: str
        inner: list[Inner]

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{front[1]}/v1", api_key=TOKEN, max_retries=0)
    messages = [{"role": "user", "content": "x"}]
    for kw, param in [({"response_format": Outer}, "response_format.json_schema.schema"),
                      ({"tools": [openai.pydantic_function_tool(Outer)], "tool_choice": "required"},
                       "tools[0].function.parameters")]:  # fmt: skip
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.parse(model="tiny", messages=messages, max_tokens=2, **kw)
        assert err.value.param == param, err.value
        assert f"{param}: $defs.Inner.properties.tags.uniqueItems: " in err.value.message, err.value
