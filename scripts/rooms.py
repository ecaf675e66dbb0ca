"""Draw services/' rooms (its folders) and the imports between them, as a Mermaid graph for the docs.

    python scripts/rooms.py                 # today's tree
    python scripts/rooms.py --rev fbafb14   # the tree of a commit (the orchestrator before its rooms)

A room is a folder of ``services/`` (a package of ``kakeya``); an arrow ``a --> b`` says some module of
``a`` imports one of ``b`` (function-level imports included, as ``tests/test_layering.py`` reads them);
each room is labelled with its module count. Arrows into ``core/`` are left out: every room imports the
contract, and drawing it would hide the rest. ``docs/design.md`` keeps the drawing of today's tree, and
``tests/test_layering.py`` checks it is still the code's.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parents[1]
LEFT_OUT = ("kakeya.models", "kakeya.wire.kakeya")  # weights and generated stubs: no code of ours


def parse(text: str) -> ast.Module:
    """``ast.parse``, tried again after CPython 3.11's ``SystemError: AST constructor recursion depth mismatch``: its
    AST state is shared by every thread, so a traceback another thread formats meanwhile (3.11 parses the failing
    line to place its carets) can trip it in a test process. The source itself is fine."""
    for _ in range(2):
        try:
            return ast.parse(text)
        except SystemError:
            continue
    return ast.parse(text)


def _sources(rev: str | None) -> dict[str, str]:
    """``services/`` path -> text, of the working tree or of commit ``rev``."""
    if rev is None:
        return {
            str(p.relative_to(ROOT)): p.read_text(encoding="utf-8")
            for p in sorted((ROOT / "services").rglob("*.py"))
            if "__pycache__" not in p.parts
        }
    names = subprocess.run(
        ["git", "ls-tree", "-r", "--name-only", rev, "--", "services"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    show = lambda n: subprocess.run(["git", "show", f"{rev}:{n}"], cwd=ROOT, capture_output=True, text=True).stdout
    return {n: show(n) for n in names if n.endswith(".py")}


def _module(path: str) -> str:
    parts = PurePosixPath(path).relative_to("services").with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    return ".".join(("kakeya",) + parts)


def import_graph(rev: str | None = None) -> tuple[dict[str, str], dict[str, set[str]]]:
    """Each module's path, and the ``kakeya`` modules it imports (function-level imports included), each
    resolved to the most specific module known: ``from pkg import mod`` imports the module, ``from mod import
    name`` the module itself. ``tests/test_layering.py`` reads the same graph."""
    sources = {_module(p): (p, t) for p, t in _sources(rev).items() if not p.endswith(("_pb2.py", "_pb2_grpc.py"))}
    known = set(sources)
    graph = {}
    for m, (p, text) in sources.items():
        pkg = m.split(".") if p.endswith("__init__.py") else m.split(".")[:-1]
        found = set()
        for node in ast.walk(parse(text)):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(pkg[: len(pkg) - (node.level - 1)] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            for t in targets:
                while t and t not in known:
                    t = t.rpartition(".")[0]
                found.add(t)
        graph[m] = found - {"", "kakeya", m}
    return {m: p for m, (p, _) in sources.items()}, graph


def rooms(rev: str | None = None) -> tuple[dict[str, int], set[tuple[str, str]]]:
    """Each room's module count (``__init__`` and generated files not counted) and the arrows between rooms."""
    paths, graph = import_graph(rev)
    room_of = {m: (m if p.endswith("__init__.py") else m.rpartition(".")[0]) for m, p in paths.items()}
    counts: dict[str, int] = {}
    for m, p in paths.items():
        counts.setdefault(room_of[m], 0)
        if not p.endswith("__init__.py"):
            counts[room_of[m]] += 1
    arrows = {(room_of[m], room_of[t]) for m, deps in graph.items() for t in deps if room_of[t] != room_of[m]}
    keep = lambda r: r != "kakeya" and not r.startswith(LEFT_OUT) and counts[r] > 0
    return {r: n for r, n in counts.items() if keep(r)}, {
        (a, b) for a, b in arrows if keep(a) and keep(b) and b != "kakeya.core"
    }


def mermaid(rev: str | None = None) -> str:
    counts, arrows = rooms(rev)
    node = lambda r: r.removeprefix("kakeya.").replace(".", "_")
    lines = ["graph LR"]
    lines += [f'  {node(r)}["{r.removeprefix("kakeya.").replace(".", "/")}/ ({n})"]' for r, n in sorted(counts.items())]
    lines += [f"  {node(a)} --> {node(b)}" for a, b in sorted(arrows)]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", default=None, help="a commit to draw instead of the working tree")
    print(mermaid(ap.parse_args(argv).rev), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
