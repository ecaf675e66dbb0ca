"""``tool_choice`` as every front reads it, and the grammar that holds the model to the calls it asks for.

Both fronts turn their wire shape into a mode or a function's name and call :func:`choose` (a refusal names
``prompt.tool_choice``, which the front renames); :func:`check_tools` checks a tool's name and parameters. A chat whose
calls are read (:func:`reads_calls`) stops where the model would wait for results (``decode/checks.py`` adds that stop).

``"required"`` and a named function hold the model to a call with a grammar in llguidance's lark syntax:
``<|tool_call>call:NAME{ARGS}<tool_call|>``. Gemma-4's arguments are not JSON (``tools/calls.py``), so the schema
compiles to rules of that syntax: keys bare and sorted (as the template writes them), strings between ``<|"|>`` marks
with no ``<|`` inside (no string can swallow a mark). A keyword it cannot hold is refused by name
(:class:`GrammarError`), never dropped; annotations are skipped (``docs/structured.md`` lists both). Markers the
tokenizer holds as special tokens are named by id (``<[ID]>``), which no text can spell (:func:`marker_terms`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence

from kakeya.core.constraints import JSON_OPTIONS, plain_formats
from kakeya.core.request import AUTO, NONE, REQUIRED, Chat, InvalidRequest, Tool
from kakeya.orchestrator.tools import keywords
from kakeya.orchestrator.tools.calls import CALL_END, CALL_START, MARKERS, NAME, QUOTE, RESULT_START
from kakeya.orchestrator.tools.keywords import ANNOTATIONS, KNOWN, GrammarError, at
from kakeya.runtime.lifecycle import quote


class ToolProblem(ValueError):
    """A bad tool: ``index`` in the tools, ``part`` of it (``name``, ``parameters``, ``parameters.required`` ...)
    and ``reason``; each front names the field its own way (``tools[0].function.name``, ``...parameters_json``)."""

    def __init__(self, index: int, part: str, reason: str):
        super().__init__(f"tools[{index}].{part}: {reason}")
        self.index, self.part, self.reason = index, part, reason


def check_tools(tools: Sequence[Tool]) -> None:
    """Each tool's name (1-64 letters, digits, '_', '.' or '-', declared once) and parameters (none, or an
    object schema); :class:`ToolProblem` for the first that is not."""
    for i, t in enumerate(tools):
        if not isinstance(t.name, str) or not NAME.fullmatch(t.name):
            raise ToolProblem(i, "name", "must be 1-64 letters, digits, '_', '.' or '-'")
        if any(t.name == other.name for other in tools[:i]):
            raise ToolProblem(i, "name", f"{quote(t.name)} is declared twice")
        p = t.parameters
        if p is None:
            continue
        if not isinstance(p, Mapping) or p.get("type", "object") != "object":
            raise ToolProblem(i, "parameters", 'must be a JSON schema of "type": "object"')
        if not isinstance(p.get("properties", {}), Mapping):
            raise ToolProblem(i, "parameters.properties", "must be an object")
        required = p.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise ToolProblem(i, "parameters.required", "must be a list of strings")


FIELD = "prompt.tool_choice"
MODES = (NONE, AUTO, REQUIRED)
TOOL_CALLS = "tool_calls"  # the finish reason of an answer that ends in calls


def choose(value, tools: Sequence[Tool], named: bool = False) -> str:
    """The :attr:`Chat.tool_choice` of a request that sent ``value`` (None: none sent) with ``tools``:
    ``auto`` by default with tools, ``none`` without; ``named``: ``value`` is a function's name."""
    if value is None:
        return AUTO if tools else NONE
    if named:
        if value in MODES:  # Chat.tool_choice would read it as the mode
            raise InvalidRequest(FIELD, f"a function named {quote(value)} cannot be chosen by name")
        if not any(t.name == value for t in tools):
            raise InvalidRequest(FIELD, f"names {quote(value)}, which is not one of the tools")
        return value
    if value not in MODES:
        raise InvalidRequest(FIELD, f'must be "none", "auto", "required" or a function, got {quote(value)}')
    if value != NONE and not tools:
        raise InvalidRequest(FIELD, f"{quote(value)} needs tools")
    return value


