"""What the HTTP front does with each parameter a request may send, and the parameters that need more than a type.

Every parameter of OpenAI's two endpoints, and vLLM's extensions clients send, is in :data:`PARAMS`: **honoured**,
**refused** (any value but the one asking for nothing is a 400 naming it, never a silently different generation) or
**harmless** (type-checked and unused). A parameter of the other endpoint is refused naming the one that takes it; an
unknown name is ignored, as vLLM does (every field known to change the output is listed).

Below the table, the parameters needing more than a type check: the constraint (:func:`constraint`, one per request),
logprobs (:func:`logprobs_requested`) and function tools (``tools``, ``tool_choice``'s JSON shape, tool turns).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kakeya.core.constraints import Constraint, load_json
from kakeya.core.contract import TokenLogprobs
from kakeya.core.request import MAX_LOGPROBS, Message, Tool, ToolCall
from kakeya.orchestrator.tools.calls import NAME
from kakeya.orchestrator.tools.grammar import ToolProblem, check_tools, choose
from kakeya.runtime.lifecycle import quote

HONOURED, REFUSED, HARMLESS = "honoured", "refused", "harmless"
COMPLETIONS, CHAT, BOTH = "completions", "chat", "both"


@dataclass(frozen=True)
class Param:
    """``kind``: :data:`HONOURED`, :data:`REFUSED` or :data:`HARMLESS`; ``api``: which endpoint takes it;
    ``accepts``: a refused parameter's values that ask for nothing (its default; by endpoint, where the
    endpoints' defaults differ); ``types``: the JSON
    types a harmless one may have (None always may); ``why``: said when a value is refused."""

    kind: str
    api: str = BOTH
    accepts: tuple | dict[str, tuple] = (None,)
    types: tuple[type, ...] = ()
    why: str = ""


def _refused(*accepts, api: str = BOTH, why: str = "") -> Param:
    return Param(REFUSED, api, (None, *accepts), why=why)


def _harmless(*types: type, api: str = BOTH) -> Param:
    return Param(HARMLESS, api, types=types)


_NO_TOOLS = "the deprecated function-calling parameters are not supported: use tools and tool_choice"
_TEXT = "this server generates text only"
_SPECIAL = "the prompt's special tokens are the tokenizer's (completions), the template's (chat)"
PARAMS: dict[str, Param] = {
    # -- OpenAI, both APIs
    "model": Param(HONOURED),  # must be the served model (404 otherwise)
    **dict.fromkeys(("max_tokens", "temperature", "top_p", "seed", "stop", "stream"), Param(HONOURED)),
    "stream_options": Param(HONOURED),  # include_usage, include_obfuscation (``http_api.stream_options``)
    "n": _refused(1, why="one choice per request"),
    "logprobs": Param(HONOURED),  # chat: true/false; completions: k
    "logit_bias": _refused({}, why="it does not bias logits"),
    **dict.fromkeys(("presence_penalty", "frequency_penalty"), _refused(0, 0.0, why="it applies no penalties")),
    "user": _harmless(str),  # an end-user id for OpenAI's abuse monitoring
    # -- OpenAI, /v1/completions only
    "prompt": Param(HONOURED, COMPLETIONS),
    "best_of": _refused(1, api=COMPLETIONS, why="one candidate per request"),
    "echo": _refused(False, why="it does not echo the prompt"),  # vLLM's chat has it too (the last message)
    "suffix": _refused("", api=COMPLETIONS, why="it does not insert text"),
    # -- OpenAI, /v1/chat/completions only
    **dict.fromkeys(("messages", "max_completion_tokens"), Param(HONOURED, CHAT)),
    "modalities": _refused(["text"], api=CHAT, why=_TEXT),
    "audio": _refused(api=CHAT, why=_TEXT),
    "top_logprobs": Param(HONOURED, CHAT),  # with logprobs: true
    "tools": Param(HONOURED, CHAT),  # function tools
    "tool_choice": Param(HONOURED, CHAT),  # auto, none, required or a named function
    "functions": _refused([], api=CHAT, why=_NO_TOOLS),
    "function_call": _refused("none", api=CHAT, why=_NO_TOOLS),
    "web_search_options": _refused(api=CHAT, why="it does not search the web"),
    "reasoning_effort": _refused(api=CHAT, why="it has no reasoning-effort setting"),
    "verbosity": _refused("medium", api=CHAT, why="it has no verbosity setting"),
    "parallel_tool_calls": Param(HONOURED, CHAT),  # false: at most one call, held by the tool grammar
    "prediction": _harmless(dict, api=CHAT),  # a latency hint: the output is the same without it
    "store": _harmless(bool, api=CHAT),  # OpenAI's storage of completions
    "metadata": _harmless(dict, api=CHAT),  # tags for OpenAI's stored completions
    "service_tier": _harmless(str, api=CHAT),  # OpenAI's processing tier: the output is the same
    # a cache-routing hint (the prefix cache needs none), its retention, an end-user id for OpenAI's monitoring
    **dict.fromkeys(("prompt_cache_key", "prompt_cache_retention", "safety_identifier"), _harmless(str, api=CHAT)),
    # -- vLLM's extensions, both APIs (response_format: OpenAI's on chat)
    **dict.fromkeys(("top_k", "min_p", "ignore_eos", "stop_token_ids", "response_format"), Param(HONOURED)),
    "request_id": Param(HONOURED),  # in the logs of every process the request reaches
    "block_size": Param(HONOURED),  # Kakeya's own: the speculative block size (0: auto)
    "repetition_penalty": _refused(1, 1.0, why="it applies no penalties"),
    **dict.fromkeys(("typical_p", "repeat_penalty"), _refused(1, why="it has no such sampler")),  # llama.cpp's
    **dict.fromkeys(("xtc_probability", "mirostat", "dry_multiplier"), _refused(0, why="it has no such sampler")),
    "top_n_sigma": _refused(-1, why="it has no such sampler"),  # llama.cpp's, as the 4 above (XTC: mlx-lm's too)
    "min_tokens": _refused(0, why="it cannot hold back EOS"),
    "use_beam_search": _refused(False, why="it does not search beams"),
    "length_penalty": _refused(1, 1.0, why="it does not search beams"),
    "include_stop_str_in_output": _refused(False, why="stop strings and stop tokens are cut from the text"),
    "skip_special_tokens": _refused(True, why="special tokens are always skipped in the text"),
    "spaces_between_special_tokens": _refused(True, why="special tokens are always skipped in the text"),
    "bad_words": _refused([], why="it does not ban words"),
    "allowed_token_ids": _refused(why="it does not restrict the vocabulary"),
    "prompt_logprobs": _refused(0, why="this server returns no log probabilities of prompt tokens"),
    "truncate_prompt_tokens": _refused(why="a prompt over the limit is refused, never truncated"),
    "repetition_detection": _refused(why="it does not stop on repeated patterns"),
    "return_tokens_as_token_ids": _refused(False, why="logprobs name tokens by their text (kakeya.token_ids: ids)"),
    "return_token_ids": _refused(False, why="the answer's token ids are under kakeya.token_ids"),
    "logits_processors": _refused(why="it runs no custom logits processors"),
    "prompt_embeds": _refused(api=COMPLETIONS, why="a prompt is text or token ids"),
    # vLLM's defaults: completions add the tokenizer's special tokens (BOS), chat only the template's
    "add_special_tokens": Param(REFUSED, accepts={COMPLETIONS: (None, True), CHAT: (None, False)}, why=_SPECIAL),
    **dict.fromkeys(("guided_json", "guided_regex", "guided_choice", "guided_grammar"), Param(HONOURED)),
    "structured_outputs": Param(HONOURED),
    **dict.fromkeys(("guided_whitespace_pattern", "structural_tag"), _refused(why="guided output has no such option")),
    # -- vLLM's extensions, /v1/chat/completions only
    # vLLM's prefill: continue_final_message with add_generation_prompt false (``http_api.chat_request``)
    **dict.fromkeys(("continue_final_message", "add_generation_prompt"), Param(HONOURED, CHAT)),
    "chat_template": _refused(api=CHAT, why="the checkpoint's own template renders messages"),
    "chat_template_kwargs": _refused({}, api=CHAT, why="the template takes no arguments here"),
    "documents": _refused([], api=CHAT, why="the template renders no documents here"),
}
ENDPOINTS = {COMPLETIONS: "/v1/completions", CHAT: "/v1/chat/completions"}


class Refused(ValueError):
    """A parameter's value this server does not take, or a field's inside one: ``param`` names it (a 400 ``http_api``
    makes; ``tools[0].function.strict``)."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


