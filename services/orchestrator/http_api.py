"""OpenAI's HTTP API <-> the public Generation API: translation only (``http_server.py`` serves it).

A body is checked for OpenAI's types, field by field (:class:`ApiError` 400
naming the parameter), then written as the ``GenerateRequest`` a gRPC client
would send, so both fronts go through the very same validation
(``requests.py``), run (``Engine.start`` -> ``Run``) and stop-string cutting
(``server.py``); the gRPC statuses of what they refuse map to HTTP statuses
here, with OpenAI's error body. The answers -- a completion, a chat
completion, or their server-sent-event chunks -- are built from the
``Chunk``/``Complete`` messages, with ``usage.prompt_tokens_details.cached_tokens``
and Kakeya's speculative stats under ``kakeya``.

Beyond OpenAI's parameters a request may send ``top_k``, ``min_p``,
``ignore_eos``, ``stop_token_ids`` and ``block_size`` (as vLLM does), and a
chat request ``continue_final_message``.
"""

from __future__ import annotations

import math
import re
import time
import uuid
from dataclasses import dataclass

import grpc

from kakeya.runtime.lifecycle import RequestError
from kakeya.wire.kakeya.v1 import generate_pb2 as pb

STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.FAILED_PRECONDITION: 400, grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401, grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}  # fmt: skip
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
               429: "rate_limit_error", 503: "service_unavailable_error", 504: "timeout_error"}  # fmt: skip
# The GenerateRequest fields the shared validation names -> the OpenAI parameter they came from.
PARAMS = [("prompt.tokenized.ids", "prompt"), ("prompt.text", "prompt"), ("prompt.messages", "messages"),
          ("sampling_params.", ""), ("cache_policy", "cache_policy")]  # fmt: skip
FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}
UNSUPPORTED = {  # parameters whose non-default values this server cannot honour (and says so)
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
    "suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
    "repetition_penalty": (None, 1, 1.0), "add_generation_prompt": (None, True), "n": (None, 1),
}  # fmt: skip
INT32 = 2**31
KNOWN = {"prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
         "ignore_eos", "block_size", "request_id"}  # fmt: skip


class ApiError(Exception):
    """An answer in OpenAI's error shape: ``status``, then ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = ERROR_TYPES.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    @classmethod
    def of(cls, exc: RequestError) -> ApiError:
        """A refusal of the shared validation or of the server, its fields named as the HTTP client sent them."""
        message = exc.message
        for field, param in PARAMS:
            message = message.replace(field, param)
        m = re.match(r"([a-z_]+)[ .:\[]", message)
        param = m.group(1) if m and m.group(1) in KNOWN else None
        return cls(STATUS.get(exc.code, 500), message, param, exc.code.name.lower())


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param)


# --------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class Call:
    """What a request asks beyond the generation: which API, streamed or not, with a final usage chunk."""

    chat: bool
    stream: bool
    include_usage: bool
    model: str


def _number(body: dict, name: str, default=None, integer: bool = False, low=None, high=None):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)):
        raise bad(name, f"must be {'an integer' if integer else 'a number'}, got {type(v).__name__}")
    if not integer and not math.isfinite(v):
        raise bad(name, f"must be finite, got {v}")
    if (low is not None and v < low) or (high is not None and v >= high):
        raise bad(name, f"{v} is out of range")
    return v


def _flag(body: dict, name: str) -> bool:
    v = body.get(name, False)
    if not isinstance(v, bool) and v is not None:
        raise bad(name, f"must be true or false, got {type(v).__name__}")
    return bool(v)


def _ids(value, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise bad(name, "must be a list of token ids")
    if any(not -INT32 <= t < INT32 for t in value):
        raise bad(name, "token ids must be 32-bit integers")
    return value


def _sampling(body: dict, chat: bool) -> pb.SamplingParams:
    sp = pb.SamplingParams(temperature=_number(body, "temperature", 1.0, low=0, high=1e6))  # OpenAI's default: 1
    top_p = _number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise bad("top_p", f"must be in (0, 1], got {top_p}")
    sp.top_p = top_p
    top_k = _number(body, "top_k", 0, integer=True, low=-1, high=INT32)
    sp.top_k = 0 if top_k == -1 else top_k  # vLLM's -1 is off, as our 0
    sp.min_p = _number(body, "min_p", 0.0, low=0, high=1e6)
    seed = _number(body, "seed", integer=True, low=0, high=2**64)
    if seed is not None:
        sp.seed = seed
    limit = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    name = next((n for n in limit if body.get(n) is not None), limit[-1])
    sp.max_tokens = _number(body, name, 0, integer=True, low=1, high=INT32)
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("stop", "must be a string or a list of strings")
    sp.stop.extend(stops)
    sp.stop_token_ids.extend(_ids(body.get("stop_token_ids") or [], "stop_token_ids"))
    sp.ignore_eos = _flag(body, "ignore_eos")
    return sp


def _common(body: dict, served: str, chat: bool) -> tuple[pb.GenerateRequest, Call]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model", served)
    if model != served:
        raise ApiError(
            404, f"The model `{model}` does not exist (this server serves `{served}`)", "model", "model_not_found"
        )
    for name, defaults in UNSUPPORTED.items():
        if body.get(name, None) not in defaults:
            raise bad(name, f"{body.get(name)!r} is not supported by this server")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad("stream_options", "must be an object")
    stream = _flag(body, "stream")
    req = pb.GenerateRequest(sampling_params=_sampling(body, chat))
    req.block_size = _number(body, "block_size", 0, integer=True, low=-INT32, high=INT32)
    return req, Call(chat, stream, stream and _flag(options, "include_usage"), served)


def completion_request(body: dict, served: str) -> tuple[pb.GenerateRequest, Call]:
    """``POST /v1/completions``: one prompt, as text or token ids (a list of one of either is one prompt too)."""
    req, call = _common(body, served, chat=False)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        req.text = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        req.tokenized.ids.extend(_ids(prompt, "prompt"))
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise bad("prompt", "one prompt per request (this server does not batch prompts)")
    else:
        raise bad("prompt", "must be a string or a list of token ids")
    return req, call


def chat_request(body: dict, served: str) -> tuple[pb.GenerateRequest, Call]:
    """``POST /v1/chat/completions``: the messages, rendered by the checkpoint's chat template."""
    req, call = _common(body, served, chat=True)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "must be a non-empty list of messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad("messages", f"messages[{i}] must be an object with a role")
        req.messages.messages.add(role=m["role"], content=_content(m.get("content"), i))
    req.messages.continue_final_message = _flag(body, "continue_final_message")
    return req, call


