"""JSON schemas and regexes the constrained tests decode against: nested objects, arrays, enums, numbers,
string patterns, optional fields."""

from __future__ import annotations

import json
import re

import jsonschema

from kakeya.core.constraints import Constraint

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["admin", "user", "guest"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
}
NESTED = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[a-f0-9]{4}$"},
        "point": {
            "type": "object",
            "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
            "required": ["x", "y"],
        },
        "note": {"type": "string", "maxLength": 10},  # optional
        "ok": {"type": "boolean"},
    },
    "required": ["id", "point", "ok"],
    "additionalProperties": False,
}
LIST = {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 5}

SCHEMAS = {"person": PERSON, "nested": NESTED, "list": LIST}
REGEXES = {"phone": r"\(\d{3}\) \d{3}-\d{4}", "ident": r"[a-z_][a-z0-9_]{0,12}\(\)", "date": r"20\d\d-(0[1-9]|1[0-2])"}

PROMPTS = ("def describe(person):\n    return ", "import json\n\nCONFIG = ")


def constraints() -> dict[str, Constraint]:
    out = {k: Constraint("json_schema", v) for k, v in SCHEMAS.items()}
    out |= {k: Constraint("regex", v) for k, v in REGEXES.items()}
    out["choice"] = Constraint("choice", ["alpha", "beta", "gamma delta"])
    out["object"] = Constraint("json_object")
    out["lark"] = Constraint("grammar", 'start: "x = " NUMBER | "x = " NUMBER " + " NUMBER\nNUMBER: /[0-9]{1,3}/')
    return out


def assert_matches(name: str, c: Constraint, text: str) -> None:
    """A finished output (it ended at EOS) satisfies its constraint."""
    if c.kind == "json_schema":
        jsonschema.validate(json.loads(text), c.spec)
    elif c.kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif c.kind == "regex":
        assert re.fullmatch(c.spec, text), (name, text)
    elif c.kind == "choice":
        assert text in c.spec, text
    else:
        assert re.fullmatch(r"x = [0-9]{1,3}( \+ [0-9]{1,3})?", text), text