def _same(value, accepted) -> bool:
    """JSON equality that tells ``true`` from ``1`` (``True == 1`` in Python)."""
    if isinstance(value, bool) or isinstance(accepted, bool):
        return value is accepted
    numbers = isinstance(value, (int, float)) and isinstance(accepted, (int, float))
    return (numbers or type(value) is type(accepted)) and value == accepted


def check(body: dict, chat: bool) -> None:
    """Every listed parameter ``body`` sends to this API is honoured (read by ``http_api``), harmless with a
    value of its type, or refused unless its value asks for nothing: :class:`Refused` naming it."""
    api = CHAT if chat else COMPLETIONS
    for name, value in body.items():
        param = PARAMS.get(name)
        if param is None:
            continue  # not a parameter this server knows: ignored (the module docstring says why)
        if param.api not in (BOTH, api):
            raise Refused(name, f"not a parameter of {ENDPOINTS[api]} (it is one of {ENDPOINTS[param.api]})")
        accepts = param.accepts[api] if isinstance(param.accepts, dict) else param.accepts
        if param.kind == REFUSED and not any(_same(value, a) for a in accepts):
            raise Refused(name, f"{quote(value)} is not supported: {param.why}")
        elif param.kind == HARMLESS and value is not None and not isinstance(value, param.types):
            kinds = " or ".join({bool: "a boolean", str: "a string", dict: "an object"}[t] for t in param.types)
            raise Refused(name, f"must be {kinds}")


GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def constraint(body: dict, bad: Callable[[str, str], Exception]) -> tuple[Constraint | None, dict[str, str]]:
    """The one constraint ``body`` asks for (None: none) and the field names for its refusals
    (``constraint.spec`` -> the parameter that carried it); ``bad(param, message)``: the 400 to raise."""
    found: list[tuple[str, str, Constraint]] = []  # (parameter, its spec's public name, constraint)
    rf = _response_format(body.get("response_format"), bad)
    if rf is not None:
        found.append(("response_format", *rf))
    for name, kind in GUIDED.items():
        if body.get(name) is not None:
            found.append((name, name, Constraint(kind, body[name])))  # its type: checked where it compiles
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


def _response_format(value, bad) -> tuple[str, Constraint] | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if not isinstance(kind, str):
        raise bad("response_format", 'must be an object with a "type"')
    if kind not in ("text", "json_object", "json_schema"):
        raise bad("response_format", f'type {quote(kind)} is not supported: "text", "json_object" or "json_schema"')
    _known_fields(value, ("type", "json_schema") if kind == "json_schema" else ("type",), "response_format", bad)
    if kind != "json_schema":
        return None if kind == "text" else ("response_format", Constraint("json_object"))
    js = value.get("json_schema")
    if not isinstance(js, dict):
        raise bad("response_format.json_schema", 'must be an object with a "schema" (and a "name")')
    _known_fields(js, ("name", "description", "schema", "strict"), "response_format.json_schema", bad)
    strict = js.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad("response_format.json_schema.strict", "must be true or false")
    schema = js.get("schema")
    if not isinstance(schema, dict):
        raise bad("response_format.json_schema.schema", "must be a JSON schema object")
    return "response_format.json_schema.schema", Constraint("json_schema", _closed(schema) if strict else schema)


