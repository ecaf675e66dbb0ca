"""``tool_choice`` as every front reads it: the HTTP API's ``tool_choice`` and the gRPC API's
``ChatMessages.tool_choice`` mean the same, are refused for the same reasons, and change a request and its
answer in the same way, here.

A front turns its own wire shape (OpenAI's string or ``{"type": "function", "function": {"name"}}``, gRPC's
``ToolChoice`` oneof) into a mode or a function's name and calls :func:`choose`; a refusal is an
:class:`~kakeya.core.request.InvalidRequest` naming ``prompt.tool_choice``, which each front renames as its
clients spell it. A chat whose calls are read (:func:`reads_calls`: tools, and a choice other than ``none``)
stops where the model would wait for a call's results (:func:`stop_strings`), and its answer is the text
outside the calls plus the calls (``tool_calls.split``), with the finish reason "tool_calls" when the model
stopped after at least one call (:func:`finish_reason`). ``required`` and a named function are held to
well-formed calls by the engine's check (``checks.py``, ``tool_grammar.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

from kakeya.core.request import AUTO, NONE, REQUIRED, Chat, InvalidRequest, Tool
from kakeya.orchestrator.tool_calls import RESULT_START
from kakeya.runtime.lifecycle import quote

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
