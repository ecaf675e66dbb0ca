"""The tool-call grammar (``orchestrator/tools/grammar.py``), checked with llguidance's own matcher on the demo
pair's tokenizer: calls written by the chat template with arguments that satisfy the schema are accepted (and
read back by the parser to the same arguments), calls whose arguments break the schema, malformed calls and
calls of other functions are rejected; with the markers as special tokens (Gemma-4's) they match by id."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import jsonschema
import llguidance
import pytest
from tokenizers import AddedToken, Tokenizer

from kakeya.core.request import Tool
from kakeya.orchestrator.text import TextCodec
from kakeya.orchestrator.tools.calls import MARKERS, parse_call
from kakeya.orchestrator.tools.grammar import GrammarError, holds_calls, marker_terms, tool_call_grammar

Q = '<|"|>'
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "a city"},
        "unit": {"type": "string", "enum": ["c", "f"]},
        "days": {"type": "array", "items": {"type": "integer"}},
        "at": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
               "required": ["lat", "lon"]},
        "hourly": {"type": ["boolean", "null"]},
        "note": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
        "mode": {"const": "fast"},
        "extra": {},
    },
    "required": ["city", "unit"],
}  # fmt: skip
WEATHER, TIME = Tool("get_weather", "The weather", SCHEMA), Tool("time")
VALID = [
    {"city": "Paris", "unit": "c"},
    {"city": "", "unit": "f", "days": []},
    {"city": "a <b> {c}: [d], e", "unit": "c", "days": [0, -12, 7], "hourly": None},
    {"city": "x", "unit": "c", "at": {"lat": -1.5, "lon": 2e3}, "hourly": True, "note": 3, "mode": "fast"},
    {"city": "x", "unit": "c", "note": "n", "extra": {"k": [1, "v", {"z": False}]}},
]
INVALID = [
    {"city": "Paris"},  # a required key missing
    {"unit": "c"},
    {"city": "P", "unit": "k"},  # not in the enum
    {"city": 3, "unit": "c"},  # wrong type
    {"city": "P", "unit": "c", "days": [1.5]},
    {"city": "P", "unit": "c", "at": {"lat": 1}},
    {"city": "P", "unit": "c", "hourly": "yes"},
    {"city": "P", "unit": "c", "mode": "slow"},
]
UNDECLARED = {"city": "P", "unit": "c", "other": 1}  # the schema allows it; the grammar, as OpenAI's strict mode, not


@pytest.fixture(scope="module")
def demo(demo_pair):
    codec = TextCodec(demo_pair.target)
    return codec, llguidance.LLTokenizer(str(demo_pair.target / "tokenizer.json"))


def _accepts(tokenizer: llguidance.LLTokenizer, grammar: str, ids: list[int]) -> bool:
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    matcher.consume_tokens(ids)
    return not matcher.is_error() and matcher.is_accepting()


def _written(codec: TextCodec, name: str, args: dict) -> str:
    """The call as the chat template writes an assistant's call (Gemma-4's syntax)."""
    messages = [{"role": "user", "content": "x"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "1", "type": "function",
                                                                      "function": {"name": name, "arguments": args}}]}]  # fmt: skip
    text = codec.chat.render(messages, add_generation_prompt=False)
    return text[text.index("<|tool_call>") : text.index("<tool_call|>") + len("<tool_call|>")]


def _ids(codec: TextCodec, text: str) -> list[int]:
    return codec.tokenizer.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("choice", ["required", "get_weather"])
def test_calls_whose_arguments_satisfy_the_schema_are_accepted_and_read_back(demo, choice):
    codec, tokenizer = demo
    grammar = tool_call_grammar([WEATHER, TIME], choice)
    for args in VALID:
        jsonschema.validate(args, SCHEMA)
        call = _written(codec, "get_weather", args)
        assert _accepts(tokenizer, grammar, _ids(codec, call)), call
        assert _accepts(tokenizer, grammar, _ids(codec, call + "<|tool_response>"))
        parsed = parse_call(call[len("<|tool_call>") : -len("<tool_call|>")])
        assert parsed.name == "get_weather" and json.loads(parsed.arguments) == args


@pytest.mark.parametrize("choice", ["required", "get_weather"])
def test_calls_that_break_the_schema_or_the_syntax_are_rejected(demo, choice):
    codec, tokenizer = demo
    grammar = tool_call_grammar([WEATHER, TIME], choice)
    for args in INVALID:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(args, SCHEMA)
        call = _written(codec, "get_weather", args)
        assert not _accepts(tokenizer, grammar, _ids(codec, call)), call
    assert not _accepts(tokenizer, grammar, _ids(codec, _written(codec, "get_weather", UNDECLARED)))
    good = _written(codec, "get_weather", VALID[0])
    for bad in [
        "",  # no call at all
        "Sure. " + good,  # text before the call
        good.replace("<tool_call|>", ""),  # unfinished
        good.replace(",unit:", ", unit:"),  # a space the syntax has not
        good.replace("city:", '<|"|>city<|"|>:'),
        f"<|tool_call>call:get_weather{{city:{Q}a<|b{Q},unit:{Q}c{Q}}}<tool_call|>",  # a string holding "<|"
        "<|tool_call>call:nope{}<tool_call|>",  # not one of the tools
        good + "and then text",
    ]:
        assert not _accepts(tokenizer, grammar, _ids(codec, bad)), bad


def test_required_takes_several_calls_a_named_function_one_of_it(demo):
    codec, tokenizer = demo
    weather, time = _written(codec, "get_weather", VALID[0]), "<|tool_call>call:time{}<tool_call|>"
    required, named = tool_call_grammar([WEATHER, TIME], "required"), tool_call_grammar([WEATHER, TIME], "time")
    assert _accepts(tokenizer, required, _ids(codec, time + weather + time))
    assert _accepts(tokenizer, named, _ids(codec, time))
    for text in (weather, time + time, "<|tool_call>call:time{a:1}<tool_call|>"):
        assert not _accepts(tokenizer, named, _ids(codec, text)), text


def test_auto_with_a_strict_tool_takes_any_text_or_text_then_held_calls(demo):
    """tool_choice auto with a strict tool: the model may answer in any text (so its answer is what it would be
    unconstrained), or open calls, each then held well-formed: a strict tool's arguments to its schema, another
    tool's to any arguments."""
    codec, tokenizer = demo
    grammar = tool_call_grammar([replace(WEATHER, strict=True), TIME], "auto")
    good = _written(codec, "get_weather", VALID[2])
    loose = f"<|tool_call>call:time{{a:1,b:[{Q}x{Q},None]}}<tool_call|>"  # any arguments: time is not strict
    for text in ["", "Sure: 12 <b> a <| b\n", "Let me look. " + good, good, good + loose + "<|tool_response>",
                 "x <|tool_call" + "_like text"]:  # fmt: skip
        assert _accepts(tokenizer, grammar, _ids(codec, text)), text
    for args in INVALID:
        assert not _accepts(tokenizer, grammar, _ids(codec, "Text. " + _written(codec, "get_weather", args)))
    for bad in ["<|tool_call>call:nope{}<tool_call|>", "<|tool_call>call:time{a:}<tool_call|>",
                good + "and then text", "a <|tool_call> b", good.replace("<tool_call|>", "")]:  # fmt: skip
        assert not _accepts(tokenizer, grammar, _ids(codec, bad)), bad


