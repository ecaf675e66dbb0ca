"""Logprobs on the HTTP front: the request's parameters read into ``Request.logprobs``, the committed tokens'
:class:`~kakeya.core.contract.TokenLogprobs` written in OpenAI's two shapes.

- ``/v1/completions``: ``logprobs: k`` (an integer 0..20; OpenAI's legacy API allows 5) gives
  ``choices[].logprobs = {tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}``; each
  ``top_logprobs`` entry holds the k most probable tokens and the chosen one (so ``0``: the chosen one alone),
  ``text_offset`` counts the characters of the ``tokens`` before it.
- ``/v1/chat/completions``: ``logprobs: true`` and ``top_logprobs: k`` (0..20, only with ``logprobs``) give
  ``choices[].logprobs = {content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}],
  refusal: null}``.

Streamed, each chunk carries the logprobs of the tokens committed since the last chunk (a chunk goes out when a
block adds text, so tokens still held back, say for a possible stop string, come with a later chunk): the chunks'
lists joined are the whole answer's. Values are the target's raw distribution (``TokenLogprobs``), one entry per
committed token, the stop token included.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kakeya.core.contract import TokenLogprobs
from kakeya.core.request import MAX_LOGPROBS

Token = Callable[[int], tuple[str, bytes]]  # ``TextCodec.token``: a token's text and bytes


def requested(body: dict, chat: bool, bad: Callable[[str, str], Exception]) -> int | None:
    """``Request.logprobs`` from a body: None when it asks for none, else k; ``bad(param, message)`` raised
    for a value out of its type or range, or ``top_logprobs`` without ``logprobs: true``."""
    k = body.get("top_logprobs") if chat else body.get("logprobs")
    if not chat and k is False:  # asks for none, as null does
        k = None
    name = "top_logprobs" if chat else "logprobs"
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


def chat(logprobs: Sequence[TokenLogprobs], token: Token) -> dict:
    """OpenAI's chat ``logprobs`` object of these tokens."""

    def entry(t: int, lp: float) -> dict:
        text, raw = token(t)
        return {"token": text, "logprob": lp, "bytes": list(raw)}

    content = [entry(lp.token, lp.logprob) | {"top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in logprobs]
    return {"content": content, "refusal": None}


def completion(logprobs: Sequence[TokenLogprobs], token: Token, offset: int = 0) -> dict:
    """OpenAI's legacy completions ``logprobs`` object of these tokens, the first at character ``offset`` of the
    completion (a stream's later chunk starts where the tokens before it end)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for lp in logprobs:
        text = token(lp.token)[0]
        top = {token(t)[0]: v for t, v in lp.top}
        top.setdefault(text, lp.logprob)  # the chosen token is always listed (OpenAI: up to k + 1)
        out["tokens"].append(text)
        out["token_logprobs"].append(lp.logprob)
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(text)
    return out
