"""OpenAI's HTTP API <-> the request and the report: translation only (``fronts/http_server.py`` serves it).

A body is checked for OpenAI's types field by field (:class:`ApiError` 400 naming the parameter), then written as a
:class:`~kakeya.core.request.Request`, its refusals naming the parameter as this API spells it (:func:`field_names`).
A body must be valid Unicode (no lone surrogate); an error quotes at most 64 characters of a client's value. Answers
are built from the run's blocks and its ``Report``, Kakeya's speculative stats under ``kakeya``.
"""

from __future__ import annotations

import re
import secrets
import time
import uuid
from dataclasses import dataclass, replace

import grpc

from kakeya.core.constraints import valid_unicode
from kakeya.core.generation import Block, Report
from kakeya.core.request import Chat, InvalidRequest, Request, SamplingParams, public_field
from kakeya.orchestrator.fronts import http_params
from kakeya.orchestrator.tools import calls as tool_calls
from kakeya.orchestrator.tools import grammar as tool_choice
from kakeya.runtime.lifecycle import RequestError, bounded, quote

STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.FAILED_PRECONDITION: 400, grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401, grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.CANCELLED: 499,  # a client that left its place in the queue (nginx's status)
}  # fmt: skip
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error",
               503: "service_unavailable_error", 504: "timeout_error"}  # fmt: skip
# The public gRPC names a backend's refusal may carry (``service.public_status``) -> the OpenAI parameter.
PARAMS = [("prompt.tokenized.ids", "prompt"), ("prompt.text", "prompt"), ("prompt.messages", "messages"),
          ("sampling_params.", ""), ("cache_policy", "cache_policy")]  # fmt: skip
INT32 = 2**31
# An HTTP error's gRPC code, as kakeya_errors_total{code} counts both APIs' (400: INVALID_ARGUMENT, the first; a 405
# or 415, a method or body coding it lacks, is UNIMPLEMENTED: not INTERNAL, the server's own faults an operator is paged
# for; 499, a client that left, is a caller's cancel as gRPC counts one: not UNAVAILABLE, a server that cannot serve).
GRPC_CODES = {s: c.name for c, s in reversed(STATUS.items())} | {405: "UNIMPLEMENTED", 408: "DEADLINE_EXCEEDED",
                                                                 413: "RESOURCE_EXHAUSTED", 415: "UNIMPLEMENTED"}  # fmt: skip


class ApiError(Exception):
    """An answer in OpenAI's error shape: ``status``, then ``{"error": {message, type, param, code}}``: ``param`` the field
    as OpenAI names one, in a list too (``messages[0].content``), a 400's ``code`` OpenAI's for it (the SDK reads both)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        message = bounded(message)  # whatever it quotes, an answer's error stays small
        super().__init__(message)
        if status == 400 and param and not code:
            code = "invalid_function_parameters" if ".function.parameters" in param else "invalid_value"
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = ERROR_TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    @classmethod
    def invalid(cls, exc: InvalidRequest, names: dict[str, str]) -> ApiError:
        """The engine's refusal of a value, named as this request sent it."""
        return cls(400, exc.public(names), public_field(exc.field, names) or None, exc.code)

    @classmethod
    def of(cls, exc: RequestError) -> ApiError:
        """A refusal of the shared validation or of the server, its fields named as the HTTP client sent them."""
        message = exc.message
        for field, param in PARAMS:
            message = message.replace(field, param)
        m = re.match(r"(([a-z_]+)[\w.\[\]]*)[ :]", message)  # the field it leads with, and its parameter
        kind = getattr(http_params.PARAMS.get(m.group(2) if m else ""), "kind", None)
        param = m.group(1) if kind == http_params.HONOURED else None
        return cls(STATUS.get(exc.code, 500), message, param, exc.code.name.lower())


def bad(path: str, message: str) -> ApiError:
    """A 400 about a parameter or a field inside one (``response_format.json_schema.schema``), named as ``param``."""
    return ApiError(400, f"{path}: {message}", path)


