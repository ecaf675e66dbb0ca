"""A constraint is compiled once at the request's check: a bad one is refused naming its field, before any
model work; and the grammar state's masks, rollback and forced tokens behave as the verifier relies on."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kakeya.core.constraints import MAX_SPEC_CHARS, Constraint, ConstraintError, Grammar, tokenizer, unpack
from kakeya.core.request import InvalidRequest, Request


@pytest.mark.parametrize(
    "constraint, field",
    [
        (Constraint("regex", "a("), "constraint.spec"),
        (Constraint("regex", ""), "constraint.spec"),
        (Constraint("json_schema", "{not json"), "constraint.spec"),
        (Constraint("json_schema", "[1, 2]"), "constraint.spec"),
        (Constraint("json_schema", {"type": "object", "properties": {"a": {"type": "nonsense"}}}), "constraint.spec"),
        (Constraint("grammar", "start: undefined_rule"), "constraint.spec"),
        (Constraint("choice", []), "constraint.spec"),
        (Constraint("choice", ["a", 3]), "constraint.spec"),
        (Constraint("xml"), "constraint.kind"),
    ],
)
def test_a_bad_constraint_is_refused_naming_its_field(engine, constraint, field):
    with pytest.raises(InvalidRequest) as info:
        engine.check(Request(engine.codec.encode("x = "), max_tokens=4, constraint=constraint))
    assert info.value.field == field
    assert len(str(info.value)) < 400  # a bounded message, never the compiler's whole dump


def test_ignore_eos_with_a_constraint_is_refused(engine):
    with pytest.raises(InvalidRequest) as info:
        engine.check(Request([2, 40], max_tokens=4, ignore_eos=True, constraint=Constraint("json_object")))
    assert info.value.field == "ignore_eos"


def test_a_good_constraint_passes_the_check(engine):
    req = engine.check(Request([2, 40], max_tokens=4, constraint=Constraint("regex", "[ab]+")))
    assert req.constraint == Constraint("regex", "[ab]+")


@pytest.fixture(scope="module")
def tok(engine):
    info = engine.verifier.info
    return tokenizer(engine.codec.tokenizer_json, info.vocab_size, info.eos_token_ids[:1])


def _masks(g: Grammar, candidates) -> np.ndarray:
    """``g``'s allowed tokens after the committed prefix and each run of ``candidates``, as bools to read."""
    return unpack(g.bitmask(candidates), g.vocab)


def test_masks_follow_the_candidates_and_leave_the_state_as_it_was(engine, tok):
    g = Grammar(Constraint("choice", ["yes", "no"]).grammar(), tok)
    yes = engine.codec.tokenizer.encode("yes", add_special_tokens=False).ids
    before = _masks(g, [])
    rows = _masks(g, yes)
    assert rows.shape == (len(yes) + 1, engine.verifier.info.vocab_size)
    assert (_masks(g, []) == before).all()  # the candidates were rolled back
    assert all(rows[i, t] for i, t in enumerate(yes))  # each candidate allowed where it stands
    eos = engine.verifier.info.eos_token_ids[0]
    assert rows[-1].sum() == 1 and rows[-1, eos]  # after "yes" only EOS
    assert not before[0, eos]  # nothing finished yet: no EOS
    g.advance(yes)
    assert g.finished and _masks(g, [])[0].nonzero()[0].tolist() == [eos]


def test_a_refused_candidate_leaves_later_rows_open(engine, tok):
    g = Grammar(Constraint("regex", "[0-9]+").grammar(), tok)
    letter = engine.codec.tokenizer.encode("x", add_special_tokens=False).ids[0]
    rows = _masks(g, [letter, letter])
    assert not rows[0, letter] and rows[1:].all()  # never reached by the acceptance rule


def test_forced_tokens_are_the_grammars_fixed_text(engine, tok):
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    g = Grammar(Constraint("json_schema", schema).grammar(), tok)
    assert engine.codec.decode(g.forced()).startswith('{"name":')  # the fixed text up to where a token may merge
    with pytest.raises(RuntimeError):
        g.advance([int(np.argmin(_masks(g, [])[0]))])  # a token the grammar refuses is never committed silently


def test_a_grammar_that_fails_to_compile_raises(tok):
    with pytest.raises(ConstraintError):
        Grammar(Constraint("regex", "(").grammar(), tok)


def test_the_guide_cuts_a_draft_before_the_first_refused_candidate(engine, tok):
    from kakeya.orchestrator.proposers import Guide

    guide = Guide(Grammar(Constraint("regex", "[0-9]{3}x").grammar(), tok))
    enc = engine.codec.tokenizer
    one, two = enc.encode("1", add_special_tokens=False).ids, enc.encode("2a3x", add_special_tokens=False).ids
    assert guide.allowed_prefix(one, two) == 1  # after "1": "2" yes, "a" no
    assert guide.allowed_prefix(one, enc.encode("23x", add_special_tokens=False).ids) == 3
    assert guide.forced(one, 4) == ()  # digits are free: nothing forced


