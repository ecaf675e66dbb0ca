"""Chat messages -> the prompt text the checkpoint was tuned on, with the checkpoint's own chat template.

The template is ``chat_template.jinja`` beside the tokenizer or ``chat_template`` in ``tokenizer_config.json``
(a string, or named templates of which ``default`` is used), rendered as transformers'
``apply_chat_template`` renders it (jinja2's sandbox, ``trim_blocks``/``lstrip_blocks``, loop controls,
``raise_exception``, ``tojson``, ``strftime_now``, the special tokens as variables); the text is tokenized
without adding special tokens (the template writes its own).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kakeya.checkpoints.config import chat_template_source
from kakeya.core import json_text
from kakeya.core.request import Chat, ToolCall
from kakeya.orchestrator.tools.calls import NAME
from kakeya.orchestrator.tools.grammar import ToolProblem, check_tools
from kakeya.runtime.lifecycle import quote

ROLES = ("system", "developer", "user", "assistant", "tool")
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker for continue_final_message


class ChatError(ValueError):
    """A conversation the template cannot render (raise_exception, a bad message); the message says why."""


def _raise(message: str):
    raise ChatError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatTemplate:
    """One checkpoint's chat template, compiled once; :meth:`render` is pure (thread-safe)."""

    def __init__(self, source: str, special_tokens: dict[str, str]):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"chat template: {exc}") from None
        self.special_tokens = dict(special_tokens)

    @classmethod
    def load(cls, checkpoint_dir: str | Path) -> ChatTemplate | None:
        """The template of the tokenizer files in ``checkpoint_dir``; None when it ships none."""
        path = Path(checkpoint_dir)
        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        source = chat_template_source(path)  # chat_template.jinja or tokenizer_config.json's (one reading)
        if not source:
            return None
        return cls(source, _special_tokens(cfg))

    def render(
        self,
        messages: Sequence[dict],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """The prompt text of ``messages`` (``{"role", "content"}`` dicts): with the model's turn opened after
        them (``add_generation_prompt``), or the last (assistant) message left open to be continued."""
        check_messages(messages)
        messages = [dict(m) for m in messages]
        if continue_final_message:  # as transformers: a tag after the final content, the text cut where it lands
            if messages[-1]["role"] != "assistant":
                raise ChatError("continue_final_message: the last message must be the assistant's")
            messages[-1]["content"] += CONTINUE_TAG
            add_generation_prompt = False
        try:
            text = self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **self.special_tokens, **kwargs)  # fmt: skip
        except ChatError:
            raise
        except jinja2.TemplateError as exc:  # the template cannot take these messages
            raise ChatError(f"chat template: {exc}") from None
        except (TypeError, ValueError, LookupError, AttributeError, RecursionError) as exc:  # nor these tools
            raise ChatError(f"chat template: {type(exc).__name__}: {exc}") from None
        if continue_final_message:
            at = text.rfind(CONTINUE_TAG.strip())
            if at < 0:
                raise ChatError("continue_final_message: the template drops the final message's content")
            text = text[:at] if text[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()
        return text


def template_inputs(chat: Chat) -> tuple[list[dict], list[dict] | None]:
    """A :class:`Chat`'s messages and tools as a chat template reads them: OpenAI's shapes, as transformers'
    ``apply_chat_template`` takes them, but for a call's arguments, given as the object its JSON text holds (as
    vLLM hands them to templates, which serialise them in the model's own call syntax)."""
    messages = []
    called: set[str] = set()  # ids of the calls made so far: a tool message answers one of them
    for i, m in enumerate(chat.messages):
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        called.update(c.id for c in m.tool_calls)
        if m.role == "tool" and m.tool_call_id not in called:
            raise ChatError(
                f"messages[{i}].tool_call_id: {quote(m.tool_call_id)} answers no call of an earlier assistant"
                " message (a tool message answers one of their tool_calls by its id)"
            )
        if m.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": _arguments(c, i, j)}}
                for j, c in enumerate(m.tool_calls)
            ]
        if m.role == "tool":
            message["tool_call_id"] = m.tool_call_id
            if m.name:
                message["name"] = m.name
        messages.append(message)
    try:
        check_tools(chat.tools)
    except ToolProblem as exc:
        raise ChatError(str(exc)) from None
    tools = [
        {"type": "function", "function": {"name": t.name, "description": t.description}
         | ({"parameters": dict(t.parameters)} if t.parameters is not None else {})}
        for t in chat.tools
    ]  # fmt: skip
    return messages, tools or None


def _arguments(call: ToolCall, i: int, j: int) -> dict:
    """A call's arguments as the object their JSON text holds (ChatError naming the call if not one)."""
    try:
        args = json_text.loads(call.arguments)
    except ValueError as exc:
        raise ChatError(f"messages[{i}].tool_calls[{j}].arguments: {exc}") from None
    if not isinstance(args, dict) or not NAME.fullmatch(call.name):
        raise ChatError(f"messages[{i}].tool_calls[{j}]: needs a function's name and its arguments as a JSON object")
    return args


def check_messages(messages: Sequence[dict]) -> None:
    """ChatError naming the first bad message: each needs a known role and a string content."""
    if not messages:
        raise ChatError("messages: at least one message is needed")
    for i, m in enumerate(messages):
        if m.get("role") not in ROLES:
            raise ChatError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {quote(m.get('role'))}")
        if not isinstance(m.get("content"), str):
            raise ChatError(f"messages[{i}].content must be a string")


def _special_tokens(cfg: dict) -> dict[str, str]:
    """The tokenizer's special tokens as the template sees them (a token may be written as a dict)."""
    out = {}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        tok = cfg.get(name)
        if isinstance(tok, dict):
            tok = tok.get("content")
        out[name] = tok or ""
    return out