def reads_calls(prompt) -> bool:
    """Whether the model's calls are read out of its text: a chat with tools, its choice not ``none``."""
    return isinstance(prompt, Chat) and bool(prompt.tools) and prompt.tool_choice != NONE


def finish_reason(reason: str, calls: int, text: str) -> str:
    """An answer's finish reason: "tool_calls" where the model stopped after its calls (OpenAI's), not inside one."""
    return TOOL_CALLS if calls and reason == "stop" and text.rfind(CALL_START) < text.rfind(CALL_END) else reason


_BARE_KEY = re.compile(r"[^:{}\[\],<\s\"]+")
_TERMINALS = {
    "STR": f"/{keywords.TEXT}/",
    "STR_END": f"/{keywords.TEXT}{re.escape(QUOTE)}/",
    "INT": r"/-?(0|[1-9][0-9]*)/",
    "NUM": r"/-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/",
    "KEY": r"/[A-Za-z_][A-Za-z0-9_.\-]*/",
}


def marker_terms(tokenizer=None) -> dict[str, str]:
    """Each marker's lark term: ``<[ID]>`` where ``tokenizer`` holds it as a special token, else its text."""
    special = {}
    if tokenizer is not None:
        special = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    return {m: f"<[{special[m]}]>" if m in special else _lit(m) for m in MARKERS}


def _lit(text: str) -> str:
    return json.dumps(text)  # a lark string: JSON's escapes


