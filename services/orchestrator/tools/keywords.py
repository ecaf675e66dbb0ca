"""The JSON-schema keywords of a tool's parameters beyond their shape, turned into what the tool-call grammar needs.

A string's ``pattern``, ``minLength``/``maxLength`` and ``format`` become a regex of the text between its ``<|"|>``
marks (Gemma-4's strings are raw text, not JSON, so ``%json`` cannot hold them), each part checked by llguidance here so
a bad ``pattern`` is refused by its place in the schema. A number's bounds and ``multipleOf`` go to llguidance's own
JSON-schema number (written the same in a call as in JSON). ``$ref`` is resolved, ``allOf`` merged. A keyword that
cannot be held is a :class:`GrammarError` naming its place.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import llguidance

from kakeya.core.constraints import FORMATS

ANNOTATIONS = {"description", "title", "default", "examples", "$schema", "$comment", "deprecated", "readOnly",
               "writeOnly", "$id", "$defs", "definitions", "discriminator", "example", "contentMediaType",
               "contentEncoding", "contentSchema"}  # and vendor keys, x-...  # fmt: skip
NUMERIC = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
SHAPE = {"type", "properties", "required", "enum", "const", "anyOf", "oneOf", "allOf", "nullable", "$ref",
         "additionalProperties", "minProperties", "maxProperties"}  # fmt: skip
KNOWN = SHAPE | set(NUMERIC) | {"pattern", "minLength", "maxLength", "format", "items", "prefixItems", "minItems",
                                 "maxItems", "uniqueItems"}  # a string's, an array's  # fmt: skip
MAX_REF_DEPTH = 16  # $ref to $ref to ... inside an allOf, which is merged (not a rule) and so inlined
MAX_ITEMS = 256  # the largest minItems / maxItems bound spelt out as repetitions


class GrammarError(ValueError):
    """A tool this grammar cannot hold a call to: ``tool``, its index; ``at``, where in its parameters' schema
    (``properties.city.items``; "" for the schema itself); ``reason``, the keyword and why."""

    def __init__(self, at: str, reason: str, tool: int | None = None):
        super().__init__(f"{at}: {reason}" if at else reason)
        self.at, self.reason, self.tool = at, reason, tool


def at(where: str, part: str) -> str:
    """A place inside a schema: ``part`` of the one at ``where``."""
    return f"{where}.{part}" if where else part


# A string's text: anything without "<|", so it cannot hold (or end inside) a marker.
TEXT = r"([^<]|<[^<|])*"


def string_regexes(schema: Mapping, where: str) -> list[str]:
    """The regexes (llguidance's lark syntax, between ``/``) a string's text must all match: its pattern (as
    JSON schema reads one: found anywhere unless anchored), its length bounds, its format."""
    out = []
    pattern = schema.get("pattern")
    if pattern is not None:
        if not isinstance(pattern, str):
            raise GrammarError(at(where, "pattern"), "must be a string")
        out.append(_checked(_search(llguidance.regex_to_lark(pattern, "dw"), at(where, "pattern")), where, "pattern"))
    lo, hi = _bounds(schema, "minLength", "maxLength", where)
    if lo or hi is not None:
        out.append(_checked(f"(?s:.{{{lo},{'' if hi is None else hi}}})", where, "maxLength" if hi else "minLength"))
    fmt = schema.get("format")
    if fmt is not None and not isinstance(fmt, str):
        raise GrammarError(at(where, "format"), "must be a string")
    if fmt in FORMATS:  # another format is an annotation: any string (``constraints.plain_formats``)
        out.append(llguidance.regex_to_lark(FORMATS[fmt], ""))
    return out


def _search(rx: str, where: str) -> str:
    """JSON schema's ``pattern`` matches anywhere in the string unless anchored; llguidance's regexes match
    the whole text (their ``^``/``$`` are not anchors). Each top-level alternative gets ``.*`` on the side
    it is not anchored; an anchor elsewhere (inside a group, mid-pattern) cannot be said and is refused."""
    cuts = [i for i, c, depth in _structure(rx) if c == "|" and depth == 0]
    out = []
    for a, b in zip([-1, *cuts], [*cuts, len(rx)]):
        alt = rx[a + 1 : b]
        anchors = {i for i, c, _ in _structure(alt) if c in "^$"}
        head, tail = 0 in anchors and alt[0] == "^", len(alt) - 1 in anchors and alt[-1] == "$" and len(alt) > 1
        if anchors - {0} - {len(alt) - 1} or (anchors and not (head or tail)):
            raise GrammarError(where, "an anchor (^ or $) inside the pattern cannot be held in a tool call")
        body = alt[int(head) : len(alt) - int(tail)]
        out.append(("" if head else "(?s:.*)") + f"(?:{body})" + ("" if tail else "(?s:.*)"))
    return out[0] if len(out) == 1 else "|".join(f"(?:{a})" for a in out)


def _structure(rx: str):
    """(index, character, group depth) of each character of ``rx`` outside escapes and ``[...]`` classes."""
    depth, i, in_class = 0, 0, False
    while i < len(rx):
        c = rx[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            i += rx[i + 1 : i + 3] == "^]" or rx[i + 1 : i + 2] == "]"  # "[]...]": a leading "]" is a member
        else:
            depth -= c == ")"
            yield i, c, depth
            depth += c == "("
        i += 1


def _checked(rx: str, where: str, keyword: str) -> str:
    """``rx`` if llguidance's regex compiler takes it; else a refusal naming the keyword's place."""
    error = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(f"start: /{rx}/"))
    if error:
        reason = " ".join(error.split())[:200]
        raise GrammarError(at(where, keyword), f"cannot be held in a tool call: {reason}")
    return rx


def _bounds(schema: Mapping, low: str, high: str, where: str) -> tuple[int, int | None]:
    lo, hi = schema.get(low, 0), schema.get(high)
    for name, v in ((low, lo), (high, hi)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise GrammarError(at(where, name), "must be a non-negative integer")
    if hi is not None and hi < lo:
        raise GrammarError(at(where, high), f"{hi} is below {low} {lo}: no value can be written")
    return lo, hi


def number(kind: str, schema: Mapping, where: str) -> str | None:
    """A bounded number's rule body: llguidance's JSON-schema number (``%json``), which Gemma-4 writes as JSON
    does; None where ``schema`` bounds nothing (the plain INT/NUM terminal then)."""
    bounds = {k: schema[k] for k in NUMERIC if k in schema}
    if not bounds:
        return None
    for k, v in bounds.items():
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise GrammarError(at(where, k), "must be a number")
    if "multipleOf" in bounds and bounds["multipleOf"] <= 0:
        raise GrammarError(at(where, "multipleOf"), "must be above 0")
    spec = json.dumps({"type": kind, **bounds})
    error = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_json_schema(spec))
    if error:
        raise GrammarError(where, f"{kind} bounds cannot be held: {' '.join(error.split())[:200]}")
    return f"%json {spec}"


def item_bounds(schema: Mapping, where: str) -> tuple[int, int | None]:
    """An array's ``minItems``/``maxItems``; ``uniqueItems: true`` (no grammar compares items) is refused."""
    if schema.get("uniqueItems") not in (None, False):
        raise GrammarError(at(where, "uniqueItems"), "unique items cannot be held in a tool call's grammar")
    lo, hi = _bounds(schema, "minItems", "maxItems", where)
    if lo > MAX_ITEMS or (hi or 0) > MAX_ITEMS:
        raise GrammarError(where, f"minItems/maxItems above {MAX_ITEMS} cannot be held in a tool call's grammar")
    return lo, hi


def repeated(item: str, lo: int, hi: int | None) -> str:
    """``[item, item, ...]``'s inside: between ``lo`` and ``hi`` (None: any number of) items."""
    if hi == 0:
        return ""
    more = "*" if hi is None else f"{{{max(lo - 1, 0)},{hi - 1}}}"
    if hi is None and lo > 1:
        more = f"{{{lo - 1},}}"
    seq = f'{item} ("," {item}){more}'
    return f"({seq})?" if lo == 0 else seq


def resolve(root: Mapping, ref, where: str) -> tuple[str, Mapping | bool]:
    """A local ``$ref`` (``#``, ``#/$defs/Name``, any JSON pointer into the parameters): its place (as errors
    name it, ``$defs.Name``) and the schema there. A remote reference is refused."""
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        raise GrammarError(at(where, "$ref"), f"{str(ref)[:60]!r}: only a reference inside the parameters is held")
    node, parts = root, [p.replace("~1", "/").replace("~0", "~") for p in ref[2:].split("/")] if ref != "#" else []
    for p in parts:
        if isinstance(node, Mapping) and p in node:
            node = node[p]
        elif isinstance(node, list) and p.isdigit() and int(p) < len(node):
            node = node[int(p)]
        else:
            raise GrammarError(at(where, "$ref"), f"{ref[:60]!r} points at nothing in the parameters")
    return ".".join(parts), node


def merged(schema: Mapping, root: Mapping, where: str) -> Mapping:
    """``allOf`` (and ``$ref`` beside other keywords) as one schema: each part's references followed, then the
    parts merged keyword by keyword -- properties merged, required joined, types intersected, bounds tightened;
    two parts that set one keyword differently otherwise are refused (the grammar holds one schema)."""
    parts = schema.get("allOf", [])
    if not isinstance(parts, list) or not parts and "allOf" in schema:
        raise GrammarError(at(where, "allOf"), "must be a non-empty list of schemas")
    rest = {k: v for k, v in schema.items() if k not in ("allOf", "$ref")}
    if "$ref" in schema:
        parts = [{"$ref": schema["$ref"]}, *parts]
    out: dict = {}
    for i, part in enumerate([*parts, rest]):
        place = at(where, f"allOf[{i}]")
        try:
            out = _merge(out, _followed(part, root, place), place)
        except (TypeError, AttributeError):  # a keyword of the wrong type in one of them: a refusal, not a 500
            raise GrammarError(place, "holds a keyword of the wrong type: the allOf cannot be merged") from None
    return out


def _followed(schema, root: Mapping, where: str) -> Mapping:
    for _ in range(MAX_REF_DEPTH):
        if schema is True:
            return {}
        if not isinstance(schema, Mapping):
            raise GrammarError(where, "a schema must be an object")
        if "$ref" not in schema:
            return merged(schema, root, where) if "allOf" in schema else schema
        _, target = resolve(root, schema["$ref"], where)
        extra = {k: v for k, v in schema.items() if k != "$ref"}
        schema = {"allOf": [target, extra]} if extra else target
    raise GrammarError(where, f"$ref chains deeper than {MAX_REF_DEPTH} cannot be merged in an allOf")


_LOWER = {"minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties"}
_UPPER = {"maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties"}


def _merge(a: Mapping, b: Mapping, where: str) -> dict:
    out = dict(a)
    for k, v in b.items():
        if k not in out or k in ANNOTATIONS:
            out.setdefault(k, v)
        elif k == "properties":
            props = dict(out[k])
            for name, s in v.items():
                props[name] = {"allOf": [props[name], s]} if name in props else s
            out[k] = props
        elif k == "required":
            out[k] = list(dict.fromkeys([*out[k], *v]))
        elif k == "type":
            out[k] = _types(out[k], v, where)
        elif k in _LOWER or k in _UPPER:
            out[k] = (max if k in _LOWER else min)(out[k], v)
        elif k == "enum":
            out[k] = [x for x in out[k] if x in v]
            if not out[k]:
                raise GrammarError(at(where, "enum"), "the merged enums share no value")
        elif out[k] != v:
            raise GrammarError(at(where, k), "set differently by two schemas of an allOf: cannot be merged")
    return out


def _types(a, b, where: str) -> list[str]:
    """Two ``type`` keywords' common types (an integer is a number)."""
    sa, sb = ({x} if isinstance(x, str) else set(x) for x in (a, b))
    both = {t if t == u else "integer" for t in sa for u in sb if t == u or {t, u} == {"integer", "number"}}
    if not both:
        raise GrammarError(at(where, "type"), "the schemas of an allOf share no type")
    return sorted(both)
