"""The public gRPC API's messages <-> the request and the report: translation only.

A ``GenerateRequest`` becomes a :class:`~kakeya.core.request.Request` (its shape checked here, its values
by the engine) with the names its fields have on this wire (:data:`FIELD_NAMES`: a refusal names
``sampling_params.top_p`` where the request says ``sampling.top_p``). A finished run's ``Report`` becomes
the stream's ``Complete``; ``kakeya client`` rebuilds the report with :func:`report_from_stream`.
"""

from __future__ import annotations

from kakeya.core.constraints import load_json
from kakeya.core.contract import KVBytes
from kakeya.core.generation import Report
from kakeya.core.request import (
    AUTO,
    NONE,
    REQUIRED,
    CachePolicy,
    Chat,
    InvalidRequest,
    Message,
    Request,
    SamplingParams,
    Tool,
    ToolCall,
)
from kakeya.orchestrator.tools import calls as tool_calls
from kakeya.orchestrator.tools import grammar as tool_choice
from kakeya.wire import convert as wire_contract
from kakeya.wire.kakeya.v1 import cache_pb2
from kakeya.wire.kakeya.v1 import generate_pb2 as pb

# The Request's fields -> their names in a GenerateRequest (``prompt``: as the request sent it).
FIELD_NAMES = {
    "max_tokens": "sampling_params.max_tokens",
    "sampling": "sampling_params",
    "stop_strings": "sampling_params.stop",
    "stop_ids": "sampling_params.stop_token_ids",
    "ignore_eos": "sampling_params.ignore_eos",
    "logprobs": "sampling_params.logprobs",
    "cache_policy.restore": "cache_policy.restore_path",
}
PROMPT_NAMES = {  # a prompt's fields, by the oneof the request set
    "text": {"prompt": "prompt.text"},
    "tokenized": {"prompt": "prompt.tokenized.ids"},
    "messages": {  # the oneof's ChatMessages: its messages, tools and flag
        "prompt": "prompt.messages",
        "prompt.messages": "prompt.messages.messages",
        "prompt.messages[].tool_calls[].arguments": "prompt.messages.messages[].tool_calls[].arguments_json",
        "prompt.continue_final_message": "prompt.messages.continue_final_message",
        "prompt.tools": "prompt.messages.tools",
        "prompt.tools[].parameters": "prompt.messages.tools[].parameters_json",
    },
}

FINISH = {r: getattr(pb, f"FINISH_REASON_{r.upper()}") for r in ("stop", "length", "abort", "error", "tool_calls")}
FINISH_NAMES = {v: k for k, v in FINISH.items()}
# The stats a Report and a SpecStats both carry, under the same names.
SPEC_STATS = ("decode_tok_s", "prefill_s", "decode_s", "total_s", "drafter_fallback", "block_size", "cache_policy",
              "cache_bounded", "copied_blocks", "forced_blocks")  # fmt: skip
# ToolChoiceMode -> Chat.tool_choice (UNSPECIFIED: as unset, the default).
_MODES = {pb.TOOL_CHOICE_MODE_UNSPECIFIED: None, pb.TOOL_CHOICE_MODE_AUTO: AUTO, pb.TOOL_CHOICE_MODE_NONE: NONE,
          pb.TOOL_CHOICE_MODE_REQUIRED: REQUIRED}  # fmt: skip
_MODE_NAMES = [pb.ToolChoiceMode.Name(v) for v in _MODES if v]


def request_from_proto(r: pb.GenerateRequest, default_policy: CachePolicy) -> tuple[Request, dict[str, str]]:
    """``r`` as a Request, and the names of its fields on this wire (for :meth:`InvalidRequest.public`).
    ``default_policy``: the verifier's, whose values a cache policy's unset fields take."""
    which = r.WhichOneof("prompt")
    names = FIELD_NAMES | PROMPT_NAMES.get(which, {})
    if which is None:
        raise InvalidRequest("prompt", "set prompt.text, prompt.tokenized or prompt.messages")
    if which == "text":
        prompt = r.text
    elif which == "tokenized":
        prompt = list(r.tokenized.ids)
    else:
        messages = tuple(
            Message(m.role, m.content, tuple(ToolCall(c.id, c.name, c.arguments_json or "{}") for c in m.tool_calls),
                    m.tool_call_id, m.name)
            for m in r.messages.messages
        )  # fmt: skip
        tools = tuple(
            Tool(t.name, t.description, _schema(t.parameters_json, i), t.strict) for i, t in enumerate(r.messages.tools)
        )
        try:  # as every front checks them
            tool_choice.check_tools(tools)
        except tool_choice.ToolProblem as exc:
            field = "name" if exc.part == "name" else "parameters_json"
            at = exc.part.removeprefix("parameters").lstrip(".")  # where in the schema (its JSON's own names)
            reason = f"{at}: {exc.reason}" if at and field != "name" else exc.reason
            raise InvalidRequest(f"prompt.messages.tools[{exc.index}].{field}", reason) from None
        choice, choice_field = _tool_choice(r.messages.tool_choice, tools)
        names = names | {tool_choice.FIELD: choice_field}
        prompt = Chat(messages, r.messages.continue_final_message, tools, choice)
    sp = r.sampling_params
    sampling = wire_contract.sampling_of(sp, sp.seed if sp.HasField("seed") else None)  # checked with the rest
    try:
        constraint, spec_name = wire_contract.constraint_from_proto(r.constraint)
    except ValueError as exc:
        field, _, reason = str(exc).partition(": ")
        raise InvalidRequest(field, reason) from None
    names = names | {"constraint.spec": spec_name}
    request = Request(
        prompt=prompt,
        constraint=constraint,
        max_tokens=sp.max_tokens or None,  # 0: the server's default
        block_size=r.block_size,
        stop_ids=tuple(sp.stop_token_ids),
        ignore_eos=sp.ignore_eos,
        stop_strings=tuple(sp.stop),
        cache_policy=_cache_policy(r, default_policy),
        sampling=sampling,
        request_id=r.request_id,
        resume_ids=tuple(r.resume_token_ids),
        logprobs=sp.logprobs if sp.HasField("logprobs") else None,  # checked with the rest (checks.py)
    )
    return request, names