def test_auto_masks_after_rolled_back_candidates_are_those_of_a_fresh_matcher(demo, demo_pair):
    """The verifier computes each block's masks by taking its candidates and rolling them back: with the
    auto grammar that must leave the state as it was (a ``stop=`` lexeme did not: the block after a rolled
    back one allowed only EOS)."""
    from kakeya.core.constraints import Grammar

    codec, _ = demo
    tok = llguidance.LLTokenizer(str(demo_pair.target / "tokenizer.json"), eos_token=[1])
    grammar = tool_call_grammar([replace(WEATHER, strict=True)], "auto")
    ids = _ids(codec, "#\n#\n Sure <b> here it is: " + _written(codec, "get_weather", VALID[3]))
    rolled = Grammar(grammar, tok)
    for k in range(0, len(ids) - 4, 3):
        rolled.bitmask(ids[k : k + 5])  # five candidates taken and rolled back, three of them then committed
        rolled.advance(ids[k : k + 3])
        fresh = Grammar(grammar, tok)
        fresh.advance(ids[: k + 3])
        assert (rolled.bitmask([]) == fresh.bitmask([])).all(), k


def test_special_token_markers_match_by_id_not_by_text(demo_pair, tmp_path):
    shutil.copytree(demo_pair.target, tmp_path / "t", ignore=shutil.ignore_patterns("*.safetensors"))
    tok = Tokenizer.from_file(str(tmp_path / "t" / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in MARKERS])
    tok.save(str(tmp_path / "t" / "tokenizer.json"))
    terms = marker_terms(tok)
    assert terms["<|tool_call>"] == f"<[{tok.token_to_id('<|tool_call>')}]>"
    grammar = tool_call_grammar([WEATHER], "required", terms)
    tokenizer = llguidance.LLTokenizer(str(tmp_path / "t" / "tokenizer.json"))
    call = f"<|tool_call>call:get_weather{{city:{Q}Pa<b>ris{Q},unit:{Q}c{Q}}}<tool_call|>"
    ids = tok.encode(call, add_special_tokens=False).ids
    assert tok.token_to_id(Q) in ids and _accepts(tokenizer, grammar, ids)
    # the same text with the markers spelled in ordinary pieces (no special token) is no call
    spelled = [i for piece in call.replace(Q, "\0").split("\0") for i in [*_pieces(tok, piece), *_pieces(tok, Q)]]
    assert tok.token_to_id(Q) not in spelled and not _accepts(tokenizer, grammar, spelled)
    auto = tool_call_grammar([replace(WEATHER, strict=True)], "auto", terms)
    assert _accepts(tokenizer, auto, tok.encode("Sure. " + call, add_special_tokens=False).ids)
    assert _accepts(tokenizer, auto, tok.encode("Text <|tool_ca alone", add_special_tokens=False).ids)
    assert not _accepts(
        tokenizer, auto, tok.encode("Sure. " + call.replace(",unit", ",u"), add_special_tokens=False).ids
    )


