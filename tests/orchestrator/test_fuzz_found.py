"""What the fuzzes of issue 43 found (``test_http_front.py``'s and ``tests/services/test_fuzz.py``'s structured
fuzzes), each as a plain request to both fronts of the tiny pair, colocated: a 400 / INVALID_ARGUMENT naming
the field as that front's clients spell it, where a 500 / INTERNAL came back, or an error named the other
front's field.
"""

from __future__ import annotations

import grpc
import pytest

from kakeya.wire.kakeya.v1 import generate_pb2 as pb
from kakeya.wire.kakeya.v1 import generate_pb2_grpc

from . import test_grpc_tools
from .test_grpc_tools import _refused, _request, _tool
from .test_http_front import Client

real = test_grpc_tools.real  # the tiny pair behind a gRPC server and the HTTP front, for this module too

USER = [{"role": "user", "content": "hi"}]
UNIQUE = {"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}  # a keyword refused by name


def _http(real, body: dict) -> tuple[int, dict]:
    port = int(real[2].rsplit(":", 1)[1])
    return Client(port, auth=None).post("/v1/chat/completions", {"messages": USER, "max_tokens": 2} | body)


@pytest.mark.parametrize(
    ("parameters", "at"),
    [
        (UNIQUE, "properties.a.uniqueItems: unique items cannot be held in a tool call's grammar"),
        ({"type": "object", "properties": {"a": {"not": {}}}}, "properties.a.not: this schema keyword is not supp"),
        ({"type": "object", "properties": {"a": {"type": "string", "pattern": "("}}}, "properties.a.pattern: cannot"),
        ({"type": "object", "properties": {"a": {"anyOf": 5}}}, "properties.a.anyOf: must be a non-empty list"),
        ({"type": "object", "properties": {"a": {"oneOf": [5]}}}, "properties.a.oneOf[0]: a schema must be an"),
        ({"type": "object", "properties": {"a": {"type": 5}}}, "properties.a.type: must be a type's name"),
        ({"properties": {"a": {"properties": {"b": {}}, "required": 5}}}, "properties.a.required: must be a list"),
    ],
)
@pytest.mark.parametrize("choice", ["required", "function", "strict"])
def test_a_schema_the_call_grammar_cannot_hold_names_the_tools_parameters_on_each_front(real, parameters, at, choice):
    """A tool's schema the tool-call grammar cannot hold (a keyword it refuses, or one of the wrong type, which
    was a 500 / INTERNAL): HTTP names ``tools[1].function.parameters`` (it named ``tool_choice``, with the
    location inside the message), gRPC ``prompt.messages.tools[1].parameters_json`` (it named the HTTP
    location ``tools[1].function.parameters``); each says where in the schema."""
    tool = _tool("f", parameters)
    tool["function"]["strict"] = choice == "strict"
    weather = _tool("w", {"type": "object", "properties": {"city": {"type": "string"}}})
    http_choice = {
        "required": "required",
        "strict": "auto",
        "function": {"type": "function", "function": {"name": "f"}},
    }
    status, answer = _http(real, {"tools": [weather, tool], "tool_choice": http_choice[choice]})
    assert status == 400 and answer["error"]["param"] == "tools[1].function.parameters", answer
    assert answer["error"]["message"].startswith(f"tools[1].function.parameters: {at}"), answer
    req = _request(tools=(weather, tool), max_tokens=2, **{
        "required": {"mode": pb.TOOL_CHOICE_MODE_REQUIRED}, "function": {"function": "f"},
        "strict": {"mode": pb.TOOL_CHOICE_MODE_AUTO}}[choice])  # fmt: skip
    req.messages.tools[1].strict = choice == "strict"
    details = _refused(real[1], req)
    assert details.startswith(f"prompt.messages.tools[1].parameters_json: {at}"), details


def test_a_calls_arguments_holding_an_escaped_lone_surrogate_are_refused_naming_them(real):
    """``"\\ud800"`` inside a call's arguments text is ASCII on the wire, a lone surrogate once parsed, which
    the tokenizer cannot take: it was a 500 / INTERNAL (TypeError from the tokenizer) on both fronts."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": "\\ud800"}'}}
    messages = USER + [{"role": "assistant", "content": None, "tool_calls": [call]}]
    status, answer = _http(real, {"messages": messages})
    assert status == 400 and answer["error"]["param"] == "messages[1].tool_calls[0].function.arguments", answer
    assert answer["error"]["message"].startswith("messages[1].tool_calls[0].function.arguments: "), answer
    assert "lone surrogate" in answer["error"]["message"]
    req = _request(tools=(), max_tokens=2)
    req.messages.messages.add(role="assistant").tool_calls.add(id="c1", name="f", arguments_json='{"a": "\\ud800"}')
    details = _refused(real[1], req)
    assert details.startswith("prompt.messages.messages[1].tool_calls[0].arguments_json: "), details
    assert "lone surrogate" in details


@pytest.mark.parametrize(
    ("text", "says"), [('{"type": "object", "properties": {"\\udc80": {}}}', "lone surrogate"), ("[" * 5000, "deeply")]
)
def test_json_texts_on_grpc_with_a_lone_surrogate_or_deep_nesting_are_invalid_argument(real, text, says):
    """A tool's ``parameters_json`` and a constraint's ``json_schema`` are JSON texts: an escaped lone surrogate
    (INTERNAL from the tokenizer) or nesting past the parser's depth (INTERNAL: RecursionError) is refused by
    the field's name."""
    req = _request(tools=(), max_tokens=2)
    req.messages.tools.add(name="f", parameters_json=text)
    details = _refused(real[1], req)
    assert details.startswith("prompt.messages.tools[0].parameters_json: must be a JSON object's text"), details
    assert says in details
    req = _request(tools=(), max_tokens=2)
    req.constraint.json_schema = text
    assert _refused(real[1], req).startswith("constraint.json_schema: "), says


def test_guided_json_text_nested_too_deeply_is_a_400_naming_it(real):
    status, answer = _http(real, {"guided_json": "[" * 5000})
    assert status == 400 and answer["error"]["param"] == "guided_json", answer
    assert "deeply" in answer["error"]["message"]


def test_grpc_refusals_of_chat_messages_use_the_protos_names(real):
    """``prompt.messages`` is the ChatMessages; its list is ``prompt.messages.messages`` (the gRPC errors named
    ``prompt.messages[1].role``, the shape of the HTTP ``messages[1].role``)."""
    req = _request(tools=(), max_tokens=2)
    req.messages.messages.add(role="robot", content="x")
    assert _refused(real[1], req).startswith("prompt.messages.messages[1].role: must be one of"), req
    stub = generate_pb2_grpc.GenerationStub(grpc.insecure_channel(real[1]))
    complete = list(stub.Generate(_request(tools=(), max_tokens=2), timeout=60))[-1].complete
    assert complete.finish_reason == pb.FINISH_REASON_LENGTH  # still serving


def test_a_choice_only_a_special_token_spells_ends_the_generation_instead_of_failing_it(real):
    """``guided_choice: ["<pad>"]``: llguidance's mask allowed the special token ``<pad>`` (its text is the
    choice), then refused it once committed: a 500 (RuntimeError: a committed token outside the grammar). The
    mask now holds only tokens the grammar takes; none continues this one, so the generation ends at EOS."""
    port = int(real[2].rsplit(":", 1)[1])
    status, answer = Client(port, auth=None).post("/v1/completions", {"prompt": [2, 40], "max_tokens": 3,
                                                                      "guided_choice": ["<pad>"]})  # fmt: skip
    assert status == 200 and answer["choices"][0]["finish_reason"] == "stop", answer
    assert answer["kakeya"]["token_ids"] == [real[0].engine.verifier.info.eos_token_ids[0]]
    req = _request(tools=(), max_tokens=3)
    req.constraint.choice.choices.append("<pad>")
    stub = generate_pb2_grpc.GenerationStub(grpc.insecure_channel(real[1]))
    complete = list(stub.Generate(req, timeout=60))[-1].complete
    assert complete.finish_reason == pb.FINISH_REASON_STOP, complete.error_message


def test_a_regex_past_llguidances_budget_is_refused_not_a_500(real):
    """``a{99999999}`` compiles, then llguidance's lexer exceeds its budget at the first token it takes ("too many
    expressions constructed"): a committed token outside the grammar, a 500. Now a 400 (INVALID_ARGUMENT) naming
    the parameter; the compiled grammar keeps the failure, so a later request is refused at the check."""
    body = {"guided_regex": "b{99999997}"}  # a regex no other test compiles: this one meets it first
    for _ in range(2):  # both at the check (it takes one token into the grammar), the second from the cache
        status, answer = _http(real, body)
        assert status == 400 and answer["error"]["param"] == "guided_regex", answer
        assert answer["error"]["message"].startswith("guided_regex: the constraint cannot be followed: ")
        assert "too many expressions" in answer["error"]["message"]
    for regex in ("b{99999997}", "c{99999996}"):  # at the check; as it runs
        req = _request(tools=(), max_tokens=2)
        req.constraint.regex = regex
        assert _refused(real[1], req).startswith("constraint.regex: the constraint cannot be followed")


def test_a_schema_the_chat_template_cannot_write_names_the_tools(real):
    """A tool's schema the template fails on (``required: 5`` inside a property, which the front's check of the
    top level lets through): the refusal named ``messages`` (HTTP) and ``prompt.messages`` (gRPC), though the
    messages render without the tools; it names the tools."""
    tool = _tool("f", {"type": "object", "properties": {"a": {"type": "object", "properties": {}, "required": 5}}})
    status, answer = _http(real, {"tools": [tool], "tool_choice": "none"})
    assert status == 400 and answer["error"]["param"] == "tools", answer
    assert answer["error"]["message"].startswith("tools: chat template: "), answer
    details = _refused(real[1], _request(tools=(tool,), mode=pb.TOOL_CHOICE_MODE_NONE, max_tokens=2))
    assert details.startswith("prompt.messages.tools: chat template: "), details


@pytest.mark.parametrize(
    ("field", "http", "grpc_name"),
    [
        ("prompt.tools[3].parameters", "tools[3].function.parameters", "prompt.messages.tools[3].parameters_json"),
        ("prompt.messages[2].tool_calls[1].arguments", "messages[2].tool_calls[1].function.arguments",
         "prompt.messages.messages[2].tool_calls[1].arguments_json"),
        ("prompt.messages[1].role", "messages[1].role", "prompt.messages.messages[1].role"),
        ("prompt.tools", "tools", "prompt.messages.tools"),
        ("prompt", "messages", "prompt.messages"),
    ],
)  # fmt: skip
def test_each_front_spells_a_request_field_inside_list_items_its_own_way(field, http, grpc_name):
    """The one renaming of both fronts (``public_field`` over ``http_api.field_names`` / ``grpc_api``'s names):
    a name written with ``[]`` renames a field inside list items, each index kept in its place."""
    from kakeya.core.request import public_field
    from kakeya.orchestrator.fronts import grpc_api, http_api

    assert public_field(field, http_api.field_names(True, "max_tokens")) == http
    assert public_field(field, grpc_api.FIELD_NAMES | grpc_api.PROMPT_NAMES["messages"]) == grpc_name
