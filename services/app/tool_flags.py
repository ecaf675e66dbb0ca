"""The tool flags of `kakeya client generate --chat`: ``--tools FILE|JSON`` (OpenAI's ``tools``: a list of
``{"type": "function", "function": {name, description, parameters}}``, read as the HTTP API reads it) and
``--tool-choice auto|none|required|NAME`` (a name: that function), into the request's ``ChatMessages``.
The server checks the choice as it checks every front's (INVALID_ARGUMENT naming the field) and returns the
calls it reads in ``Complete.tool_calls``, which :func:`calls_json` prints."""

from __future__ import annotations

import json

from kakeya.app.constraint_flags import text_or_file

MODES = ("auto", "none", "required")


def add_tool_options(p) -> None:
    g = p.add_argument_group("tools (with --chat; the calls come back parsed, see the README's Tool calls)")
    g.add_argument("--tools", metavar="FILE|JSON", help="function tools in OpenAI's format (a JSON list)")
    g.add_argument(
        "--tool-choice",
        metavar="auto|none|required|NAME",
        help="whether the model may call a tool (default: auto with --tools), must call one, or must call NAME",
    )


def set_tools(messages, args) -> None:
    """``--tools`` and ``--tool-choice`` into ``messages`` (a ``ChatMessages``); ValueError naming the flag."""
    from kakeya.orchestrator.fronts.http_params import ToolError, tools
    from kakeya.wire.kakeya.v1 import generate_pb2 as pb

    if args.tools is not None:
        try:
            declared = tools(json.loads(text_or_file(args.tools)))
        except (ValueError, RecursionError) as exc:  # ToolError is a ValueError, as is bad JSON
            why = str(exc) if isinstance(exc, ToolError) else f"not JSON ({exc})"
            raise ValueError(f"--tools: {why}") from None
        for t in declared:
            schema = json.dumps(dict(t.parameters)) if t.parameters is not None else ""
            messages.tools.add(name=t.name, description=t.description, parameters_json=schema)
    choice = args.tool_choice
    if choice in MODES:
        messages.tool_choice.mode = pb.ToolChoiceMode.Value(f"TOOL_CHOICE_MODE_{choice.upper()}")
    elif choice is not None:
        messages.tool_choice.function = choice


def calls_json(complete) -> list[dict]:
    """A ``Complete``'s parsed calls: ``{id, name, arguments}`` (arguments: the JSON object)."""
    return [
        {"id": c.id, "name": c.name, "arguments": json.loads(c.arguments_json or "{}")} for c in complete.tool_calls
    ]