class _Rules:
    def __init__(self, terms: Mapping[str, str]):
        self.q = terms[QUOTE]
        # A string: its opening mark, then its text and closing mark. Where the mark is text, the two are one
        # terminal (STR_END): llguidance's lexer ends a lexeme only where it cannot go on, and a string's text
        # can go on past a "<" that turns out to open the mark. A special token ends the text by itself.
        self.string = f"{self.q} STR_END" if self.q.startswith('"') else f"{self.q} STR {self.q}"
        self.rules: dict[str, str] = {}
        self.names: dict[str, str] = {}
        self.terminals: dict[str, str] = {}  # a constrained string's text: its regexes -> terminal
        self.root: Mapping = {}  # the parameters being compiled: where a $ref points
        self.refs: dict[tuple[int, str], str] = {}  # (parameters, pointer) -> its rule

    def tool(self, params: Mapping) -> str:
        """The rule of a call's arguments: ``params`` as an object."""
        self.root = params
        return self.value(dict(params) | {"type": "object"}, "")

    def rule(self, body: str) -> str:
        """A rule of ``body`` (one rule per distinct body)."""
        if body not in self.names:
            self.names[body] = name = f"r{len(self.names)}"
            self.rules[name] = body
        return self.names[body]

    def quoted(self, text: str) -> str:
        return f"{self.q} {_lit(text)} {self.q}" if text else f"{self.q} {self.q}"

    def literal(self, value, where: str) -> str:
        """A JSON value, written as Gemma-4 writes it (``enum``, ``const``)."""
        if isinstance(value, str):
            if "<|" in value:
                raise GrammarError(where, "a value holding '<|' cannot be written in a tool call")
            return self.quoted(value)
        if value is None:
            return '("null" | "None")'
        if isinstance(value, bool | int | float):  # JSON's true, false and numbers, as Gemma-4 writes them
            return _lit(json.dumps(value))
        if isinstance(value, list):
            items = ' "," '.join(self.literal(v, where) for v in value)
            return f'"[" {items} "]"' if value else '"[" "]"'
        if isinstance(value, dict):
            pairs = ' "," '.join(f"{self.key(k, where)} {self.literal(v, where)}" for k, v in sorted(value.items()))
            return f'"{{" {pairs} "}}"' if value else '"{" "}"'
        raise GrammarError(where, f"{quote(value)} is not a JSON value")

    def key(self, key: str, where: str) -> str:
        if "<|" in key:
            raise GrammarError(where, "a key holding '<|' cannot be written in a tool call")
        return f"{_lit(key + ':')}" if _BARE_KEY.fullmatch(key) else f'{self.quoted(key)} ":"'

    def any(self) -> str:
        """Any value (a schema that says nothing of it)."""
        if "any" not in self.rules:
            self.rules["any"] = ""  # reserved first: the body refers to itself
            pair = f'(KEY | {self.string}) ":" any'
            self.rules["any_object"] = f'"{{" ({pair} ("," {pair})*)? "}}"'
            self.rules["any"] = (f'{self.string} | NUM | "true" | "false" | "null" | "None" | any_object '
                                 f'| "[" (any ("," any)*)? "]"')  # fmt: skip
        return "any"

    def value(self, schema, where: str) -> str:
        """The rule of the values ``schema`` admits."""
        if schema is True or schema == {}:
            return self.any()
        if not isinstance(schema, Mapping):
            raise GrammarError(where, "a schema must be an object")
        unknown = sorted(k for k in set(schema) - KNOWN - ANNOTATIONS if not str(k).startswith("x-"))
        if unknown:
            raise GrammarError(at(where, unknown[0]), "this schema keyword is not supported in a tool call's grammar")
        if "allOf" in schema or ("$ref" in schema and set(schema) - ANNOTATIONS - {"$ref"}):
            return self.value(keywords.merged(schema, self.root, where), where)
        if "$ref" in schema:
            return self.ref(schema["$ref"], where)
        if "const" in schema:
            return self.rule(self.literal(schema["const"], where))
        if "enum" in schema:
            if not isinstance(schema["enum"], list) or not schema["enum"]:
                raise GrammarError(at(where, "enum"), "must be a non-empty list")
            if all(isinstance(v, str) and v and "<|" not in v for v in schema["enum"]):  # one lexeme, not a rule
                return self._string(schema, where, " | ".join(map(_lit, schema["enum"])))  # of <= 2000 alternatives
            return self.rule(" | ".join(self.literal(v, where) for v in schema["enum"]))
        for key in ("anyOf", "oneOf"):
            if key in schema:
                alternatives = schema[key]
                if not isinstance(alternatives, list) or not alternatives:
                    raise GrammarError(at(where, key), "must be a non-empty list of schemas")
                base = {k: v for k, v in schema.items() if k != key}
                options = [self.value({**base, **option} if isinstance(option, Mapping) else option,
                                      at(where, f"{key}[{i}]"))
                           for i, option in enumerate(alternatives)]  # fmt: skip
                return self.rule(" | ".join(options))
        kinds = schema.get("type")
        kinds = [kinds] if isinstance(kinds, str) else [] if "type" not in schema else kinds
        if not isinstance(kinds, list) or not all(isinstance(k, str) for k in kinds):
            raise GrammarError(at(where, "type"), "must be a type's name or a list of them")
        if not kinds:
            kinds = ["object"] if "properties" in schema else []
        if not kinds:
            return self.any()
        if schema.get("nullable"):
            kinds.append("null")
        return self.rule(" | ".join(self._typed(kind, schema, where) for kind in dict.fromkeys(kinds)))

    def ref(self, pointer, where: str) -> str:
        """A ``$ref``'s rule: one per place it points at, named before its body is written, so a recursive
        model (a tree of nodes) is a recursive rule."""
        place, target = keywords.resolve(self.root, pointer, where)
        key = (id(self.root), pointer)
        if key not in self.refs:
            self.refs[key] = name = f"d{len(self.refs)}"
            self.rules[name] = ""  # reserved: the body may refer to it
            self.rules[name] = self.value(target, place)
        return self.refs[key]

    def _typed(self, kind: str, schema: Mapping, where: str) -> str:
        if kind == "string":
            return self._string(schema, where)
        if kind in ("integer", "number"):
            bounded = keywords.number(kind, schema, where)
            return self.rule(bounded) if bounded else "INT" if kind == "integer" else "NUM"
        if kind == "boolean":
            return '"true" | "false"'
        if kind == "null":
            return '"null" | "None"'
        if kind == "array":
            return self._array(schema, where)
        if kind == "object":
            return self.members(schema, where)
        raise GrammarError(at(where, "type"), f"{quote(kind)} is not a JSON schema type")

    def _string(self, schema: Mapping, where: str, text: str = "") -> str:
        """A string; with a pattern, length or format, its text is a terminal of all their regexes and of the
        text any string may hold (no "<|"); ``text``: its terminal, given (an enum's values)."""
        regexes = [] if text else keywords.string_regexes(schema, where)
        if not text and not regexes:
            return self.string
        text = text or " & ".join(f"/{rx}/" for rx in [*regexes, keywords.TEXT])
        if text not in self.terminals:
            self.terminals[text] = f"S{len(self.terminals)}"
        name = self.terminals[text]
        return f"{self.q} {name}_END" if self.q.startswith('"') else f"{self.q} {name} {self.q}"

    def _array(self, schema: Mapping, where: str) -> str:
        lo, hi = keywords.item_bounds(schema, where)
        prefix = schema.get("prefixItems")
        if prefix is None:
            item = self.value(schema.get("items", {}), at(where, "items"))
            return f'"[" {keywords.repeated(item, lo, hi)} "]"'
        if not isinstance(prefix, list) or not prefix:
            raise GrammarError(at(where, "prefixItems"), "must be a non-empty list of schemas")
        if lo < len(prefix):  # a tuple whose last items may be left out: not what models' tuples say
            raise GrammarError(at(where, "prefixItems"), "held only where minItems covers every prefix item")
        items = [self.value(p, at(where, f"prefixItems[{i}]")) for i, p in enumerate(prefix)]
        head = ' "," '.join(items)
        rest = schema.get("items", {})
        if rest is False or hi == len(prefix):
            return f'"[" {head} "]"'
        more = self.value(rest, at(where, "items"))
        extra = "*" if hi is None else f"{{0,{hi - len(prefix)}}}"
        return f'"[" {head} ("," {more}){extra} "]"'

    def members(self, schema: Mapping, where: str) -> str:
        """``{key:value,...}``: the declared keys in sorted order, each required one present, no other."""
        if schema.get("minProperties", 0) or schema.get("maxProperties") is not None:
            key = "minProperties" if schema.get("minProperties", 0) else "maxProperties"
            raise GrammarError(at(where, key), "property counts cannot be held in a tool call's grammar")
        props, extra = schema.get("properties"), schema.get("additionalProperties", True)
        extra = True if extra == {} else extra
        if extra not in (True, False) and props:
            raise GrammarError(at(where, "additionalProperties"), "a schema for keys beside properties is "
                               "not supported in a tool call's grammar")  # fmt: skip
        if props is None:
            if extra is False:
                return '"{" "}"'
            if extra is True:
                self.any()
                return "any_object"
            pair = f'(KEY | {self.string}) ":" {self.value(extra, at(where, "additionalProperties"))}'
            return self.rule(f'"{{" ({pair} ("," {pair})*)? "}}"')  # a map: any keys, each value its schema
        if not isinstance(props, Mapping):
            raise GrammarError(at(where, "properties"), "must be an object")
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise GrammarError(at(where, "required"), "must be a list of strings")
        required = set(required)
        if not required <= set(props):
            raise GrammarError(where, "every required key must be among the properties")
        keys = sorted(props)
        entry = [f"{self.key(k, where)} {self.value(props[k], at(where, f'properties.{k}'))}" for k in keys]

        def tail(i: int) -> str:  # what may follow once a key before keys[i] was written
            return " ".join(f'"," {e}' if k in required else f'("," {e})?' for k, e in zip(keys[i:], entry[i:]))

        starts = []
        for i, k in enumerate(keys):  # the first key written: any whose optional predecessors were all left out
            starts.append(f"{entry[i]} {tail(i + 1)}".strip())
            if k in required:
                break
        else:
            starts.append("")  # every key optional: the empty object
        alternatives = " | ".join(f'"{{" {s} "}}"' if s else '"{" "}"' for s in starts)
        return self.rule(alternatives)