@dataclass(frozen=True)
class Reply:
    """What a request asks of its answer: which API, streamed or not, with a final usage chunk."""

    chat: bool
    stream: bool
    include_usage: bool
    model: str
    obfuscate: bool = False  # stream_options.include_obfuscation: pad each chunk with random characters
    tools: bool = False  # read the model's tool calls out of its text (``tool_choice`` auto, with tools)
    held_calls: bool = False  # a grammar holds the calls well-formed: stream their arguments as they come
    logprobs: bool = False  # the answer lists each token's logprobs


def _number(body: dict, name: str, default=None, integer: bool = False, low=None, high=None):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)):
        raise bad(name, f"must be {'an integer' if integer else 'a number'}, got {type(v).__name__}")
    if bound := (low is not None and v < low and f">= {low}") or (high is not None and v >= high and f"< {high}"):
        raise bad(name, f"{quote(v)} is out of range (must be {bound})")  # compared exactly, however many digits
    if not integer:
        try:
            v = float(v)  # an integer of 400 digits has no float; NaN: SamplingParams.check refuses it, as inf
        except OverflowError:
            raise bad(name, f"{quote(v)} is out of range") from None
    return v


def _flag(body: dict, name: str, parent: str = "") -> bool:
    v = body.get(name, False)
    if not isinstance(v, bool) and v is not None:
        raise ApiError(400, f"{parent}{name}: must be true or false, got {type(v).__name__}", parent + name)
    return bool(v)