def _schema(text: str, i: int) -> dict | None:
    """A tool's ``parameters_json``: a JSON object, or None when empty."""
    if not text:
        return None
    field = f"prompt.messages.tools[{i}].parameters_json"
    try:
        schema = load_json(text)
    except ValueError as exc:
        raise InvalidRequest(field, f"must be a JSON object's text: {exc}") from None
    if not isinstance(schema, dict):
        raise InvalidRequest(field, "must be a JSON object's text")
    return schema


def _tool_choice(m: pb.ToolChoice, tools: tuple[Tool, ...]) -> tuple[str, str]:
    """``ChatMessages.tool_choice`` as ``Chat.tool_choice`` (``choose``), and the field that set it."""
    which = m.WhichOneof("choice")
    field = f"prompt.messages.tool_choice.{which or 'mode'}"
    if which == "mode" and m.mode not in _MODES:
        raise InvalidRequest(field, f"unknown value {m.mode}: must be one of {', '.join(_MODE_NAMES)}")
    try:
        if which == "function":
            return tool_choice.choose(m.function, tools, named=True), field
        return tool_choice.choose(_MODES.get(m.mode) if which else None, tools), field
    except InvalidRequest as exc:
        raise InvalidRequest(field, exc.reason) from None


def _cache_policy(r: pb.GenerateRequest, default: CachePolicy) -> CachePolicy | None:
    """The request's own policy (its unset fields: the default's); None when it sent none, or an empty one."""
    policy = wire_contract.policy_from_proto(r.cache_policy, default, "cache_policy")  # refuses fields without a kind
    return None if r.cache_policy.kind == cache_pb2.CACHE_KIND_UNSPECIFIED else policy


def complete_from_report(report: Report, reads_calls: bool = False) -> pb.GenerateResponse.Complete:
    """The stream's ``Complete``; ``reads_calls`` (``tool_choice.reads_calls`` of the request): with the calls
    read out of the text, the text outside them as ``content``, and ``FINISH_REASON_TOOL_CALLS`` where the model
    stopped after one (as the HTTP API's ``message.tool_calls`` and ``finish_reason``)."""
    s = report.sampling
    stats = pb.SpecStats(
        mean_acceptance=report.mean_acceptance,
        verifier_kv_bytes_sliding=report.kv_bytes.sliding,
        verifier_kv_bytes_full=report.kv_bytes.full,
        degenerate=report.quality["degenerate"],
        cache_kind=_cache_kind(report.cache_policy),
        block_sizes=report.block_sizes,
        acceptance_lengths=report.acceptance_lengths,
        **{k: getattr(report, k) for k in SPEC_STATS},
    )
    complete = pb.GenerateResponse.Complete(
        finish_reason=FINISH[report.finish_reason],
        prompt_tokens=len(report.prompt_token_ids),
        completion_tokens=len(report.token_ids),
        stats=stats,
        error_message=report.error,
        prompt_token_ids=report.prompt_token_ids,
        cached_tokens=report.cached_tokens,
        sampling=wire_contract.sampling_to_proto(s),
    )
    if not s.greedy:
        complete.seed = s.seed
        complete.sampling_rule = wire_contract.rule_to_proto(s.rule)
    if reads_calls:
        content, calls = tool_calls.split(report.text)
        complete.content = content
        complete.tool_calls.extend(pb.ToolCall(id=c.id, name=c.name, arguments_json=c.arguments) for c in calls)
        complete.finish_reason = FINISH[tool_choice.finish_reason(report.finish_reason, len(calls), report.text)]
    return complete


def report_from_stream(
    model: pb.ModelInfo, backend: str, complete: pb.GenerateResponse.Complete, token_ids: list[int], text: str
) -> Report:
    """The report of a generation streamed by a server (``kakeya client``): its ``Complete``, the token ids
    and text of its chunks, the model it served (``GetModelInfo``) and its verifier's backend."""
    s = complete.stats
    sampling = wire_contract.sampling_from_proto(complete.sampling) or SamplingParams()
    return Report(
        target=model.target_model,
        draft=model.draft_model,
        backend=backend,
        text=text,
        prompt_token_ids=tuple(complete.prompt_token_ids),
        token_ids=tuple(token_ids),
        finish_reason=FINISH_NAMES.get(complete.finish_reason, "error"),
        error=complete.error_message,
        block_sizes=tuple(s.block_sizes),
        acceptance_lengths=tuple(s.acceptance_lengths),
        cached_tokens=complete.cached_tokens,
        kv_bytes=KVBytes(s.verifier_kv_bytes_sliding, s.verifier_kv_bytes_full),
        sampling=sampling,
        **{k: getattr(s, k) for k in SPEC_STATS},
    )


def _cache_kind(label: str) -> int:
    """A policy label ("native", "sink-window(4+64)+kv8") -> its CacheKind."""
    if label.startswith("sink-window"):
        return cache_pb2.CACHE_KIND_SINK_WINDOW
    return cache_pb2.CACHE_KIND_NATIVE if label.startswith("native") else cache_pb2.CACHE_KIND_UNSPECIFIED
