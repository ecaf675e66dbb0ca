"""``tool_choice`` (and the tools it chooses among) as every front reads them: the HTTP API's ``tool_choice``
and the gRPC API's ``ChatMessages.tool_choice`` mean the same and are refused for the same reasons, here.

A front turns its wire shape into a mode or a function's name and calls :func:`choose` (a refusal names
``prompt.tool_choice``, which the front renames); :func:`check_tools` checks a tool's name and parameters.
A chat whose calls are read (:func:`reads_calls`) stops where the model would wait for a call's results
(:func:`stop_strings`); its answer is the text outside the calls plus the calls, finishing "tool_calls"
when the model stopped after one (:func:`finish_reason`). ``required`` and a named function are held to
well-formed calls by the engine's check (``tools/grammar.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kakeya.core.request import AUTO, NONE, REQUIRED, Chat, InvalidRequest, Tool
from kakeya.orchestrator.tools.calls import NAME, RESULT_START
from kakeya.runtime.lifecycle import quote


class ToolProblem(ValueError):
    """A bad tool: ``index`` in the tools, ``part`` of it (``name``, ``parameters``, ``parameters.required`` ...)
    and ``reason``; each front names the field its own way (``tools[0].function.name``, ``...parameters_json``)."""

    def __init__(self, index: int, part: str, reason: str):
        super().__init__(f"tools[{index}].{part}: {reason}")
        self.index, self.part, self.reason = index, part, reason


def check_tools(tools: Sequence[Tool]) -> None:
    """Each tool's name (1-64 letters, digits, '_', '.' or '-', declared once) and parameters (none, or a JSON
    schema of ``"type": "object"`` whose ``properties`` is an object and ``required`` a list of strings);
    :class:`ToolProblem` for the first that is not."""
    for i, t in enumerate(tools):
        if not isinstance(t.name, str) or not NAME.fullmatch(t.name):
            raise ToolProblem(i, "name", "must be 1-64 letters, digits, '_', '.' or '-'")
        if any(t.name == other.name for other in tools[:i]):
            raise ToolProblem(i, "name", f"{quote(t.name)} is declared twice")
        p = t.parameters
        if p is None:
            continue
        if not isinstance(p, Mapping) or p.get("type", "object") != "object":
            raise ToolProblem(i, "parameters", 'must be a JSON schema of "type": "object"')
        if not isinstance(p.get("properties", {}), Mapping):
            raise ToolProblem(i, "parameters.properties", "must be an object")
        required = p.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise ToolProblem(i, "parameters.required", "must be a list of strings")


FIELD = "prompt.tool_choice"
MODES = (NONE, AUTO, REQUIRED)
TOOL_CALLS = "tool_calls"  # the finish reason of an answer that ends in calls


def choose(value, tools: Sequence[Tool], named: bool = False) -> str:
    """The :attr:`Chat.tool_choice` of a request that sent ``value`` (None: none sent) with ``tools``:
    ``auto`` by default with tools, ``none`` without; ``named``: ``value`` is a function's name."""
    if value is None:
        return AUTO if tools else NONE
    if named:
        if value in MODES:  # Chat.tool_choice would read it as the mode
            raise InvalidRequest(FIELD, f"a function named {quote(value)} cannot be chosen by name")
        if not any(t.name == value for t in tools):
            raise InvalidRequest(FIELD, f"names {quote(value)}, which is not one of the tools")
        return value
    if value not in MODES:
        raise InvalidRequest(FIELD, f'must be "none", "auto", "required" or a function, got {quote(value)}')
    if value != NONE and not tools:
        raise InvalidRequest(FIELD, f"{quote(value)} needs tools")
    return value


def reads_calls(prompt) -> bool:
    """Whether the model's calls are read out of its text: a chat with tools and a choice other than ``none``
    (which renders the tools but hands the text back as it is)."""
    return isinstance(prompt, Chat) and bool(prompt.tools) and prompt.tool_choice != NONE


def stop_strings(stops: Sequence[str], prompt) -> tuple[str, ...]:
    """A request's stop strings: a chat whose calls are read also stops where a call's results would follow."""
    return tuple(stops) + ((RESULT_START,) if reads_calls(prompt) else ())


def finish_reason(reason: str, calls: int) -> str:
    """An answer's finish reason: "tool_calls" where the model stopped after ``calls`` > 0 calls (OpenAI's)."""
    return TOOL_CALLS if calls and reason == "stop" else reason
