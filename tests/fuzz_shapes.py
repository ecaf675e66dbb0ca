"""Hypothesis strategies for values near the valid shapes of a structured request, for the fuzzes of both
fronts (``tests/orchestrator/test_http_fuzz.py``, ``tests/services/test_fuzz.py``).

A fuzz of random JSON stops at a field's first type check; these draw what a client of tools, constraints
and logprobs sends -- valid values, and values with one part wrong deep inside: a JSON schema with a keyword
the tool grammar or llguidance refuses, a keyword of the wrong type, a regex that does not compile, a
grammar that does not parse, a lone surrogate or a 400-digit number where a string or a number belongs.
Plain Python values (JSON's), so a front's test writes them as its wire carries them.
"""

from __future__ import annotations

from hypothesis import strategies as st

HUGE = 10**400  # json.dumps writes its 401 digits; float() of it overflows
SURROGATES = st.sampled_from(["\ud800", "\udfff", "\udc80"])
STRINGS = st.text(max_size=8) | st.builds(
    lambda a, s, b: a + s + b, st.text(max_size=4), SURROGATES, st.text(max_size=4)
)
NUMBERS = st.integers(-(2**70), 2**70) | st.floats() | st.integers(-3, 20)
NASTY = st.sampled_from([HUGE, -HUGE, 2**63, 2**64, -1, 0, 1e308, "\ud800", "a\udfff", ["\udc80"], {"\ud800": 1}])
JSON = st.recursive(
    st.none() | st.booleans() | NUMBERS | STRINGS | NASTY,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(STRINGS, inner, max_size=3),
    max_leaves=8,
)


def mostly(usual, rare, one_in: int = 10):
    """``usual``, else (one time in ``one_in``) ``rare``: a part wrong now and then, so the rest gets past the
    checks that would refuse it."""
    return st.integers(1, one_in).flatmap(lambda i: rare if i == 1 else usual)


TEXT = mostly(st.text(max_size=8), STRINGS, 40)  # text, rarely with a lone surrogate
NAMES = mostly(st.sampled_from(["f", "get_weather", "set_flag", "a.b-c_1"]),
               st.sampled_from(["auto", "required", "bad name", "", "x" * 70]))  # fmt: skip
KEYS = mostly(st.sampled_from(["a", "b", "city", "a b", "é"]), st.sampled_from(["k:v", "<|x", "$ref", ""]))
TYPES = mostly(st.sampled_from(["object", "string", "integer", "number", "boolean", "null", "array"]),
               st.sampled_from(["blob", "Object", ""]))  # fmt: skip
PLAIN = st.recursive(  # JSON values without a surrogate or a huge number
    st.none() | st.booleans() | st.integers(-5, 5) | st.floats(allow_nan=False, allow_infinity=False) | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
VALUES = mostly(PLAIN, JSON, 20)


def _or_wrong(usual):
    """A keyword's value, or one time in four a value of another type (without a surrogate: the wrong type is
    what reaches the schema's readers)."""
    return mostly(usual, PLAIN, 4)


# One keyword of a schema, with a value of its shape or, now and then, of another.
_LEAF_KEYWORDS = {
    "type": _or_wrong(TYPES | st.lists(TYPES, min_size=1, max_size=3) | st.lists(TYPES | PLAIN, max_size=2)),
    "enum": _or_wrong(st.lists(VALUES, min_size=1, max_size=3)),
    "const": VALUES,
    "required": _or_wrong(st.lists(KEYS, max_size=3) | st.lists(KEYS | PLAIN, max_size=2)),
    "nullable": _or_wrong(st.booleans()),
    "description": mostly(TEXT, PLAIN),
    "additionalProperties": st.booleans(),
    "pattern": st.sampled_from(["^x$", "(", "a{999999999}"]),  # a keyword the tool grammar refuses
    "minimum": st.sampled_from([0, HUGE, -HUGE, 1e308]),
    "maxLength": st.sampled_from([3, -1, HUGE]),
    "$ref": st.sampled_from(["#/$defs/x", "#", "http://example.com/s.json"]),
    "format": st.sampled_from(["date-time", "email", "nope"]),
}


def _schema_from(inner):
    keywords = {
        "properties": _or_wrong(st.dictionaries(KEYS, inner, max_size=3)),
        "items": _or_wrong(inner),
        "anyOf": _or_wrong(st.lists(inner, min_size=1, max_size=3)),
        "oneOf": _or_wrong(st.lists(inner | PLAIN, max_size=2)),
        "additionalProperties": inner,
        "$defs": st.dictionaries(KEYS, inner, max_size=2),
    }
    return mostly(
        st.fixed_dictionaries({}, optional=keywords | _USUAL),
        st.fixed_dictionaries({}, optional=keywords | _LEAF_KEYWORDS),
    )


_RARE = {"pattern", "minimum", "maxLength", "$ref", "format"}  # a keyword refused, now and then
_USUAL = {k: v for k, v in _LEAF_KEYWORDS.items() if k not in _RARE}
LEAF_SCHEMAS = mostly(
    st.fixed_dictionaries({"type": TYPES}, optional={k: v for k, v in _USUAL.items() if k != "type"}),
    st.fixed_dictionaries({}, optional=_LEAF_KEYWORDS),
)
SCHEMAS = st.recursive(LEAF_SCHEMAS | st.booleans(), _schema_from, max_leaves=6)
# A tool's parameters: mostly an object schema, as a tool's must be, with any of the above inside.
OBJECT_SCHEMAS = st.builds(
    lambda props, required, extra: (
        {"type": "object", "properties": props} | ({"required": required} if required else {}) | extra
    ),
    st.dictionaries(KEYS, SCHEMAS, max_size=3),
    st.none() | st.lists(KEYS, max_size=2),
    mostly(
        st.just({}),
        st.fixed_dictionaries({}, optional={"additionalProperties": st.booleans() | SCHEMAS, "pattern": st.just("x")}),
    ),
)
OBJECT_SCHEMAS = mostly(OBJECT_SCHEMAS, SCHEMAS)  # fmt: skip

REGEXES = mostly(st.sampled_from(["a+", "[0-9]{1,3}", "(yes|no)", "x*", ".*", "\\p{L}+"]), st.sampled_from([
    "(", "[z-a]", "a{99999999}", "\\", "(?<=a)b", "", "a\udfff", "\\d{400}"]) | STRINGS)  # fmt: skip
GRAMMARS = mostly(st.sampled_from(['start: "a"+', "start: /[0-9]+/", 'start: "yes" | "no"']), st.sampled_from([
    "start: x", "start: start", "garbage ::= ", "%import common.WS", 'start: "\ud800"', ""]) | STRINGS)  # fmt: skip
CHOICES = mostly(st.lists(TEXT, min_size=1, max_size=3), st.lists(STRINGS | NASTY, max_size=3) | JSON)