def _pieces(tok: Tokenizer, text: str) -> list[int]:
    """``text`` in ordinary tokens, one character at a time (so no special token can match it)."""
    return [i for ch in text for i in tok.encode(ch, add_special_tokens=False).ids]


@pytest.mark.parametrize(
    ("schema", "says"),
    [
        ({"type": "object", "properties": {"s": {"type": "array", "uniqueItems": True}}}, "s.uniqueItems: unique"),
        ({"type": "object", "properties": {"n": {"not": {"type": "integer"}}}}, "n.not: this schema keyword"),
        ({"type": "object", "patternProperties": {"^a": {}}}, "patternProperties: this schema keyword"),
        ({"type": "object", "properties": {"r": {"$ref": "#/x"}}}, "r.$ref: '#/x' points at nothing"),
        ({"type": "object", "properties": {"r": {"$ref": "https://x.org/s.json"}}}, "r.$ref: 'https://x.org/s.json'"),
        ({"type": "object", "properties": {"s": {"type": "string", "format": ["uri"]}}}, "s.format: must be a string"),
        ({"type": "object", "properties": {"s": {"type": "string", "pattern": "(?=a)b"}}}, "s.pattern: cannot be"),
        ({"type": "object", "properties": {"s": {"type": "string", "pattern": "a(^b)"}}}, "s.pattern: an anchor"),
        (
            {"type": "object", "properties": {"s": {"type": "string", "minLength": 3, "maxLength": 2}}},
            "s.maxLength: 2 is below minLength 3",
        ),
        ({"type": "object", "properties": {"n": {"type": "integer", "minimum": "1"}}}, "n.minimum: must be a number"),
        ({"type": "object", "properties": {"n": {"type": "integer", "minimum": 2, "maximum": 1}}}, "n: integer bounds"),
        ({"type": "object", "properties": {"a": {"type": "array", "maxItems": 10**6}}}, "a: minItems/maxItems above"),
        (
            {"type": "object", "properties": {"a": {"allOf": [{"type": "string"}, {"type": "integer"}]}}},
            "a.allOf[1].type: the schemas of an allOf share no type",
        ),
        (
            {"type": "object", "properties": {"a": {"allOf": [{"pattern": "a"}, {"pattern": "b"}]}}},
            "a.allOf[1].pattern: set differently",
        ),
        (
            {
                "type": "object",
                "properties": {
                    "m": {"type": "object", "properties": {"k": {}}, "additionalProperties": {"type": "integer"}}
                },
            },
            "m.additionalProperties: a schema for keys beside properties",
        ),
        ({"type": "object", "properties": {"m": {"type": "object", "minProperties": 1}}}, "m.minProperties"),
        (
            {"type": "object", "properties": {"t": {"type": "array", "prefixItems": [{}, {}], "minItems": 1}}},
            "t.prefixItems: held only where minItems",
        ),
        ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "required"),
        ({"type": "object", "properties": {"t": {"type": "date"}}}, "'date'"),
        ({"type": "object", "properties": {"a": {"anyOf": 5}}}, "anyOf: must be a non-empty list"),
        ({"type": "object", "properties": {"a": {"oneOf": [5]}}}, "oneOf[0]: a schema must be an object"),
        ({"type": "object", "properties": {"a": {"type": 5}}}, "a.type: must be a type's name"),
        ({"type": "object", "properties": {"a": {"type": [{"x": 1}]}}}, "a.type: must be a type's name"),
        ({"type": "object", "properties": {"a": {"properties": {}, "required": 5}}}, "a.required: must be a list"),
        ({"type": "object", "properties": {"a": {"properties": {}, "required": [{}]}}}, "a.required: must be a list"),
        ({"type": "object", "properties": {"a": {"type": "object", "properties": 5}}}, "a.properties: must be an"),
        ({"type": "object", "properties": {"a": {"type": 0}}}, "a.type: must be a type's name"),
        ({"type": "object", "properties": {"a": {"properties": {}, "required": False}}}, "a.required: must be a"),
        ({"type": "object", "properties": {"a": {"anyOf": []}}}, "a.anyOf: must be a non-empty list of schemas"),
    ],
)
def test_a_schema_the_grammar_cannot_hold_is_refused_by_name(schema, says):
    """Named by the tool's index and the place in its schema (each front spells the tool's field its own way);
    a keyword of the wrong type is refused as one the grammar cannot hold, never a TypeError (the fuzz of
    issue 43 found ``anyOf: 5``, ``type: 5``, ``required: 5`` and unhashable types answered with a 500); a keyword
    beyond what the grammar holds (issue 58: the rest are held, ``test_tool_schemas.py``) by its own place."""
    with pytest.raises(GrammarError) as err:
        tool_call_grammar([TIME, Tool("f", "", schema)], "required")
    assert err.value.tool == 1 and says in str(err.value), err.value
    for choice in ("auto", "none", "other"):
        with pytest.raises(GrammarError):
            tool_call_grammar([TIME], choice)