def _ids(value, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise bad(name, "must be a list of token ids")
    if any(not -INT32 <= t < INT32 for t in value):
        raise bad(name, "token ids must be 32-bit integers")
    return value


def field_names(chat: bool, max_tokens: str) -> dict[str, str]:
    """The Request's fields -> the parameters of this API they came from (``max_tokens``: which one was sent)."""
    prompt = {
        "prompt": "messages",
        "prompt.messages": "messages",
        "prompt.continue_final_message": "continue_final_message",
        "prompt.tool_choice": "tool_choice",
        "prompt.parallel_tool_calls": "parallel_tool_calls",
        "prompt.tools": "tools",
        "prompt.tools[].parameters": "tools[].function.parameters",
        "prompt.messages[].tool_calls[].arguments": "messages[].tool_calls[].function.arguments",
    }
    return (prompt if chat else {}) | {
        "max_tokens": max_tokens,
        "logprobs": "top_logprobs" if chat else "logprobs",
        "sampling": "",
        "stop_strings": "stop",
        "stop_ids": "stop_token_ids",
    }


def _unicode(body: dict) -> None:
    """Every string of ``body`` (keys too) is valid Unicode: JSON's ``\\ud800`` escape decodes to a lone
    surrogate, which no tokenizer, template or UTF-8 answer can take."""
    for name, value in body.items():
        try:
            unicode = valid_unicode({name: value})
        except RecursionError:
            raise bad(name, "nested too deeply") from None
        if not unicode:
            param = name if isinstance(name, str) and name.isascii() and name.isprintable() else quote(name)
            raise bad(param, "contains a lone surrogate (\\ud800-\\udfff): not valid Unicode")


def model_not_found(model, served: str) -> ApiError:
    return ApiError(404, f"The model {quote(model)} does not exist (this server serves {quote(served)})",
                    "model", "model_not_found")  # fmt: skip


def stream_options(body: dict, stream: bool) -> tuple[bool, bool]:
    """``stream_options``: (``include_usage``, ``include_obfuscation``) as asked."""
    options = {} if body.get("stream_options") is None else body["stream_options"]  # null, never any falsy value
    if not isinstance(options, dict):
        raise bad("stream_options", "must be an object")
    # strict, as vLLM is: an option of a stream that is not one (so none below), or one misspelt, would be ignored
    if options and not stream:
        raise bad("stream_options", 'only with "stream": true (a whole answer always carries its usage)')
    unknown = sorted(set(options) - {"include_usage", "include_obfuscation"}, key=str)
    if unknown:
        raise bad("stream_options", f"unknown option {quote(unknown[0])} (include_usage and include_obfuscation are)")
    return tuple(_flag(options, k, "stream_options.") for k in ("include_usage", "include_obfuscation"))


def _common(body: dict, served: str, chat: bool) -> tuple[dict, Reply, dict[str, str]]:
    """The parameters both APIs share, as Request fields; the call; the field names."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _unicode(body)
    model = body.get("model")  # null: unset, as every optional field here (the served model)
    if model is not None and not isinstance(model, str):
        raise bad("model", f"must be a string, got {type(model).__name__}")
    if model not in (None, served):
        raise model_not_found(model, served)
    try:
        http_params.check(body, chat)
    except http_params.Refused as exc:
        raise ApiError(400, str(exc), exc.param) from None
    stream = _flag(body, "stream")
    include_usage, obfuscate = stream_options(body, stream)
    sampling = SamplingParams(
        temperature=_number(body, "temperature", 1.0, low=0),  # OpenAI's default: 1
        top_k=max(_number(body, "top_k", 0, integer=True, low=-1, high=INT32), 0),  # vLLM's -1 is off, as our 0
        top_p=_number(body, "top_p", 1.0),  # its range and min_p's: SamplingParams.check's, as gRPC's
        min_p=_number(body, "min_p", 0.0),
        seed=_number(body, "seed", integer=True, low=0, high=2**64),
    )
    limit = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    max_name = next((n for n in limit if body.get(n) is not None), limit[-1])
    both = [body.get(n) for n in ("max_tokens", "max_completion_tokens")]
    if chat and None not in both and both[0] != both[1]:  # as OpenAI's
        raise bad("max_tokens", f"{quote(body['max_tokens'])} beside a different max_completion_tokens: send one")
    stop, stop_ids = ([] if body.get(k) is None else body[k] for k in ("stop", "stop_token_ids"))  # null, no falsy
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("stop", "must be a string or a list of strings")
    request_id = "" if body.get("request_id") is None else body["request_id"]  # 0 or false is no string either
    if not isinstance(request_id, str):
        raise bad("request_id", "must be a string")
    fields = {
        "max_tokens": _number(body, max_name, None, integer=True, low=1, high=INT32),
        "block_size": _number(body, "block_size", 0, integer=True, low=-INT32, high=INT32),
        "stop_strings": tuple(stops),
        "stop_ids": tuple(_ids(stop_ids, "stop_token_ids")),
        "ignore_eos": _flag(body, "ignore_eos"),
        "sampling": sampling,
        "request_id": request_id,
        "logprobs": http_params.logprobs_requested(body, chat, bad),
    }
    fields["constraint"], constraint_names = http_params.constraint(body, bad)
    call = Reply(chat, stream, include_usage, served, obfuscate, logprobs=fields["logprobs"] is not None)
    return fields, call, field_names(chat, max_name) | constraint_names


def completion_request(body: dict, served: str) -> tuple[Request, Reply, dict[str, str]]:
    """``POST /v1/completions``: one prompt, as text or token ids (a list of one of either is one prompt too)."""
    fields, call, names = _common(body, served, chat=False)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise bad("prompt", "one prompt per request (this server does not batch prompts)")
    if isinstance(prompt, list) and prompt:  # token ids (a bad one refused as such)
        prompt = _ids(prompt, "prompt")
    elif not isinstance(prompt, str):
        raise bad("prompt", "must be a string or a list of token ids")
    return Request(prompt, **fields), call, names


def chat_request(body: dict, served: str) -> tuple[Request, Reply, dict[str, str]]:
    """``POST /v1/chat/completions``: the messages, rendered by the checkpoint's chat template."""
    fields, call, names = _common(body, served, chat=True)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "must be a non-empty list of messages")
    turns = []
    try:
        tools = http_params.tools(body.get("tools"))
        choice = http_params.tool_choice(body.get("tool_choice"), tools)
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise bad(f"messages[{i}]", "must be an object with a role")
            if m.get("function_call") is not None:  # refused by name: dropped, the history would lose the call
                raise bad(f"messages[{i}].function_call", "not supported (deprecated): send tool_calls instead")
            # an assistant's turn that calls tools may have no content (OpenAI sends null)
            empty = m.get("content") is None and (m.get("tool_calls") or m["role"] == "tool")
            turns.append(http_params.message(m, i, "" if empty else _content(m.get("content"), i)))
    except http_params.Refused as exc:
        raise ApiError(400, str(exc), exc.param) from None
    except InvalidRequest as exc:  # a tool_choice refused as every front refuses it (``tools/grammar.py``)
        raise ApiError.invalid(exc, names) from None
    parallel = body.get("parallel_tool_calls") is None or _flag(body, "parallel_tool_calls")  # unset: true
    last = _flag(body, "continue_final_message")  # vLLM's prefill: with add_generation_prompt false, never true
    if body.get("add_generation_prompt") is not None and _flag(body, "add_generation_prompt") is last:
        raise bad("add_generation_prompt", "cannot be true with continue_final_message (as vLLM) nor false without it")
    prompt = Chat(tuple(turns), last, tools, choice, parallel)
    held = tool_choice.holds_calls(tools, choice, prompt.parallel_tool_calls)
    call = replace(call, tools=tool_choice.reads_calls(prompt), held_calls=held)
    return Request(prompt, **fields), call, names