def tool_call_grammar(
    tools: Sequence[Tool],
    tool_choice: str,
    terms: Mapping[str, str] | None = None,
    parallel: bool = True,
    answer: Mapping | None = None,
) -> str:
    """The lark grammar (llguidance's) of the calls ``tool_choice`` asks for: ``required``, one or more calls of
    any of ``tools``; a function's name, one call of it; ``auto`` (when :func:`holds_calls`), free text, or
    text up to a call's opening mark and then well-formed calls, a ``strict`` tool's arguments following its
    schema. ``terms``: the markers' lark terms (:func:`marker_terms`). ``parallel`` False: at most one call. ``answer``
    (``auto``): a JSON answer's schema, the alternative to calls. :class:`GrammarError` names a tool it cannot hold."""
    terms = dict(terms or marker_terms())
    rules = _Rules(terms)
    if tool_choice == NONE or (tool_choice == AUTO and answer is None and not holds_calls(tools, AUTO, parallel)):
        raise GrammarError("", f"tool_choice {tool_choice!r} holds no call: it has no grammar")
    chosen = [t for t in tools if t.name == tool_choice] if tool_choice not in (AUTO, REQUIRED) else list(tools)
    if not chosen:
        raise GrammarError("", f"tool_choice: {tool_choice!r} is not one of the tools")
    calls = []
    for i, tool in enumerate(tools):
        if tool in chosen:
            params = tool.parameters if tool.parameters is not None else {"type": "object", "properties": {}}
            if tool_choice == AUTO and not tool.strict:  # held only to be one call (parallel False)
                rules.any()
                args = "any_object"  # well-formed, whatever its keys and values
            else:
                try:
                    args = rules.tool(params)
                except GrammarError as exc:
                    raise GrammarError(exc.at, exc.reason, i) from None
                except RecursionError:  # a schema nested deeper than this writer follows
                    raise GrammarError("", "nested too deeply for a tool call's grammar", i) from None
            calls.append(f"{_lit('call:' + tool.name)} {args}")
    body = rules.rule(" | ".join(calls))
    call = f"{terms[CALL_START]} {body} {terms[CALL_END]}"
    if tool_choice == AUTO:
        start = _text_or_calls(terms, body, parallel, answer is not None)
    else:
        calls = f"({call})+" if tool_choice == REQUIRED and parallel else call
        start = f"{calls} {terms[RESULT_START]}?"
    lines = [f"start: {start}"]
    lines += [f"{name}: {body}" for name, body in rules.rules.items()]
    lines += [f"{name}: {regex}" for name, regex in _TERMINALS.items()]
    for text, name in rules.terminals.items():  # a constrained string's text (and its closing mark, as STR_END)
        lines += [f"{name}: {text}", f"{name}_END: ({text}) /{re.escape(QUOTE)}/"]
    if answer is not None:  # written as every JSON answer is (``core/constraints.py``), whatever its x-guidance says
        lines.append(f"answer: %json {json.dumps(plain_formats(dict(answer)) | {'x-guidance': JSON_OPTIONS})}")
    elif tool_choice == AUTO and not terms[CALL_START].startswith("<["):
        lines.append(f"TEXT: {_FREE} & ~/{_FREE[1:-1]}{re.escape(CALL_START)}{_FREE[1:-1]}/")
        lines.append(f"LEAD: TEXT {terms[CALL_START]}")
    elif tool_choice == AUTO:
        lines.append(f"TEXT: {_FREE}")
    return "\n".join(lines) + "\n"


