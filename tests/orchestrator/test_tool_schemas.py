"""Tool schemas as clients generate them (issue 58): pydantic's ``model_json_schema()`` and the ``openai`` SDK's
``pydantic_function_tool`` for ten realistic argument models (``tool_models.py``) are held by the tool-call
grammar -- every keyword they carry (bounds, lengths, patterns, formats, ``$defs``/``$ref``, ``Literal``,
optional fields, lists of models) -- not refused.

With llguidance's matcher on the demo pair's tokenizer: arguments the model takes, written as the chat
template writes a call, are accepted and read back to the same arguments; arguments pydantic refuses are
refused by the grammar. With the tiny pair: a forced call (named, and ``required``) decodes speculatively to
the very tokens the pair decodes without its drafter. (Whether the trained demo model's forced calls come out
valid is ``benchmarks/tool_schemas.py``'s: it decodes 40 of them, minutes on a CPU.)"""

from __future__ import annotations

import json
from dataclasses import replace

import jsonschema
import llguidance
import pydantic
import pytest

from kakeya.core.request import Tool
from kakeya.orchestrator.assembly import build_local_engine
from kakeya.orchestrator.decode.checks import check_request
from kakeya.orchestrator.fronts.http_api import chat_request
from kakeya.orchestrator.text import TextCodec
from kakeya.orchestrator.tools.calls import parse_call
from kakeya.orchestrator.tools.grammar import tool_call_grammar
from tests.orchestrator.tool_models import INVALID, MODELS, VALID, SignUp, schemas

SOURCES = ("pydantic", "openai")
CLIENT_MODELS = [*MODELS, SignUp]  # SignUp: formats llguidance has no regex for, plain strings
CHECKED_FORMATS = jsonschema.FormatChecker(formats=("date", "email", "uuid", "ipv4"))  # those it checks offline


@pytest.fixture(scope="module")
def demo(demo_pair):
    return TextCodec(demo_pair.target), llguidance.LLTokenizer(str(demo_pair.target / "tokenizer.json"))


def _written(codec: TextCodec, name: str, args: dict) -> str:
    """The call as the chat template writes an assistant's call (Gemma-4's syntax)."""
    messages = [{"role": "user", "content": "x"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "1", "type": "function",
                                                                      "function": {"name": name, "arguments": args}}]}]  # fmt: skip
    text = codec.chat.render(messages, add_generation_prompt=False)
    return text[text.index("<|tool_call>") : text.index("<tool_call|>") + len("<tool_call|>")]


def _accepts(tokenizer, grammar: str, codec: TextCodec, text: str) -> bool:
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    matcher.consume_tokens(codec.tokenizer.encode(text, add_special_tokens=False).ids)
    return not matcher.is_error() and matcher.is_accepting()


def _valid(model, schema: dict, args: dict) -> bool:
    try:
        jsonschema.validate(args, schema, format_checker=CHECKED_FORMATS)
        model.model_validate(args)  # pydantic's own check: datetime and time formats too
    except (jsonschema.ValidationError, pydantic.ValidationError):
        return False
    return True


@pytest.mark.parametrize("model", CLIENT_MODELS, ids=lambda m: m.__name__)
def test_client_schemas_hold_the_arguments_their_model_takes_and_refuse_the_rest(demo, model):
    codec, tokenizer = demo
    for source, schema in schemas(model).items():
        grammar = tool_call_grammar([Tool(model.__name__, "", schema)], model.__name__)
        args = VALID[model]
        if source == "openai":  # strict: every key present (an optional one as null)
            args = {k: args.get(k) for k in schema["properties"]}
        assert _valid(model, schema, args), (source, args)
        call = _written(codec, model.__name__, args)
        assert _accepts(tokenizer, grammar, codec, call), (source, call)
        assert json.loads(parse_call(call[len("<|tool_call>") : -len("<tool_call|>")]).arguments) == args
        for bad in INVALID[model]:
            if source == "openai":
                bad = {k: bad.get(k, args[k]) for k in schema["properties"]}
            assert not _valid(model, schema, bad), (source, bad)
            assert not _accepts(tokenizer, grammar, codec, _written(codec, model.__name__, bad)), (source, bad)


@pytest.fixture(scope="module")
def tiny_engines(tiny_pair):
    # torch on the CPU: two MLX engines left to the interpreter's exit beside another module's servers crashed it
    spec = build_local_engine(str(tiny_pair.target), str(tiny_pair.draft), "torch", "cpu")
    ar = build_local_engine(str(tiny_pair.target), str(tiny_pair.draft), "torch", "cpu", no_drafter=True)
    return spec, ar


@pytest.mark.parametrize("model", CLIENT_MODELS, ids=lambda m: m.__name__)
def test_a_forced_call_decodes_to_the_drafterless_tokens(tiny_engines, model):
    """Speculative == ``--no-drafter`` token for token under each client's schema, named and ``required``
    (the tiny models are untrained: their calls run to max_tokens, every token under the grammar)."""
    spec, ar = tiny_engines
    for source, schema in schemas(model).items():
        tool = {"type": "function", "function": {"name": model.__name__, "parameters": schema}}
        choice = {"type": "function", "function": {"name": model.__name__}} if source == "pydantic" else "required"
        body = {"model": "tiny", "messages": [{"role": "user", "content": f"Call {model.__name__}."}],
                "max_tokens": 24, "temperature": 0, "tools": [tool], "tool_choice": choice}  # fmt: skip
        req, _, _ = chat_request(body, "tiny")
        out = spec.generate(replace(check_request(req, spec), block_size=4))
        reference = ar.generate(check_request(req, ar))
        assert out.token_ids == reference.token_ids, (source, out.token_ids, reference.token_ids)
        assert spec.codec.decode(out.token_ids).startswith(f"<|tool_call>call:{model.__name__}{{")


def test_annotations_pydantic_writes_beyond_the_core_ones_are_skipped_in_a_tool_call(demo):
    """pydantic's ``Json[dict[str, int]]`` writes JSON Schema's content vocabulary (``contentMediaType``,
    ``contentSchema``: annotations, a string that holds JSON) and ``json_schema_extra`` vendor keys (``x-order``),
    which ``response_format`` takes: a tool's parameters with them are held too, the keys skipped as annotations."""
    from pydantic import BaseModel, Field, Json

    class Upload(BaseModel):
        name: str = Field(json_schema_extra={"x-order": 1})
        payload: Json[dict[str, int]]

    codec, tokenizer = demo
    args = {"name": "a", "payload": '{"n": 1}'}
    for source, schema in schemas(Upload).items():
        assert "contentMediaType" in schema["properties"]["payload"] and "x-order" in schema["properties"]["name"]
        grammar = tool_call_grammar([Tool("Upload", "", schema)], "Upload")
        assert _valid(Upload, schema, args), source
        assert _accepts(tokenizer, grammar, codec, _written(codec, "Upload", args)), source
