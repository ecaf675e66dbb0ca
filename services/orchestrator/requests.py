"""A public ``GenerateRequest`` -> a validated :class:`~kakeya.core.request.Request`, or ``INVALID_ARGUMENT`` naming the field.

Every size a client sends is checked against this server's :class:`Limits`
before anything is tokenized past a coarse bound or allocated anywhere (see
``services/runtime/bounds.py``).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from kakeya.core.request import MAX_BLOCK_SIZE, CachePolicy, Request
from kakeya.orchestrator.chat import ChatError
from kakeya.orchestrator.engine import Engine
from kakeya.runtime import bounds
from kakeya.runtime.lifecycle import check_policy, check_token_ids, invalid, policy_from_request
from kakeya.wire import convert as wire_contract
from kakeya.wire.kakeya.v1 import cache_pb2
from kakeya.wire.kakeya.v1 import generate_pb2 as pb


@dataclass(frozen=True)
class Limits:
    """What this orchestrator accepts (its flags, capped by the target's facts)."""

    max_tokens_limit: int
    default_max_tokens: int
    max_prompt_tokens: int
    max_context: int  # prompt + max_tokens must fit (the target's max_position_embeddings, or less)
    # The --restore sources a request's cache policy may name, when this process holds the verifier
    # (colocated). None: the verifier is remote and maps the names itself.
    restore: bounds.RestoreSources | None


def parse_request(r: pb.GenerateRequest, engine: Engine, limits: Limits) -> Request:
    try:
        return _parse(r, engine, limits)
    except ValueError as exc:  # the bounds module's checks
        raise invalid(str(exc)) from None


def _parse(r: pb.GenerateRequest, e: Engine, limits: Limits) -> Request:
    vocab = e.verifier.info.vocab_size
    bounds.check_request_id(r.request_id)
    which = r.WhichOneof("prompt")
    if which is None:
        raise invalid("prompt: set prompt.text, prompt.tokenized or prompt.messages")
    if which == "messages":
        prompt = _messages(r.messages, e, limits)
        field = "prompt.messages"
    elif which == "text":
        if not r.text.strip():
            raise invalid("prompt.text: empty prompt")
        if e.codec is None:
            raise invalid("prompt.text: this server has no tokenizer (--tokenizer); send prompt.tokenized")
        if len(r.text) > limits.max_prompt_tokens * bounds.CHARS_PER_TOKEN_BOUND:
            raise invalid(
                f"prompt.text: {len(r.text)} characters, far beyond the {limits.max_prompt_tokens}-token limit"
            )
        prompt = e.codec.encode(r.text)
        field = "prompt.text"
    else:
        if len(r.tokenized.ids) > limits.max_prompt_tokens:
            raise invalid(
                f"prompt.tokenized.ids: {len(r.tokenized.ids)} tokens exceed this server's limit"
                f" {limits.max_prompt_tokens} (--max-prompt-tokens)"
            )
        prompt = check_token_ids(r.tokenized.ids, vocab, "prompt.tokenized.ids")
        field = "prompt.tokenized.ids"
    sp = r.sampling_params
    try:
        sampling = wire_contract.public_sampling(sp).seeded()  # an unseeded request draws its seed here
    except ValueError as exc:
        raise invalid(str(exc)) from None
    max_tokens = sp.max_tokens or limits.default_max_tokens
    if max_tokens < 1:
        raise invalid(
            f"sampling_params.max_tokens must be >= 1 (0 = the default {limits.default_max_tokens}), got {sp.max_tokens}"
        )
    if max_tokens > limits.max_tokens_limit:
        raise invalid(
            f"sampling_params.max_tokens {max_tokens} exceeds this server's limit {limits.max_tokens_limit} (--max-tokens-limit)"
        )
    bounds.check_prompt(len(prompt), max_tokens, limits.max_prompt_tokens, limits.max_context, field)
    bounds.check_stops(sp.stop, sp.stop_token_ids)
    stops = tuple(sp.stop)
    if any(not s for s in stops):
        raise invalid("sampling_params.stop: stop strings must not be empty")
    if stops and e.codec is None:
        raise invalid("sampling_params.stop: this server has no tokenizer (--tokenizer); use stop_token_ids")
    stop_ids = check_token_ids(sp.stop_token_ids, vocab, "sampling_params.stop_token_ids", allow_empty=True)
    if not 0 <= r.block_size <= MAX_BLOCK_SIZE:
        raise invalid(f"block_size must be 0 (auto) or 1..{MAX_BLOCK_SIZE}, got {r.block_size}")
    block_size = r.block_size if e.drafter is not None else 1
    return Request(
        prompt_ids=list(prompt),
        max_tokens=max_tokens,
        block_size=block_size,
        stop_ids=tuple(stop_ids),
        stop_strings=stops,
        ignore_eos=sp.ignore_eos,
        cache_policy=_cache_policy(r, e, limits, block_size, len(prompt) + max_tokens),
        sampling=sampling,
        request_id=r.request_id or uuid.uuid4().hex[:16],
    )


def _messages(m: pb.ChatMessages, e: Engine, limits: Limits) -> list[int]:
    """A conversation's prompt ids: the checkpoint's chat template, bounded before it renders anything."""
    if e.codec is None:
        raise invalid("prompt.messages: this server has no tokenizer (--tokenizer); send prompt.tokenized")
    chars = sum(len(x.content) + len(x.role) for x in m.messages)
    if chars > limits.max_prompt_tokens * bounds.CHARS_PER_TOKEN_BOUND:
        raise invalid(f"prompt.messages: {chars} characters, far beyond the {limits.max_prompt_tokens}-token limit")
    messages = [{"role": x.role, "content": x.content} for x in m.messages]
    try:
        return e.codec.encode_chat(messages, continue_final_message=m.continue_final_message)
    except ChatError as exc:
        raise invalid(f"prompt.{exc}" if str(exc).startswith("messages") else f"prompt.messages: {exc}") from None


def _cache_policy(
    r: pb.GenerateRequest, e: Engine, limits: Limits, block_size: int, positions: int
) -> CachePolicy | None:
    """The request's own cache policy (None: the verifier's default), checked against the model and the
    request's ``positions`` (prompt + max_tokens) as the verifier checks it, so a refusal names public fields."""
    if not r.HasField("cache_policy"):
        return None
    window = e.verifier.info.sliding_window
    policy = policy_from_request(r.cache_policy, e.verifier.policy, "cache_policy")  # unset fields: the default's
    if r.cache_policy.kind == cache_pb2.CACHE_KIND_UNSPECIFIED:  # an empty message: the default itself
        return None
    # a window (or sink count) beyond the session's positions would only allocate ring slots that never fill
    bounds.check_window(
        policy,
        max(window, positions),
        "cache_policy",
        f"the {positions} positions of this request (prompt + max_tokens; or the model's window {window})",
    )
    check_policy(policy, window, "cache_policy")
    if limits.restore is not None:  # the name picks one of our --restore sources
        policy = limits.restore.to_server(policy, "cache_policy")
    if block_size > policy.slack:
        raise invalid(
            f"cache_policy.slack {policy.slack} is smaller than block_size {block_size}: rollback would not be exact"
        )
    return policy