_FREE = r"/(.|\n)*/"


def _text_or_calls(terms: Mapping[str, str], body: str, parallel: bool, json_answer: bool) -> str:
    """``auto``'s start: text alone, or text then calls. Where the opening mark is a special token no text can
    spell it. Where it is text, text with the mark at its end is one lexeme (``LEAD``): llguidance's lexer
    cannot take back characters a longer lexeme took, so a text lexeme then a mark lexeme would never see the
    mark (not a ``stop=`` lexeme: llguidance 1.x rolls one back wrongly; ``test_tool_grammar.py`` checks a
    rolled-back state). Bytes that are no UTF-8 text are refused (llguidance's lexemes read characters)."""
    more = f"({terms[CALL_START]} {body} {terms[CALL_END]})*" if parallel else ""
    rest = f"{body} {terms[CALL_END]} {more} {terms[RESULT_START]}?"
    if json_answer:  # no JSON text starts with the mark: the two alternatives part at the first character
        return f"answer | {terms[CALL_START]} {rest}"
    if terms[CALL_START].startswith("<["):
        return f"TEXT | TEXT {terms[CALL_START]} {rest}"
    return f"TEXT | LEAD {rest}"


def holds_calls(tools: Sequence[Tool], tool_choice: str, parallel: bool = True) -> bool:
    """Whether a grammar holds the calls ``tool_choice`` allows well-formed: ``required``, a named function,
    and ``auto`` where a tool is ``strict`` or calls are not ``parallel`` (the grammar stops after one)."""
    return tool_choice != NONE and (tool_choice != AUTO or not parallel or any(t.strict for t in tools))
