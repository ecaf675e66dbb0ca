"""What the HTTP front does with each parameter a request may send: honoured, refused, or harmless.

Every parameter of OpenAI's ``POST /v1/completions`` and ``POST /v1/chat/completions`` is in
:data:`PARAMS`, with the extensions of vLLM's API that clients of OpenAI-compatible servers send:

- **honoured**: the generation runs as it asks (``fronts/http_api.py`` reads it);
- **refused**: this server cannot do what it asks, so any value but the one that asks for nothing
  (its ``accepts``) is a 400 naming it -- never a generation that silently differs from the request;
- **harmless**: accepted (its type checked) and not used, because it does not change what comes back
  (``user``, ``store``, ``metadata``: bookkeeping of OpenAI's own service).

A parameter one API honours and the other does not take (``messages`` sent to ``/v1/completions``)
is refused by the other, naming the API that takes it. A name in no list is ignored, as the front
always has (vLLM's server does the same): clients of OpenAI-compatible servers send vendor fields
this table cannot know, and every field known to change the output is listed here.

The constraint parameters (``response_format``, vLLM's ``guided_*`` and ``structured_outputs``) are
honoured: ``fronts/http_constraints.py`` reads them into one constraint.
"""

from __future__ import annotations

from dataclasses import dataclass

from kakeya.runtime.lifecycle import quote

HONOURED, REFUSED, HARMLESS = "honoured", "refused", "harmless"
COMPLETIONS, CHAT, BOTH = "completions", "chat", "both"


@dataclass(frozen=True)
class Param:
    """``kind``: :data:`HONOURED`, :data:`REFUSED` or :data:`HARMLESS`; ``api``: which endpoint takes it;
    ``accepts``: a refused parameter's values that ask for nothing (its default); ``types``: the JSON
    types a harmless one may have (None always may); ``why``: said when a value is refused."""

    kind: str
    api: str = BOTH
    accepts: tuple = (None,)
    types: tuple[type, ...] = ()
    why: str = ""


def _refused(*accepts, api: str = BOTH, why: str = "") -> Param:
    return Param(REFUSED, api, (None, *accepts), why=why)


def _harmless(*types: type, api: str = BOTH) -> Param:
    return Param(HARMLESS, api, types=types)


_NO_LOGPROBS = "this server returns no log probabilities of prompt tokens"
_NO_TOOLS = "the deprecated function-calling parameters are not supported: use tools and tool_choice"
_TEXT = "this server generates text only"
PARAMS: dict[str, Param] = {
    # -- OpenAI, both APIs
    "model": Param(HONOURED),  # must be the served model (404 otherwise)
    "max_tokens": Param(HONOURED),
    "temperature": Param(HONOURED),
    "top_p": Param(HONOURED),
    "seed": Param(HONOURED),
    "stop": Param(HONOURED),
    "stream": Param(HONOURED),
    "stream_options": Param(HONOURED),  # include_usage, include_obfuscation (``http_api.stream_options``)
    "n": _refused(1, why="one choice per request"),
    "logprobs": Param(HONOURED),  # chat: true/false; completions: k (``fronts/http_logprobs.py``)
    "logit_bias": _refused({}, why="it does not bias logits"),
    "presence_penalty": _refused(0, 0.0, why="it applies no penalties"),
    "frequency_penalty": _refused(0, 0.0, why="it applies no penalties"),
    "user": _harmless(str),  # an end-user id for OpenAI's abuse monitoring
    # -- OpenAI, /v1/completions only
    "prompt": Param(HONOURED, COMPLETIONS),
    "best_of": _refused(1, api=COMPLETIONS, why="one candidate per request"),
    "echo": _refused(False, api=COMPLETIONS, why="it does not echo the prompt"),
    "suffix": _refused("", api=COMPLETIONS, why="it does not insert text"),
    # -- OpenAI, /v1/chat/completions only
    "messages": Param(HONOURED, CHAT),
    "max_completion_tokens": Param(HONOURED, CHAT),
    "response_format": Param(HONOURED, CHAT),  # http_constraints.py
    "modalities": _refused(["text"], api=CHAT, why=_TEXT),
    "audio": _refused(api=CHAT, why=_TEXT),
    "top_logprobs": Param(HONOURED, CHAT),  # with logprobs: true
    "tools": Param(HONOURED, CHAT),  # function tools (``fronts/http_tools.py``)
    "tool_choice": Param(HONOURED, CHAT),  # auto, none, required or a named function (``fronts/http_tools.py``)
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
    "prompt_cache_key": _harmless(str, api=CHAT),  # a cache-routing hint: the prefix cache needs none
    "prompt_cache_retention": _harmless(str, api=CHAT),
    "safety_identifier": _harmless(str, api=CHAT),
    # -- vLLM's extensions, both APIs
    "top_k": Param(HONOURED),
    "min_p": Param(HONOURED),
    "ignore_eos": Param(HONOURED),
    "stop_token_ids": Param(HONOURED),
    "request_id": Param(HONOURED),  # in the logs of every process the request reaches
    "block_size": Param(HONOURED),  # Kakeya's own: the speculative block size (0: auto)
    "repetition_penalty": _refused(1, 1.0, why="it applies no penalties"),
    "min_tokens": _refused(0, why="it cannot hold back EOS"),
    "use_beam_search": _refused(False, why="it does not search beams"),
    "length_penalty": _refused(1, 1.0, why="it does not search beams"),
    "include_stop_str_in_output": _refused(False, why="stop strings are cut from the text"),
    "skip_special_tokens": _refused(True, why="special tokens are always skipped in the text"),
    "bad_words": _refused([], why="it does not ban words"),
    "allowed_token_ids": _refused(why="it does not restrict the vocabulary"),
    "prompt_logprobs": _refused(0, why=_NO_LOGPROBS),
    "truncate_prompt_tokens": _refused(why="a prompt over the limit is refused, never truncated"),
    "guided_json": Param(HONOURED),  # http_constraints.py
    "guided_regex": Param(HONOURED),  # http_constraints.py
    "guided_choice": Param(HONOURED),  # http_constraints.py
    "guided_grammar": Param(HONOURED),  # http_constraints.py
    "structured_outputs": Param(HONOURED),  # http_constraints.py
    # -- vLLM's extensions, /v1/chat/completions only
    "continue_final_message": Param(HONOURED, CHAT),
    "add_generation_prompt": _refused(True, api=CHAT, why="the template always opens the assistant's turn"),
    "chat_template": _refused(api=CHAT, why="the checkpoint's own template renders messages"),
    "chat_template_kwargs": _refused({}, api=CHAT, why="the template takes no arguments here"),
}
ENDPOINTS = {COMPLETIONS: "/v1/completions", CHAT: "/v1/chat/completions"}


class Refused(ValueError):
    """A parameter's value this server does not take: ``param`` names it (a 400 ``http_api`` makes)."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


def _same(value, accepted) -> bool:
    """JSON equality that tells ``true`` from ``1`` (``True == 1`` in Python)."""
    if isinstance(value, bool) or isinstance(accepted, bool):
        return value is accepted
    if isinstance(value, (int, float)) and isinstance(accepted, (int, float)):
        return value == accepted
    return type(value) is type(accepted) and value == accepted


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
        if param.kind == REFUSED and not any(_same(value, a) for a in param.accepts):
            raise Refused(name, f"{quote(value)} is not supported: {param.why}")
        elif param.kind == HARMLESS and value is not None and not isinstance(value, param.types):
            kinds = " or ".join({bool: "a boolean", str: "a string", dict: "an object"}[t] for t in param.types)
            raise Refused(name, f"must be {kinds}")