def test_a_refusal_quotes_a_long_type_name_cut_as_every_client_value_is():
    """docs/security.md: error texts quote a client's value at most 64 characters long. A 500-character ``type``
    came back whole (beside a long property name it pushed the reason past the status's 1024 characters)."""
    with pytest.raises(GrammarError) as err:
        tool_call_grammar([Tool("f", "", {"type": "object", "properties": {"a": {"type": "t" * 500}}})], "required")
    assert str(err.value).endswith(" is not a JSON schema type") and "t" * 64 not in str(err.value), err.value


def test_parallel_tool_calls_false_holds_at_most_one_call(demo):
    """``parallel_tool_calls: false`` (issue 58): ``required`` takes one call, then the grammar ends; ``auto`` is
    held too, even with no strict tool, so text or text and one call (any arguments) and nothing after."""
    codec, tokenizer = demo
    weather, time = _written(codec, "get_weather", VALID[0]), "<|tool_call>call:time{}<tool_call|>"
    one = tool_call_grammar([WEATHER, TIME], "required", parallel=False)
    assert _accepts(tokenizer, one, _ids(codec, weather)) and _accepts(tokenizer, one, _ids(codec, time))
    assert _accepts(tokenizer, one, _ids(codec, time + "<|tool_response>"))
    assert not _accepts(tokenizer, one, _ids(codec, time + weather))
    assert holds_calls([WEATHER, TIME], "auto", parallel=False) and not holds_calls([WEATHER, TIME], "auto")
    auto = tool_call_grammar([WEATHER, TIME], "auto", parallel=False)
    loose = f"<|tool_call>call:time{{a:1,b:[{Q}x{Q}]}}<tool_call|>"  # time is not strict: any arguments
    for text in ["", "Plain text <b>", "Let me see. " + weather, loose + "<|tool_response>"]:
        assert _accepts(tokenizer, auto, _ids(codec, text)), text
    for text in [weather + time, "x " + loose + loose, weather + " and text"]:
        assert not _accepts(tokenizer, auto, _ids(codec, text)), text


