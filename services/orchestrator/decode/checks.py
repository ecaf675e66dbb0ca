"""The one check of a request: every value a client sent, against the model and this server's limits.

Every front's :class:`~kakeya.core.request.Request` goes through :func:`check_request` (``Engine.start``)
before any model work. A refusal is an ``InvalidRequest`` naming the ``Request`` field (``sampling.top_p``,
``cache_policy.window``), which the front renames as its clients spell it; sizes are bounded before
anything is tokenized (``runtime/bounds.py``). What comes out is the request as it runs: prompt ids,
``max_tokens`` and ``request_id`` filled in, a seed drawn, the block size fixed where the sampling rule
needs one schedule, a named restoration source mapped to this server's directory.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, fields, replace
from typing import Protocol

from kakeya.core import constraints
from kakeya.core.contract import Drafter, Verifier
from kakeya.core.request import (
    AUTO,
    MAX_BLOCK_SIZE,
    MAX_LOGPROBS,
    REJECTION,
    CachePolicy,
    Chat,
    CheckedRequest,
    InvalidRequest,
    Request,
)
from kakeya.orchestrator.text import ChatError, TextCodec, template_inputs
from kakeya.orchestrator.tools.calls import RESULT_START
from kakeya.orchestrator.tools.grammar import GrammarError, holds_calls, marker_terms, reads_calls, tool_call_grammar
from kakeya.runtime import bounds

DEFAULT_MAX_TOKENS = 128
_CHAT_FIELD = re.compile(
    r"(messages(?:\[\d+\])?(?:\.\w+(?:\[\d+\])?)*|tools\[\d+\](?:\.\w+)*|continue_final_message):? (.*)", re.DOTALL
)


class EngineFacts(Protocol):
    """What the check reads of an engine (``engine.Engine``, which calls it)."""

    verifier: Verifier
    drafter: Drafter | None
    codec: TextCodec | None
    default_block_size: int

    def max_block_size(self, policy: CachePolicy | None = None) -> int: ...


@dataclass(frozen=True)
class Limits:
    """What a server accepts (its flags). ``max_prompt_tokens`` 0: ``bounds.DEFAULT_MAX_PROMPT_TOKENS``;
    ``max_context`` 0: the verifier's or the model's; ``max_tokens_limit`` 0: none. ``restore``: the
    ``--restore`` sources a cache policy may name (None: a remote verifier maps the names itself)."""

    default_max_tokens: int = DEFAULT_MAX_TOKENS
    max_tokens_limit: int = 0
    max_prompt_tokens: int = 0
    max_context: int = 0
    restore: bounds.RestoreSources | None = None


def context_of(engine: EngineFacts, limits: Limits) -> int:
    """The positions one request may hold: the server's --max-context, the verifier's, the model's."""
    info = engine.verifier.info
    model = info.max_position_embeddings or 131072
    return min(x for x in (limits.max_context, info.max_context, model) if x)


def prompt_limit(engine: EngineFacts, limits: Limits) -> int:
    """--max-prompt-tokens (0: the default; a negative one the servicer refuses), never above the context."""
    return min(limits.max_prompt_tokens or bounds.DEFAULT_MAX_PROMPT_TOKENS, context_of(engine, limits))