def test_only_formats_llguidance_has_no_regex_for_are_left_out():
    """``plain_formats``: a ``format`` llguidance has no regex for goes, its own stay; a property named ``format`` or
    ``enum``, and values (``const``, ``enum``, ``default``) holding a key ``format``, are not touched."""
    from kakeya.core.constraints import plain_formats

    value = {"format": "pdf"}
    schema = {
        "type": "object",
        "properties": {
            "format": {"type": "string", "format": "password"},
            "enum": {"type": "string", "format": "uuid", "enum": [value]},
            "kind": {"const": value, "default": value},
            "many": {"type": "array", "items": {"anyOf": [{"format": "binary"}, {"format": "date"}]}},
        },
        "$defs": {"P": {"format": "path", "type": "string"}},
    }
    assert plain_formats(schema) == {
        "type": "object",
        "properties": {
            "format": {"type": "string"},
            "enum": {"type": "string", "format": "uuid", "enum": [value]},
            "kind": {"const": value, "default": value},
            "many": {"type": "array", "items": {"anyOf": [{}, {"format": "date"}]}},
        },
        "$defs": {"P": {"type": "string"}},
    }
    Constraint("json_schema", schema).grammar()  # compiles


def test_a_schema_holding_an_integer_beyond_64_bits_is_held(engine, tok):
    """Valid JSON Schema with an integer past 64 bits -- pydantic's ``Field(le=10**20)``, a big ``default`` or
    ``enum`` value -- was a 400 'Value is not JSON serializable: 100000000000000000000' at the request's check."""
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": 0, "maximum": 10**20, "default": 10**20},
            "c": {"enum": [10**30]},
        },
        "required": ["n", "c"],
    }
    constraint = Constraint("json_schema", schema)
    engine.check(Request(engine.codec.encode("x = "), max_tokens=4, constraint=constraint))
    encode = lambda text: engine.codec.tokenizer.encode(text, add_special_tokens=False).ids
    g = Grammar(constraint.grammar(), tok)
    assert g.allowed_prefix(encode('{"n": -1')) < len(encode('{"n": -1'))  # the bound is held
    assert g.allowed_prefix(encode('{"n": 5, "c": 1e30')) < len(encode('{"n": 5, "c": 1e30'))  # the enum's own digits
    g.advance(encode(f'{{"n": 5, "c": {10**30}}}') + [g.eos])
    assert g.finished


def test_a_schema_is_measured_as_compact_json():
    """``MAX_SPEC_CHARS`` bounds a schema as compact JSON (docs/structured.md): an enum of 11,000 codes is 89,070
    characters so, 100,076 with the ``", "`` and ``": "`` separators it was counted with, and was refused."""
    schema = {
        "type": "object",
        "properties": {"code": {"enum": [f"c{i:04d}" for i in range(11000)]}},
        "required": ["code"],
    }
    assert len(json.dumps(schema, separators=(",", ":"))) < MAX_SPEC_CHARS < len(json.dumps(schema))
    Constraint("json_schema", schema).grammar()
    with pytest.raises(ConstraintError, match=f"longer than {MAX_SPEC_CHARS} characters"):
        Constraint("json_schema", {"enum": [f"c{i:05d}" for i in range(12000)]}).grammar()


def test_a_schema_sent_as_indented_text_is_measured_as_compact_json():
    """A schema file as editors and ``json.dumps(indent=2)`` write it (``kakeya client generate --json-schema FILE``,
    gRPC's ``constraint.json_schema``, a ``guided_json`` string) is bounded by its compact JSON, as the same schema
    sent as an object is: 92,704 characters compact, 134,752 indented, was 'longer than 100000 characters'."""
    fields = {f"field_{i}": {"type": "string", "maxLength": 20, "description": f"The {i}th field"} for i in range(1200)}
    schema = {"type": "object", "properties": fields, "required": list(fields)[:5], "additionalProperties": False}
    text = json.dumps(schema, indent=2)
    assert len(json.dumps(schema, separators=(",", ":"))) < MAX_SPEC_CHARS < len(text)
    assert Constraint("json_schema", text).grammar() == Constraint("json_schema", schema).grammar()


def test_a_schema_with_non_ascii_text_is_measured_by_its_characters():
    """Descriptions in Chinese (pydantic's ``Field(description=...)``) count one character each, not the six of the
    ``\\uXXXX`` escape ``json.dumps`` writes by default: 71,940 characters, 221,940 escaped, was refused."""
    fields = {f"f{i}": {"type": "string", "description": "用户的名字和地址信息" * 3} for i in range(1000)}
    schema = {"type": "object", "properties": fields, "required": ["f0"]}
    assert len(json.dumps(schema, separators=(",", ":"), ensure_ascii=False)) < MAX_SPEC_CHARS
    Constraint("json_schema", schema).grammar()


