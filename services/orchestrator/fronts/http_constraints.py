"""The HTTP front's constraint parameters -> one :class:`~kakeya.core.constraints.Constraint`.

OpenAI's ``response_format`` (chat): ``{"type": "text"}`` (nothing), ``{"type": "json_object"}``, or
``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``; the output is held to the schema
whatever ``strict`` says (a non-strict schema is only a hint to OpenAI's models; here it is kept exactly).
vLLM's extras: ``guided_json`` (a schema, object or text), ``guided_regex``, ``guided_choice`` (strings),
``guided_grammar`` (a Lark grammar), and its newer ``structured_outputs`` object with one of ``json``,
``regex``, ``choice``, ``grammar`` or ``json_object``. A request may send one of these; two are a 400 naming
both. :func:`constraint` also says which parameter carried it, so the engine's refusal of the constraint's
spec names the parameter the client sent (``guided_regex``, ``response_format.json_schema.schema``).
"""

from __future__ import annotations

from collections.abc import Callable

from kakeya.core.constraints import Constraint
from kakeya.runtime.lifecycle import quote

GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def constraint(body: dict, bad: Callable[[str, str], Exception]) -> tuple[Constraint | None, dict[str, str]]:
    """The one constraint ``body`` asks for (None: none) and the field names for its refusals
    (``constraint.spec`` -> the parameter that carried it). ``bad(param, message)``: the 400 to raise."""
    found: list[tuple[str, str, Constraint]] = []  # (parameter, its spec's public name, constraint)
    rf = _response_format(body.get("response_format"), bad)
    if rf is not None:
        found.append(("response_format", *rf))
    for name, kind in GUIDED.items():
        if body.get(name) is not None:
            found.append((name, name, Constraint(kind, _spec(body[name], kind, name, bad))))
    so = _structured(body.get("structured_outputs"), bad)
    if so is not None:
        found.append(("structured_outputs", *so))
    if len(found) > 1:
        names = ", ".join(p for p, _, _ in found)
        raise bad(found[1][0], f"one constraint per request: {names} were sent together")
    if not found:
        return None, {}
    param, spec_name, c = found[0]
    return c, {"constraint": param, "constraint.spec": spec_name, "constraint.kind": param}


def _spec(value, kind: str, name: str, bad):
    """The spec of a ``kind`` as JSON carries it: a schema object or text, a list of strings, a string."""
    if kind == "json_schema":
        if not isinstance(value, (dict, str)):
            raise bad(name, "must be a JSON schema (an object, or its JSON text)")
        return value
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(s, str) and s for s in value):
            raise bad(name, "must be a non-empty list of non-empty strings")
        return tuple(value)
    if not isinstance(value, str) or not value:
        raise bad(name, "must be a non-empty string")
    return value


def _response_format(value, bad) -> tuple[str, Constraint] | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if not isinstance(kind, str):
        raise bad("response_format", 'must be an object with a "type"')
    if kind == "text":
        return None
    if kind == "json_object":
        return "response_format", Constraint("json_object")
    if kind != "json_schema":
        raise bad("response_format", f'type {quote(kind)} is not supported: "text", "json_object" or "json_schema"')
    js = value.get("json_schema")
    if not isinstance(js, dict):
        raise bad("response_format.json_schema", 'must be an object with a "schema" (and a "name")')
    strict = js.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad("response_format.json_schema.strict", "must be true or false")
    schema = js.get("schema")
    if not isinstance(schema, dict):
        raise bad("response_format.json_schema.schema", "must be a JSON schema object")
    return "response_format.json_schema.schema", Constraint("json_schema", schema)


def _structured(value, bad) -> tuple[str, Constraint] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad("structured_outputs", "must be an object")
    unknown = sorted(k for k in value if k not in STRUCTURED and k != "json_object")
    if unknown:
        raise bad(
            f"structured_outputs.{quote(unknown[0])}", "is not supported: json, regex, choice, grammar or json_object"
        )
    sent = [k for k, v in value.items() if v is not None and v is not False]
    if len(sent) != 1:
        raise bad(
            "structured_outputs",
            f"must hold exactly one of json, regex, choice, grammar, json_object (got {len(sent)})",
        )
    key = sent[0]
    name = f"structured_outputs.{key}"
    if key == "json_object":
        if value[key] is not True:
            raise bad(name, "must be true")
        return name, Constraint("json_object")
    return name, Constraint(STRUCTURED[key], _spec(value[key], STRUCTURED[key], name, bad))