DEFS = {"N": {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {"type": "array",
                                                                                  "items": {"$ref": "#/$defs/N"}}},
              "required": ["v"]}, "I": {"type": "integer", "minimum": 1}}  # fmt: skip
KEYWORDS = [  # (the schema of one argument "x", values it takes, values it refuses)
    ({"type": "string", "pattern": "b+"}, ["abba", "b"], ["acc", ""]),  # found anywhere, as JSON schema reads it
    ({"type": "string", "pattern": "^a|c$"}, ["axx", "xxc", "a"], ["xax", "cx"]),
    ({"type": "string", "pattern": r"^\d{2}$"}, ["07"], ["7", "123", "ab"]),
    ({"type": "string", "minLength": 2, "maxLength": 3}, ["ab", "a<c"], ["a", "abcd"]),
    ({"type": "string", "format": "uuid"}, ["123e4567-e89b-12d3-a456-426614174000"], ["123e4567", "x"]),
    ({"type": "string", "format": "email"}, ["a.b@example.org"], ["a@", "ab"]),
    ({"type": "string", "format": "date-time"}, ["2026-12-06T05:00:00Z"], ["2026-12-06", "2026-12-06T25:00:00Z"]),
    ({"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10, "multipleOf": 3}, [3, 9], [0, 10, 4, 12]),
    ({"type": "number", "minimum": -1.5, "maximum": 2}, [-1.5, 0.25, 2], [-2, 2.5]),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2}, [[1], [1, 2]], [[], [1, 2, 3]]),
    ({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "minItems": 2, "maxItems": 2},
     [[1, "a"]], [[1], ["a", 1], [1, "a", 2]]),
    ({"$ref": "#/$defs/N"}, [{"v": 1, "kids": [{"v": 2, "kids": []}, {"v": 3}]}], [{"v": 1, "kids": [{"kids": []}]}]),
    ({"$ref": "#/$defs/I", "maximum": 5}, [1, 5], [0, 6]),  # $ref beside a keyword: merged as an allOf
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"properties": {"b": {"type": "string", "maxLength": 1}}}]},
     [{"a": 1, "b": "z"}, {"a": 1}], [{"b": "z"}, {"a": 1, "b": "zz"}]),
    ({"type": "object", "additionalProperties": {"type": "integer"}}, [{"a": 1, "b": 2}, {}], [{"a": "x"}]),
]  # fmt: skip