def test_a_schemas_x_guidance_is_an_annotation_not_the_servers_options(engine, tok):
    """A vendor key ``x-...`` is an annotation (docs/structured.md), ``x-guidance`` too: it neither makes llguidance
    lenient, silently dropping a keyword it would refuse (``uniqueItems``), nor frees the fixed JSON style."""
    refused = {"type": "array", "uniqueItems": True, "x-guidance": {"lenient": True}}
    with pytest.raises(ConstraintError, match="uniqueItems"):
        Grammar(Constraint("json_schema", refused).grammar(), tok)
    loose = Grammar(
        Constraint("json_schema", {"type": "object", "x-guidance": {"whitespace_flexible": True}}).grammar(), tok
    )
    padded = engine.codec.tokenizer.encode('{ \n "a": 1}', add_special_tokens=False).ids
    assert loose.allowed_prefix(padded) < len(padded)


def test_unique_items_false_asks_for_nothing_and_is_held(tok):
    """``uniqueItems: false`` is JSON Schema's default (no constraint), which a tool's parameters take; in
    ``response_format`` it was refused as 'Unimplemented keys: ["uniqueItems"]'. ``true`` stays refused."""
    lists = {"type": "array", "items": {"type": "integer"}, "maxItems": 2}
    schema = {"type": "object", "properties": {"ids": lists | {"uniqueItems": False}}, "required": ["ids"]}
    Grammar(Constraint("json_schema", schema).grammar(), tok)
    with pytest.raises(ConstraintError, match="uniqueItems"):
        Grammar(Constraint("json_schema", lists | {"uniqueItems": True}).grammar(), tok)


def test_a_choice_spelling_the_eos_tokens_text_ends_at_eos_not_a_500(engine, tok):
    """``guided_choice: ["<eos>x"]``: llguidance's mask allows EOS where the grammar's next text is ``<eos>``, its
    text, as it allowed ``<pad>`` for ``["<pad>"]`` (test_fuzz_found), and its matcher refuses it: the verifier chose
    it and the request failed ('constraint: committed token 1 is outside the grammar', a 500). No other token spells
    the text here, so the generation ends at EOS, as ``["<pad>"]``'s does (docs/structured.md)."""
    c = Constraint("choice", ["<eos>x"])
    g = Grammar(c.grammar(), tok)
    assert g.matcher.validate_tokens([tok.eos_token]) == 0 and not g.ended  # EOS: the mask's, not the grammar's
    for block in (1, 8):
        out = engine.generate(Request(engine.codec.encode("x = "), max_tokens=12, block_size=block, constraint=c))
        assert out.token_ids == [tok.eos_token] and out.finish_reason == "stop", block


def test_a_oneof_refusal_gives_advice_a_client_can_follow(tok):
    """``oneOf`` branches llguidance cannot prove disjoint (``integer`` and ``number``) are refused, and the refusal
    said 'Enable 'coerce_one_of' option': a server option no client sets (a schema's own x-guidance is an annotation
    here). It says what the client can do: anyOf."""
    with pytest.raises(ConstraintError) as info:
        Grammar(Constraint("json_schema", {"oneOf": [{"type": "integer"}, {"type": "number"}]}).grammar(), tok)
    assert "oneOf" in str(info.value) and "anyOf" in str(info.value) and "coerce_one_of" not in str(info.value)


def test_strict_true_closes_objects_that_do_not_say_additional_properties(engine, tok):
    """``strict: true`` means what OpenAI's strict mode (and vLLM's) means: an object schema without
    ``additionalProperties`` takes no other keys. A raw pydantic ``model_json_schema()`` sent with it let the model add
    keys; without strict, JSON Schema's default (any other key) holds. ``tools[].function.strict`` alike."""
    from kakeya.orchestrator.fronts import http_api

    inner = {"type": "object", "properties": {"properties": {"type": "integer"}}, "required": ["properties"]}
    schema = {"$defs": {"In": inner}, "type": "object", "properties": {"a": {"anyOf": [{"$ref": "#/$defs/In"}]}},
              "required": ["a"]}  # fmt: skip
    texts = ['{"a": {"properties": 1}}', '{"a": {"properties": 1, "x": 2}}', '{"a": {"properties": 1}, "y": 3}']

    def taken(strict: bool) -> list[bool]:
        fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": strict}}
        body = {"messages": [{"role": "user", "content": "hi"}], "response_format": fmt}
        g = Grammar(http_api.chat_request(body, "m")[0].constraint.grammar(), tok)
        ids = [engine.codec.tokenizer.encode(t, add_special_tokens=False).ids for t in texts]
        return [g.allowed_prefix(i) == len(i) for i in ids]

    assert taken(False) == [True, True, True]
    assert taken(True) == [True, False, False]
    assert schema["properties"]["a"] == {"anyOf": [{"$ref": "#/$defs/In"}]}  # the client's own schema is not changed
    body = {"type": "function", "function": {"name": "f", "parameters": inner, "strict": True}}
    from kakeya.orchestrator.fronts import http_params

    assert http_params.tools([body])[0].parameters["additionalProperties"] is False
