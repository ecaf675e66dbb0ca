"""OpenAI's function tools on ``POST /v1/chat/completions``: ``tools``, ``tool_choice`` and the tool turns of
``messages`` read into the request, and the calls of an answer in OpenAI's shapes.

``tool_choice`` (its JSON shape read here, its meaning ``tools/choice.py``'s): ``auto`` (the default with
tools) reads the model's calls out of its text; ``none`` renders the tools too, as vLLM does, but reads no
call. ``required`` and a named function hold the model to well-formed calls whose arguments follow their
schemas (``tools/grammar.py``); ``strict: true`` on a function holds its arguments under ``auto`` too, once
a call is opened (the text before it stays free).
"""

from __future__ import annotations

from kakeya.core import json_text
from kakeya.core.request import Message, Tool, ToolCall
from kakeya.orchestrator.tools.calls import NAME
from kakeya.orchestrator.tools.choice import ToolProblem, check_tools, choose


class ToolError(ValueError):
    """A bad tool parameter: ``param`` is the request parameter to name in the 400."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def tools(value) -> tuple[Tool, ...]:
    """``tools``: OpenAI function tools, each ``{"type": "function", "function": {name, description, parameters}}``."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ToolError("tools", "tools: must be a list of function tools")
    out: list[Tool] = []
    for i, t in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise ToolError("tools", f'{where}: must be {{"type": "function", "function": {{...}}}}')
        f = t["function"]
        description = f.get("description", "")
        if not isinstance(description, str | None):
            raise ToolError("tools", f"{where}.function.description: must be a string")
        strict = f.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ToolError("tools", f"{where}.function.strict: must be true or false")
        out.append(Tool(f.get("name"), description or "", f.get("parameters"), bool(strict)))
    try:  # the name and the parameters, as every front checks them
        check_tools(out)
    except ToolProblem as exc:
        raise ToolError("tools", f"tools[{exc.index}].function.{exc.part}: {exc.reason}") from None
    return tuple(out)


def tool_choice(value, declared: tuple[Tool, ...]) -> str:
    """``tool_choice`` as :attr:`Chat.tool_choice`: ``auto``, ``none``, ``required`` or the function's name."""
    if isinstance(value, dict):
        f = value.get("function")
        name = f.get("name") if value.get("type") == "function" and isinstance(f, dict) else None
        if not isinstance(name, str):
            raise ToolError("tool_choice", 'tool_choice: must be "none", "auto", "required" or '
                            '{"type": "function", "function": {"name": ...}}')  # fmt: skip
        return choose(name, declared, named=True)
    return choose(value, declared)


def calls(value, i: int) -> tuple[ToolCall, ...]:
    """An assistant message's ``tool_calls`` (``arguments``: a JSON object's text, as OpenAI sends it)."""
    if value is None:
        return ()
    where = f"messages[{i}].tool_calls"
    if not isinstance(value, list):
        raise ToolError("messages", f"{where}: must be a list of calls")
    out = []
    for j, c in enumerate(value):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or c.get("type", "function") != "function" or not isinstance(c.get("id"), str):
            raise ToolError("messages", f'{where}[{j}]: must be {{"id", "type": "function", "function": {{...}}}}')
        if not isinstance(f.get("name"), str) or not NAME.fullmatch(f["name"]):
            raise ToolError("messages", f"{where}[{j}].function.name: must be 1-64 letters, digits, '_', '.' or '-'")
        try:
            args = json_text.loads(f.get("arguments")) if isinstance(f.get("arguments"), str) else None
        except ValueError as exc:
            raise ToolError(
                "messages", f"{where}[{j}].function.arguments: must be a JSON object's text: {exc}"
            ) from None
        if not isinstance(args, dict):
            raise ToolError("messages", f"{where}[{j}].function.arguments: must be a JSON object's text")
        out.append(ToolCall(c["id"], f["name"], f["arguments"]))
    return tuple(out)


def message(m: dict, i: int, content: str) -> Message:
    """A message with its tool fields: an assistant's ``tool_calls``, a ``tool`` message's ``tool_call_id``."""
    role = m["role"]
    if role == "tool":
        if not isinstance(m.get("tool_call_id"), str):
            raise ToolError(
                "messages", f"messages[{i}].tool_call_id: a tool message needs the id of the call it answers"
            )
        name = m.get("name") or ""
        if not isinstance(name, str):
            raise ToolError("messages", f"messages[{i}].name: must be a string")
        return Message(role, content, tool_call_id=m["tool_call_id"], name=name)
    if m.get("tool_calls") is not None and role != "assistant":
        raise ToolError("messages", f"messages[{i}].tool_calls: only an assistant's message calls tools")
    return Message(role, content, tool_calls=calls(m.get("tool_calls"), i))


def call_json(call: ToolCall) -> dict:
    """A call as ``message.tool_calls`` carries it."""
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def call_deltas(call: ToolCall, index: int) -> list[dict]:
    """A call as OpenAI streams it: its id, type and name with empty arguments, then the arguments (none yet
    for a call whose arguments stream in pieces, :func:`arguments_delta`)."""
    opened = {"tool_calls": [{"index": index, "id": call.id, "type": "function",
                              "function": {"name": call.name, "arguments": ""}}]}  # fmt: skip
    return [opened, arguments_delta(call.arguments, index)] if call.arguments else [opened]


def arguments_delta(text: str, index: int) -> dict:
    """The next piece of the arguments of call ``index``."""
    return {"tool_calls": [{"index": index, "function": {"arguments": text}}]}