def check_request(req: Request, engine: EngineFacts, limits: Limits = Limits()) -> CheckedRequest:
    """``req`` checked and completed as it will run (see the module docstring), or InvalidRequest."""
    request_id = bounds.check_request_id(req.request_id) or uuid.uuid4().hex[:16]
    max_prompt, context = prompt_limit(engine, limits), context_of(engine, limits)
    held_by = "--max-prompt-tokens" if max_prompt < context else "its context"  # the limit the operator set lower
    prompt = _prompt_ids(req.prompt, engine, max_prompt, held_by)
    if len(prompt) >= context:  # no room for any output: the prompt is what does not fit, whatever max_tokens says
        why = f"the prompt is too long: {len(prompt)} tokens leave no room for output in the context limit {context}"
        raise InvalidRequest("prompt", why, "context_length_exceeded")
    max_tokens = min(limits.default_max_tokens, context - len(prompt)) if req.max_tokens is None else req.max_tokens
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise InvalidRequest("max_tokens", f"must be an integer >= 1, got {max_tokens!r}")
    if limits.max_tokens_limit and max_tokens > limits.max_tokens_limit:
        why = f"{max_tokens} exceeds this server's limit {limits.max_tokens_limit} (--max-tokens-limit)"
        raise InvalidRequest("max_tokens", why)
    if len(prompt) + max_tokens > context:
        why = f"the prompt is too long for it: {len(prompt)} + {max_tokens} tokens exceed the context limit {context}"
        raise InvalidRequest("max_tokens", why, "context_length_exceeded")  # as OpenAI's: a history outgrows it so
    stop_ids = _stops(req, engine)
    _constraint(req, engine)  # the client's own, refused as its parameter before any tool grammar takes it in
    req = _tool_calls(req, engine)  # a tool choice's grammar, compiled there
    sampling = req.sampling.check().seeded()  # an unseeded sampling request draws its seed here
    if not 1 <= req.max_block_size <= MAX_BLOCK_SIZE:
        raise InvalidRequest("max_block_size", f"must be between 1 and {MAX_BLOCK_SIZE}, got {req.max_block_size}")
    if not 0 <= req.block_size <= MAX_BLOCK_SIZE:
        raise InvalidRequest("block_size", f"must be 0 (auto) or 1..{MAX_BLOCK_SIZE}, got {req.block_size}")
    k = req.logprobs
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS):
        raise InvalidRequest("logprobs", f"must be an integer in 0..{MAX_LOGPROBS} (or unset), got {k!r}")
    info = engine.verifier.info
    ends = frozenset(stop_ids) | frozenset(() if req.ignore_eos else info.eos_token_ids)
    _resume(req, sampling, ends, max_tokens, info.vocab_size)
    block_size = req.block_size if engine.drafter is not None else 1  # no drafter: every block is one token
    policy = _cache_policy(req.cache_policy, engine, limits, block_size, len(prompt) + max_tokens)
    if block_size == 0 and engine.drafter is not None and not sampling.greedy and sampling.rule == REJECTION:
        # The rejection rule's tokens depend on the block sizes, so its seed must meet one schedule, never
        # one that timings pick: auto runs at the drafter's trained size (within the policy's limits).
        # The coupled rule's tokens depend on no schedule: auto stays auto.
        block_size = min(engine.default_block_size, req.max_block_size, engine.max_block_size(policy))
    # a chat whose calls are read stops where their results would follow: the server's own stop, added once
    own_stop = (RESULT_START,) if reads_calls(req.prompt) and RESULT_START not in req.stop_strings else ()
    return replace(
        CheckedRequest(**{f.name: getattr(req, f.name) for f in fields(Request)}),
        prompt=prompt,
        max_tokens=max_tokens,
        block_size=block_size,
        stop_ids=stop_ids,
        stop_strings=(*req.stop_strings, *own_stop),
        cache_policy=policy,
        sampling=sampling,
        request_id=request_id,
        resume_ids=tuple(req.resume_ids),
    )


def _resume(req: Request, sampling, stop_ids, max_tokens: int, vocab: int) -> None:
    """A resumed stream's tokens continue only what this request would have generated, exactly: at most
    ``max_tokens``, no stop token but the last, a seed the client sent, a rule keyed by position, no grammar, no
    calls. Tokens that end the generation (a stream broken after its last token) get its Complete and no block."""
    ids = req.resume_ids
    if not ids:
        return
    field = "resume_token_ids"
    bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequest(field, f"token id {bad!r} is not in the vocabulary (0..{vocab - 1})")
    if len(ids) > max_tokens:
        raise InvalidRequest(field, f"{len(ids)} tokens are more than max_tokens {max_tokens}")
    stop = next((t for t in ids[:-1] if t in stop_ids), None)  # the last may end it: the run owes its Complete
    if stop is not None:
        raise InvalidRequest(field, f"tokens follow stop token {stop}, where the generation ended")
    if not req.sampling.greedy and req.sampling.seed is None:
        raise InvalidRequest(field, "a sampled stream resumes only with the seed it ran with (sampling seed)")
    if not sampling.greedy and sampling.rule == REJECTION:
        raise InvalidRequest(field, "the rejection rule's draws are not keyed by position: it cannot resume exactly")
    if req.constraint is not None or reads_calls(req.prompt):  # Complete's calls: read out of the resumed text alone
        raise InvalidRequest(field, "a constrained generation or one whose tool calls are read cannot resume")