SCHEMAS = ("items", "additionalItems", "contains", "not", "if", "then", "else", "additionalProperties")
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def _closed(schema):
    """``strict: true``, as OpenAI's strict mode means it (and vLLM's): every object schema that does not say
    ``additionalProperties`` takes no other keys (JSON Schema's default, without strict, allows any)."""
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) if k in SCHEMAS else v for k, v in schema.items()}
    out |= {k: [_closed(v) for v in schema[k]] for k in SCHEMA_LISTS if isinstance(schema.get(k), list)}
    out |= {k: {n: _closed(v) for n, v in schema[k].items()} for k in SCHEMA_MAPS if isinstance(schema.get(k), dict)}
    kinds = schema.get("type") if isinstance(schema.get("type"), list) else [schema.get("type")]
    if ("object" in kinds or isinstance(schema.get("properties"), dict)) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


def _known_fields(value: dict, known: tuple[str, ...], where: str, bad) -> None:
    """Another field of ``where`` is refused naming it, as OpenAI does: dropped, it would change the answer unsaid
    (a ``schema`` beside ``json_object``, which llama.cpp honours, answered any object; a misspelt ``strict``)."""
    if unknown := [k for k in value if k not in known]:
        raise bad(f"{where}.{unknown[0][:64]}", f"not a field of this {where} (it takes {', '.join(known)})")


def _structured(value, bad) -> tuple[str, Constraint] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad("structured_outputs", "must be an object")
    _known_fields(value, (*STRUCTURED, "json_object"), "structured_outputs", bad)
    sent = [k for k, v in value.items() if v is not None and v is not False]
    if len(sent) != 1:
        why = f"must hold exactly one of json, regex, choice, grammar, json_object (got {len(sent)})"
        raise bad("structured_outputs", why)
    key = sent[0]
    name = f"structured_outputs.{key}"
    if key == "json_object":
        if value[key] is not True:
            raise bad(name, "must be true")
        return name, Constraint("json_object")
    return name, Constraint(STRUCTURED[key], value[key])


Token = Callable[[int], tuple[str, bytes]]  # ``TextCodec.token``: a token's text and bytes


def logprobs_requested(body: dict, chat: bool, bad: Callable[[str, str], Exception]) -> int | None:
    """``Request.logprobs`` from a body: None when it asks for none, else k; ``bad(param, message)`` raised
    for a bad value, or ``top_logprobs`` without ``logprobs: true``."""
    name = "top_logprobs" if chat else "logprobs"
    k = None if not chat and body.get(name) is False else body.get(name)  # completions' false asks for none, as null
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS):
        raise bad(name, f"must be an integer in 0..{MAX_LOGPROBS}, got {str(k)[:32]}")
    if not chat:
        return k
    on = body.get("logprobs")
    if on is not None and not isinstance(on, bool):
        raise bad("logprobs", f"must be true or false, got {type(on).__name__}")
    if k is not None and not on:
        raise bad("top_logprobs", "needs logprobs: true")
    return (k or 0) if on else None