def _content(content, i: int) -> str:
    """A message's text: a string, or a list of text parts (other parts, e.g. images, are not supported)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if all(p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            return "".join(p["text"] for p in content)
        raise bad("messages", f"messages[{i}].content: only text parts are supported")
    raise bad("messages", f"messages[{i}].content must be a string or a list of text parts")


# --------------------------------------------------------------------------- answers


class Answer:
    """One request's answer, built from its ``Chunk``s and its ``Complete``: whole, or as stream chunks."""

    def __init__(self, call: Call):
        self.call = call
        self.id = ("chatcmpl-" if call.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.text: list[str] = []
        self.token_ids: list[int] = []

    def _envelope(self, choices: list, chunk: bool = False) -> dict:
        kind = ("chat.completion" if self.call.chat else "text_completion") + (
            ".chunk" if chunk and self.call.chat else ""
        )
        return {"id": self.id, "object": kind, "created": self.created, "model": self.call.model, "choices": choices}

    def _choice(self, text: str, finish: str | None, chunk: bool) -> dict:
        if not self.call.chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        key = "delta" if chunk else "message"
        body = {"content": text} if chunk else {"role": "assistant", "content": text}
        return {"index": 0, key: body, "logprobs": None, "finish_reason": finish}

    def opening(self) -> dict | None:
        """A chat stream's first chunk (the assistant's role), as OpenAI sends it."""
        if not self.call.chat:
            return None
        return self._envelope([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}], chunk=True)  # fmt: skip

    def add(self, chunk: pb.GenerateResponse.Chunk) -> dict | None:
        """A streamed ``Chunk``'s text as an event (None when it carries no text yet)."""
        self.token_ids.extend(chunk.token_ids)
        self.text.append(chunk.text)
        return self._envelope([self._choice(chunk.text, None, True)], chunk=True) if chunk.text else None

    def closing(self, complete: pb.GenerateResponse.Complete) -> list[dict]:
        """A stream's last events: the finish reason with Kakeya's stats, then (if asked) the usage."""
        last = self._envelope([self._choice("", finish_reason(complete), True)], chunk=True)
        last["kakeya"] = stats(complete, self.token_ids)
        if not self.call.include_usage:
            return [last]
        return [last, self._envelope([], chunk=True) | {"usage": usage(complete)}]

    def whole(self, complete: pb.GenerateResponse.Complete) -> dict:
        body = self._envelope([self._choice("".join(self.text), finish_reason(complete), False)])
        return body | {"usage": usage(complete), "kakeya": stats(complete, self.token_ids)}


def finish_reason(complete: pb.GenerateResponse.Complete) -> str:
    if complete.finish_reason == pb.FINISH_REASON_ERROR:
        raise ApiError(500, f"generation failed: {complete.error_message}")
    return FINISH.get(complete.finish_reason, "stop")


def usage(c: pb.GenerateResponse.Complete) -> dict:
    return {
        "prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
        "total_tokens": c.prompt_tokens + c.completion_tokens, "prompt_tokens_details": {"cached_tokens": c.cached_tokens},
    }  # fmt: skip


def stats(c: pb.GenerateResponse.Complete, token_ids: list[int]) -> dict:
    """Kakeya's extension: the completion's token ids and the speculative stats ``kakeya client`` prints."""
    s = c.stats
    out = {
        "token_ids": list(token_ids), "acceptance_lengths": list(s.acceptance_lengths),
        "mean_acceptance": round(s.mean_acceptance, 4), "decode_tok_s": round(s.decode_tok_s, 3),
        "prefill_s": round(s.prefill_s, 6), "drafter_fallback": s.drafter_fallback, "block_size": s.block_size,
        "cache_policy": s.cache_policy, "cached_tokens": c.cached_tokens,
    }  # fmt: skip
    return out | ({"seed": c.seed} if c.HasField("seed") else {})


def models(served: str, max_model_len: int) -> dict:
    return {"object": "list", "data": [{"id": served, "object": "model", "created": 0, "owned_by": "kakeya",
                                        "max_model_len": max_model_len}]}  # fmt: skip