def _prompt_ids(prompt, engine: EngineFacts, limit: int, held_by: str) -> list[int]:
    """The prompt as token ids: a text tokenized, a conversation rendered by the chat template, ids checked;
    each bounded before it is tokenized past ``bounds.CHARS_PER_TOKEN_BOUND`` characters a token."""
    codec, vocab = engine.codec, engine.verifier.info.vocab_size
    if isinstance(prompt, str | Chat):
        if codec is None:
            raise InvalidRequest("prompt", "this server has no tokenizer (--tokenizer); send token ids")
        if isinstance(prompt, str):
            if not prompt:  # whitespace is text (a newline, an indentation): tokenized as any
                raise InvalidRequest("prompt", "empty prompt")
            chars = len(prompt)
        else:
            chars = sum(len(m.content) + len(m.role) + sum(len(c.arguments) for c in m.tool_calls)
                        for m in prompt.messages) + len(repr(prompt.tools))  # fmt: skip
        if chars > limit * bounds.CHARS_PER_TOKEN_BOUND:  # too long as surely as a prompt counted: refused as one
            why = f"the prompt is too long: {chars} characters, far over this server's limit {limit} tokens ({held_by})"
            raise InvalidRequest("prompt", why, "context_length_exceeded")
        if isinstance(prompt, str):
            ids = codec.encode(prompt)
        else:
            if not prompt.messages:
                raise InvalidRequest("prompt", "a conversation needs at least one message")
            try:
                messages, tools = template_inputs(prompt)
                ids = codec.encode_chat(messages, continue_final_message=prompt.continue_final_message, tools=tools)
            except ChatError as exc:  # "messages[1].role must be ...": the field is the chat's own
                m = _CHAT_FIELD.match(str(exc))
                field = f"prompt.{m[1]}" if m else _template_culprit(prompt, codec)
                raise InvalidRequest(field, m[2] if m else str(exc)) from None
    else:
        ids = list(prompt)
        if not ids:
            raise InvalidRequest("prompt", "must not be empty")
        if any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
            raise InvalidRequest("prompt", "token ids must be integers")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest("prompt", f"ids outside the vocabulary [0, {vocab}): {bad[:5]}")
    if len(ids) > limit:
        why = f"the prompt is too long: {len(ids)} tokens exceed this server's limit {limit} ({held_by})"
        raise InvalidRequest("prompt", why, "context_length_exceeded")
    return ids


def _template_culprit(chat: Chat, codec: TextCodec) -> str:
    """The field a chat template's failure names: the tools where the messages render without them."""
    if not chat.tools:
        return "prompt"
    try:
        codec.encode_chat(
            template_inputs(replace(chat, tools=()))[0], continue_final_message=chat.continue_final_message
        )
    except ChatError:
        return "prompt"
    return "prompt.tools"


def _tool_calls(req: Request, engine: EngineFacts) -> Request:
    """A chat whose calls a grammar holds (under ``auto``, beside a JSON answer too): the request constrained to them."""
    chat, c, answer = req.prompt, req.constraint, None
    if not reads_calls(chat) or (c is None and not holds_calls(chat.tools, chat.tool_choice, chat.parallel_tool_calls)):
        return req
    if c is not None:
        if chat.tool_choice != AUTO or c.kind not in ("json_schema", "json_object"):  # a JSON answer or calls only
            held = f"tool_choice {chat.tool_choice!r}{' (a call or a JSON answer)' if chat.tool_choice == AUTO else ''}"
            raise InvalidRequest("constraint", f"{held} constrains the output already")
        answer = constraints.load_json(c.spec) if isinstance(c.spec, str) else c.spec or {"type": "object"}
    terms = marker_terms(engine.codec.tokenizer if engine.codec is not None else None)
    try:
        grammar = tool_call_grammar(chat.tools, chat.tool_choice, terms, chat.parallel_tool_calls, answer)
    except GrammarError as exc:  # a tool's schema this grammar cannot hold: named in the tool's parameters
        field = "prompt.tool_choice" if exc.tool is None else f"prompt.tools[{exc.tool}].parameters"
        raise InvalidRequest(field, str(exc)) from None
    held = replace(req, constraint=constraints.Constraint("grammar", grammar))
    try:
        _constraint(held, engine)
    except InvalidRequest as exc:  # the grammar is the tools' and the choice's, never the client's constraint
        if not exc.field.startswith("constraint"):
            raise
        raise InvalidRequest(constraint_field(req), exc.reason) from None
    return held


def constraint_field(req: Request) -> str:
    """The field a refusal of the grammar holding ``req`` names: its spec, or the tool choice."""
    chat = req.prompt
    if req.constraint is not None or not isinstance(chat, Chat):
        return "constraint.spec"
    return "prompt.tools" if chat.tool_choice == AUTO else "prompt.tool_choice"