@pytest.mark.parametrize(("schema", "good", "bad"), KEYWORDS)
def test_the_keywords_response_format_holds_hold_a_call_too(demo, schema, good, bad):
    """Issue 58: string patterns (JSON schema's search semantics), lengths and formats, number bounds, list
    sizes and tuples, ``$ref`` (recursive too), ``allOf`` and maps are held, as ``response_format`` holds them:
    what the schema takes is accepted, what it refuses is refused (checked against jsonschema first; a format
    against llguidance's regex for it, the one ``response_format`` holds)."""
    codec, tokenizer = demo
    params = {"type": "object", "properties": {"x": schema}, "required": ["x"], "$defs": DEFS}
    grammar = tool_call_grammar([Tool("f", "", params)], "f")
    for value, takes in [(v, True) for v in good] + [(v, False) for v in bad]:
        if "format" not in schema:  # jsonschema checks formats loosely offline ("a@" is an email to it)
            assert jsonschema.Draft202012Validator(params).is_valid({"x": value}) == takes, value
        assert _accepts(tokenizer, grammar, _ids(codec, _written(codec, "f", {"x": value}))) == takes, value


def test_auto_beside_a_json_answer_takes_that_json_or_calls(demo):
    """tools beside ``response_format`` (the ``openai`` SDK's ``parse(tools=..., response_format=Model)``,
    langchain's ``bind_tools(..., response_format=...)``): the answer is the JSON its schema takes, written as
    every JSON answer is, or calls (a strict tool's held to its schema); no free text, no JSON then a call."""
    codec, tokenizer = demo
    answer = {"type": "object", "properties": {"summary": {"type": "string", "maxLength": 5}}, "required": ["summary"]}
    grammar = tool_call_grammar([replace(WEATHER, strict=True), TIME], "auto", answer=answer)
    weather, time = _written(codec, "get_weather", VALID[0]), "<|tool_call>call:time{}<tool_call|>"
    for text in ['{"summary": "sun"}', weather, weather + time + "<|tool_response>"]:
        assert _accepts(tokenizer, grammar, _ids(codec, text)), text
    bad = ['{"summary":"sun"}', '{"summary": "sunny!"}', "", "Sure.", '{"summary": "a"}' + time, "Sure. " + weather]
    for text in bad + ["Text. " + _written(codec, "get_weather", INVALID[0])]:
        assert not _accepts(tokenizer, grammar, _ids(codec, text)), text
    loose = tool_call_grammar([TIME], "auto", answer=answer | {"x-guidance": {"whitespace_flexible": True}})
    assert not _accepts(tokenizer, loose, _ids(codec, '{"summary":"sun"}'))  # its x-guidance an annotation


def test_a_string_enum_of_thousands_of_values_holds_a_call(demo):
    """Found driving ``tool_choice="required"`` over HTTP: a tool whose argument is an enum of 2100 strings (airport
    codes, time zones) was a 400 on ``tool_choice`` that quoted llguidance's parser ("Current row has 2100 items;
    max is 2000"), and under ``auto`` with a strict tool it would fail once a call opened. ``response_format``'s
    JSON schema takes the same enum. Each value is now one lexeme's alternative, as llguidance writes a JSON enum."""
    codec, tokenizer = demo
    values = [f"v{i}" for i in range(2100)] + ["Europe/Paris", "São Paulo", 'a "b" | c.*', "x\ny\\"]
    tool = Tool("pick", "", {"type": "object", "properties": {"code": {"enum": values}}, "required": ["code"]})
    for choice in ["required", "pick"]:
        grammar = tool_call_grammar([tool], choice)
        for value in ["v0", "v2099", "v20", "Europe/Paris", "São Paulo", 'a "b" | c.*', "x\ny\\"]:
            assert _accepts(tokenizer, grammar, _ids(codec, _written(codec, "pick", {"code": value})))
        for value in ["v2100", "v", "w1", "", "Europe", "a "]:
            assert not _accepts(tokenizer, grammar, _ids(codec, _written(codec, "pick", {"code": value})))
