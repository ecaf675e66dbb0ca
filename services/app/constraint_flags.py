"""The constrained-output flags of `kakeya generate` and `kakeya client generate` (one of them at a time):
``--json-schema FILE|JSON``, ``--json-object``, ``--regex RE``, ``--choice TEXT`` (repeated) and
``--grammar FILE|LARK``, read into one :class:`~kakeya.core.constraints.Constraint`."""

from __future__ import annotations

from pathlib import Path

FLAGS = {"json_schema": "--json-schema", "json_object": "--json-object", "regex": "--regex", "choice": "--choice",
         "grammar": "--grammar"}  # fmt: skip


def add_constraint_options(p) -> None:
    g = p.add_argument_group("constrained output (every token is one the grammar allows; see docs/structured.md)")
    x = g.add_mutually_exclusive_group()
    x.add_argument("--json-schema", metavar="FILE|JSON", help="the output is JSON valid under this schema")
    x.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    x.add_argument("--regex", metavar="RE", help="the output matches this regular expression (whole)")
    x.add_argument("--choice", action="append", metavar="TEXT", help="the output is one of these (repeat the flag)")
    x.add_argument("--grammar", metavar="FILE|LARK", help="the output follows this Lark grammar")


def text_or_file(value: str) -> str:
    """A flag's value, or the contents of the file it names (a value that is a path to an existing file)."""
    try:
        path = Path(value)
        if len(value) < 4096 and "\n" not in value and path.is_file():
            return path.read_text(encoding="utf-8")
    except OSError:
        pass
    return value


def constraint_from_args(args):
    """The Constraint the flags ask for (None: none); the field names for a refusal of it."""
    from kakeya.core.constraints import Constraint

    if getattr(args, "json_schema", None) is not None:
        c = Constraint("json_schema", text_or_file(args.json_schema))
    elif getattr(args, "json_object", False):
        c = Constraint("json_object")
    elif getattr(args, "regex", None) is not None:
        c = Constraint("regex", args.regex)
    elif getattr(args, "choice", None):
        c = Constraint("choice", tuple(args.choice))
    elif getattr(args, "grammar", None) is not None:
        c = Constraint("grammar", text_or_file(args.grammar))
    else:
        return None, {}
    flag = FLAGS[c.kind]
    return c, {"constraint": flag, "constraint.spec": flag, "constraint.kind": flag}