def _content(content, i: int) -> str:
    """A message's text: a string, or a list of text parts (other parts, e.g. images, are not supported)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"messages[{i}].content", "must be a string or a list of text parts")
    for j, part in enumerate(content):  # the part a refusal names: the app finds the image or the bad one among many
        if (kind := part.get("type") if isinstance(part, dict) else type(part).__name__) != "text":  # image_url ...
            raise bad(f"messages[{i}].content[{j}]", f"type {quote(kind)} is not supported: this model reads text only")
        if not isinstance(part.get("text"), str):
            raise bad(f"messages[{i}].content[{j}].text", "must be a string")
    return "".join(part["text"] for part in content)


class Answer:
    """One request's answer, built from its run's blocks and its report: whole, or as stream chunks."""

    def __init__(self, call: Reply, token: http_params.Token | None = None):
        """``token``: a token's text and bytes (``TextCodec.token``), for logprobs."""
        self.call = call
        self.id = ("chatcmpl-" if call.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.calls = tool_calls.CallStream(arguments=call.held_calls) if call.tools else None
        self.calls_sent = 0  # the index of the next streamed call
        self.logprobs: list = []  # every committed token's TokenLogprobs (a call with logprobs)
        self._sent = self._offset = 0  # how many of them chunks carried; the characters of their tokens
        self._token = token or (lambda t: (str(t), str(t).encode()))  # no tokenizer: ids as text

    def _logprobs(self, chunk: bool) -> dict | None:
        """The logprobs a choice carries: a chunk, those of the tokens since the last chunk; else all."""
        if not self.call.logprobs:
            return None
        if not chunk:
            return self._render(self.logprobs, 0)
        out = self._render(self.logprobs[self._sent :], self._offset)
        self._sent = len(self.logprobs)
        if not self.call.chat:  # where the next chunk's first token starts in the completion's tokens
            self._offset = out["text_offset"][-1] + len(out["tokens"][-1]) if out["tokens"] else self._offset
        return out

    def _render(self, logprobs: list, offset: int) -> dict:
        if self.call.chat:
            return http_params.chat_logprobs(logprobs, self._token)
        return http_params.completion_logprobs(logprobs, self._token, offset)

    def _envelope(self, choices: list, chunk: bool = False) -> dict:
        kind = "chat.completion" + (".chunk" if chunk else "") if self.call.chat else "text_completion"
        body = {"id": self.id, "object": kind, "created": self.created, "model": self.call.model, "choices": choices}
        if chunk and self.call.obfuscate:  # as OpenAI's: random characters, so a chunk's size does not tell its text
            body["obfuscation"] = secrets.token_urlsafe(12)[: 1 + secrets.randbelow(16)]
        return body

    def _choice(self, text: str, finish: str | None, chunk: bool) -> dict:
        logprobs = self._logprobs(chunk)
        if not self.call.chat:
            return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        key = "delta" if chunk else "message"
        body = ({"content": text} if text else {}) if chunk else {"role": "assistant", "content": text}  # last: {}
        return {"index": 0, key: body, "logprobs": logprobs, "finish_reason": finish}

    def opening(self) -> dict | None:
        """A chat stream's first chunk (the assistant's role), as OpenAI's: content null where calls may come."""
        if not self.call.chat:
            return None
        delta = {"role": "assistant", "content": None if self.calls is not None else ""}
        return self._envelope([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}], chunk=True)

    def add(self, block: Block) -> list[dict]:
        """A committed block's text as stream events (none unless streamed: :meth:`whole` writes it)."""
        self.token_ids.extend(block.tokens)
        self.logprobs.extend(block.logprobs or ())
        self.text.append(block.text)
        return self._events(block.text) if self.call.stream else []

    def tail(self, report: Report) -> list[dict]:
        """The text the run held back to its end (a partial character, a possible stop string), as events."""
        rest = report.text[len("".join(self.text)) :]
        self.text.append(rest)
        return self._events(rest) + ([] if self.calls is None else self._deltas(self.calls.end()))

    def _events(self, text: str) -> list[dict]:
        if self.calls is None:
            return [self._envelope([self._choice(text, None, True)], chunk=True)] if text else []
        return self._deltas(self.calls.feed(text))

    def _deltas(self, events: list) -> list[dict]:
        """Content and calls (``tool_calls.CallStream``'s events) as chunks, each call as OpenAI streams one."""
        deltas: list[dict] = []
        for e in events:
            if isinstance(e, str):
                deltas.append({"content": e})
            elif isinstance(e, tool_calls.ArgumentsPiece):  # of the call last opened
                deltas.append(http_params.arguments_delta(e.text, self.calls_sent - 1))
            else:  # a call opened (its arguments to come) or whole
                deltas += http_params.call_deltas(getattr(e, "call", e), self.calls_sent)
                self.calls_sent += 1
        # the first chunk carries the logprobs of the tokens since the previous one (README, Logprobs)
        return [self._envelope([{"index": 0, "delta": d, "logprobs": None if i else self._logprobs(True),
                                 "finish_reason": None}], chunk=True) for i, d in enumerate(deltas)]  # fmt: skip

    def _finish(self, report: Report, calls: int) -> str:
        return tool_choice.finish_reason(finish_reason(report), calls, report.text)

    def closing(self, report: Report) -> list[dict]:
        """A stream's last events: the finish reason with Kakeya's stats, then (if asked) the usage."""
        last = self._envelope([self._choice("", self._finish(report, self.calls_sent), True)], chunk=True)
        last["kakeya"] = stats(report)
        if not self.call.include_usage:
            return [last]
        return [last, self._envelope([], chunk=True) | {"usage": usage(report)}]

    def whole(self, report: Report) -> dict:
        if self.calls is None:
            body = self._envelope([self._choice(report.text, finish_reason(report), False)])
        else:  # content: the text outside the calls, as streamed; null when there is none (as OpenAI's)
            content, calls = tool_calls.split(report.text)
            choice = self._choice(content or (None if calls else ""), self._finish(report, len(calls)), False)
            if calls:
                choice["message"]["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name,
                                                    "arguments": c.arguments}} for c in calls]  # fmt: skip
            body = self._envelope([choice])
        return body | {"usage": usage(report), "kakeya": stats(report)}


def finish_reason(report: Report) -> str:
    if report.finish_reason != "error":
        return report.finish_reason
    code = getattr(grpc.StatusCode, report.error_code, None)  # the status a refusal for the same cause has
    raise ApiError(STATUS.get(code, 500), f"generation failed: {report.error}")


def usage(r: Report) -> dict:
    prompt, completion = len(r.prompt_token_ids), len(r.token_ids)
    return {
        "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": r.cached_tokens},
    }  # fmt: skip


def stats(r: Report) -> dict:
    """Kakeya's extension: the completion's token ids and the speculative stats ``kakeya client`` prints."""
    j = r.to_json()
    keep = ("token_ids", "acceptance_lengths", "mean_acceptance", "decode_tok_s", "prefill_s", "drafter_fallback",
            "block_size", "block_sizes", "copied_blocks", "forced_blocks", "cache_policy", "cached_tokens", "seed")  # fmt: skip
    return {k: j[k] for k in keep if k != "seed" or j["seed"] is not None}


def models(served: str, max_model_len: int) -> dict:
    return {"object": "list", "data": [{"id": served, "object": "model", "created": 0, "owned_by": "kakeya",
                                        "max_model_len": max_model_len}]}  # fmt: skip