def _constraint(req: Request, engine: EngineFacts) -> None:
    """A constraint compiled once against the checkpoint's tokenizer: a bad schema, regex, grammar or choice
    list is refused here, naming ``constraint.spec`` (``constraint.kind`` for an unknown kind)."""
    c = req.constraint
    if c is None:
        return
    if not isinstance(c, constraints.Constraint):
        raise InvalidRequest("constraint", "must be a Constraint")
    if c.kind not in constraints.KINDS:
        why = f"must be one of {', '.join(constraints.KINDS)}, got {str(c.kind)[:40]!r}"
        raise InvalidRequest("constraint.kind", why)
    if not engine.verifier.constrains:
        raise InvalidRequest("constraint", "this server's verifier does not take constraints")
    if engine.codec is None:
        raise InvalidRequest("constraint", "this server has no tokenizer (--tokenizer) to compile a constraint against")
    if req.ignore_eos:
        raise InvalidRequest("ignore_eos", "a constrained generation ends where its grammar does: drop ignore_eos")
    info = engine.verifier.info
    if not info.eos_token_ids:
        raise InvalidRequest("constraint", "the model declares no EOS token to end a constrained generation")
    try:
        tok = constraints.tokenizer(engine.codec.tokenizer_json, info.vocab_size, (info.eos_token_ids[0],))
        constraints.check(c.grammar(), tok)
    except constraints.ConstraintError as exc:
        raise InvalidRequest("constraint.spec", constraints.placed(str(exc), c)) from None


def _stops(req: Request, engine: EngineFacts) -> tuple[int, ...]:
    stops, vocab = tuple(req.stop_strings), engine.verifier.info.vocab_size
    n = len(stops) - (RESULT_START in stops and reads_calls(req.prompt))  # the server's own is not counted
    if n > bounds.MAX_STOP_STRINGS:
        raise InvalidRequest("stop_strings", f"{n} strings, at most {bounds.MAX_STOP_STRINGS} allowed")
    if any(not isinstance(s, str) or not s for s in stops):
        raise InvalidRequest("stop_strings", "stop strings must be non-empty strings")
    if long := [len(s) for s in stops if len(s) > bounds.MAX_STOP_STRING_CHARS]:
        why = f"a stop string of {long[0]} characters, at most {bounds.MAX_STOP_STRING_CHARS}"
        raise InvalidRequest("stop_strings", why)
    if stops and engine.codec is None:
        raise InvalidRequest("stop_strings", "this server has no tokenizer (--tokenizer); use stop token ids")
    ids = list(req.stop_ids)
    if len(ids) > bounds.MAX_STOP_TOKEN_IDS:
        raise InvalidRequest("stop_ids", f"{len(ids)} ids, at most {bounds.MAX_STOP_TOKEN_IDS}")
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise InvalidRequest("stop_ids", f"ids outside the vocabulary [0, {vocab}): {bad[:5]}")
    return tuple(ids)


def _cache_policy(
    policy: CachePolicy | None, engine: EngineFacts, limits: Limits, block_size: int, positions: int
) -> CachePolicy | None:
    """The request's cache policy (None: the verifier's), checked as the verifier checks it against the
    request's ``positions``, so a refusal names its fields; the block size checked against it."""
    window = engine.verifier.info.sliding_window
    if policy is not None:
        # a window (or sink count) beyond the session's positions would only allocate ring slots that never fill
        most = max(window, positions)
        if policy.window is not None and policy.window > most:
            why = f"{policy.window} exceeds this request's {most} positions (or the model's window)"
            raise InvalidRequest("cache_policy.window", why)
        if policy.sink > most:
            raise InvalidRequest("cache_policy.sink", f"{policy.sink} exceeds this request's {most} positions")
        policy.resolve(window)
        if limits.restore is not None and policy.restore is not None:  # the name picks one of our --restore sources
            name = policy.restore
            if name not in limits.restore.by_name:
                known = ", ".join(limits.restore.names()) or "none configured"
                why = f"unknown restoration source {name[:64]!r} (known: {known})"
                raise InvalidRequest("cache_policy.restore", why)
            policy = replace(policy, restore=limits.restore.by_name[name])
    runs = (policy or engine.verifier.policy).resolve(window)
    if block_size > runs.slack:
        why = f"{runs.slack} is smaller than block_size {block_size}: rollback would not be exact"
        raise InvalidRequest("cache_policy.slack", why)
    if runs.restore and block_size > runs.window:
        raise InvalidRequest("block_size", f"{block_size} exceeds the restoring window {runs.window}")
    return policy