def chat_logprobs(logprobs: Sequence[TokenLogprobs], token: Token) -> dict:
    """OpenAI's chat ``logprobs`` object of these tokens."""

    def entry(t: int, lp: float) -> dict:
        text, raw = token(t)
        return {"token": text, "logprob": lp, "bytes": list(raw)}

    content = [entry(lp.token, lp.logprob) | {"top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in logprobs]
    return {"content": content, "refusal": None}


def completion_logprobs(logprobs: Sequence[TokenLogprobs], token: Token, offset: int = 0) -> dict:
    """OpenAI's legacy completions ``logprobs`` object of these tokens, the first at character ``offset``."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for lp in logprobs:
        text, top = token(lp.token)[0], {}
        for t, v in (*lp.top, (lp.token, lp.logprob)):  # the chosen token is always listed (OpenAI: up to k + 1)
            top.setdefault(token(t)[0], v)  # of tokens sharing a text (byte tokens: U+FFFD), the most probable's
        for key, value in zip(out, (text, lp.logprob, top, offset)):
            out[key].append(value)
        offset += len(text)
    return out


def tools(value) -> tuple[Tool, ...]:
    """``tools``: OpenAI function tools, each ``{"type": "function", "function": {name, description, parameters}}``."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise Refused("tools", "must be a list of function tools")
    out: list[Tool] = []
    for i, t in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise Refused(where, 'must be {"type": "function", "function": {...}}')
        f = t["function"]
        description = f.get("description", "")
        if not isinstance(description, str | None):
            raise Refused(f"{where}.function.description", "must be a string")
        strict = f.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise Refused(f"{where}.function.strict", "must be true or false")
        params = _closed(f.get("parameters")) if strict else f.get("parameters")  # as response_format's strict
        out.append(Tool(f.get("name"), description or "", params, bool(strict)))
    try:  # the name and the parameters, as every front checks them
        check_tools(out)
    except ToolProblem as exc:
        raise Refused(f"tools[{exc.index}].function.{exc.part}", exc.reason) from None
    return tuple(out)


def tool_choice(value, declared: tuple[Tool, ...]) -> str:
    """``tool_choice`` as :attr:`Chat.tool_choice`: ``auto``, ``none``, ``required`` or the function's name."""
    if isinstance(value, dict):
        f = value.get("function")
        name = f.get("name") if value.get("type") == "function" and isinstance(f, dict) else None
        if not isinstance(name, str):
            why = 'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
            raise Refused("tool_choice", why)
        return choose(name, declared, named=True)
    return choose(value, declared)


def calls(value, i: int) -> tuple[ToolCall, ...]:
    """An assistant message's ``tool_calls`` (``arguments``: a JSON object's text, as OpenAI sends it)."""
    if value is None:
        return ()
    where = f"messages[{i}].tool_calls"
    if not isinstance(value, list):
        raise Refused(where, "must be a list of calls")
    out = []
    for j, c in enumerate(value):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or c.get("type", "function") != "function" or not isinstance(c.get("id"), str):
            raise Refused(f"{where}[{j}]", 'must be {"id", "type": "function", "function": {...}}')
        if not isinstance(f.get("name"), str) or not NAME.fullmatch(f["name"]):
            raise Refused(f"{where}[{j}].function.name", "must be 1-64 letters, digits, '_', '.' or '-'")
        try:
            args = load_json(f.get("arguments")) if isinstance(f.get("arguments"), str) else None
        except ValueError as exc:
            raise Refused(f"{where}[{j}].function.arguments", f"must be a JSON object's text: {exc}") from None
        if not isinstance(args, dict):
            raise Refused(f"{where}[{j}].function.arguments", "must be a JSON object's text")
        out.append(ToolCall(c["id"], f["name"], f["arguments"]))
    return tuple(out)


def message(m: dict, i: int, content: str) -> Message:
    """A message with its ``name`` (a participant's, for the template) and its tool fields: an assistant's
    ``tool_calls``, a ``tool`` message's ``tool_call_id``."""
    role, name = m["role"], "" if m.get("name") is None else m["name"]
    if not isinstance(name, str):
        raise Refused(f"messages[{i}].name", "must be a string")
    if role == "tool":
        if not isinstance(m.get("tool_call_id"), str):
            raise Refused(f"messages[{i}].tool_call_id", "a tool message needs the id of the call it answers")
        return Message(role, content, tool_call_id=m["tool_call_id"], name=name)
    if m.get("tool_calls") is not None and role != "assistant":
        raise Refused(f"messages[{i}].tool_calls", "only an assistant's message calls tools")
    return Message(role, content, tool_calls=calls(m.get("tool_calls"), i), name=name)


def call_deltas(call: ToolCall, index: int) -> list[dict]:
    """A call as OpenAI streams it: id, type and name, then its arguments (if whole already)."""
    opened = {"tool_calls": [{"index": index, "id": call.id, "type": "function",
                              "function": {"name": call.name, "arguments": ""}}]}  # fmt: skip
    return [opened, arguments_delta(call.arguments, index)] if call.arguments else [opened]


def arguments_delta(text: str, index: int) -> dict:
    """The next piece of the arguments of call ``index``."""
    return {"tool_calls": [{"index": index, "function": {"arguments": text}}]}
