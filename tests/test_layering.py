"""The layering holds: no import cycles, no lower layer reaching up, no module too big to read.

The graph is drawn from the source (every ``import``, function-level ones
included, because a newcomer reading the code sees those too), so a cycle
fails here before it can bite at run time.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "services"  # installed under the import name ``kakeya`` (pyproject.toml)
MAX_LINES = 500  # "no module over 500 lines"

UPPER = ("kakeya.verifier", "kakeya.drafter", "kakeya.orchestrator", "kakeya.training", "kakeya.app")
# package -> packages it must never import (directly or through a function-level import)
FORBIDDEN = {
    "kakeya.core": ("kakeya.",),
    "kakeya.backends": ("kakeya.runtime", "kakeya.wire", "kakeya.checkpoints") + UPPER,
    "kakeya.wire": ("kakeya.runtime", "kakeya.checkpoints") + UPPER,  # the codec converts backends' arrays
    "kakeya.checkpoints": ("kakeya.runtime", "kakeya.wire", "kakeya.backends") + UPPER,
    "kakeya.runtime": ("kakeya.backends",) + UPPER,
    "kakeya.verifier": ("kakeya.orchestrator", "kakeya.drafter", "kakeya.training", "kakeya.app"),
    "kakeya.drafter": ("kakeya.orchestrator", "kakeya.verifier", "kakeya.training", "kakeya.app"),
    "kakeya.orchestrator": ("kakeya.training", "kakeya.app"),
    "kakeya.training": ("kakeya.app",),
}


def _name(path: Path) -> str:
    parts = path.relative_to(SOURCE).with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    return ".".join(("kakeya",) + parts)


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(SOURCE.rglob("*.py")):
        if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue
        out[_name(path)] = path
    return out


def _rooms_script():
    """``scripts/rooms.py``, which draws the rooms from the same import graph these tests read."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("rooms", ROOT / "scripts" / "rooms.py")
    rooms = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rooms)
    return rooms


def _graph() -> dict[str, set[str]]:
    """Every module of ``kakeya`` and the ``kakeya`` modules it imports (function-level imports included)."""
    return _rooms_script().import_graph()[1]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_lower_layers_never_reach_up():
    bad = []
    for mod, deps in _graph().items():
        for pkg, banned in FORBIDDEN.items():
            if mod == pkg or mod.startswith(pkg + "."):
                bad += [f"{mod} -> {d}" for d in deps if d.startswith(banned) and not d.startswith(pkg)]
    assert bad == []


def test_the_contract_is_imported_by_every_service_package():
    users = {m.split(".")[1] for m, deps in _graph().items() if "kakeya.core.contract" in deps}
    assert {"orchestrator", "verifier", "drafter", "wire"} <= users


def test_no_module_is_too_long_to_read():
    long = {n: len(p.read_text().splitlines()) for n, p in _modules().items()}
    assert {n: k for n, k in long.items() if k > MAX_LINES} == {}


def test_every_source_folder_is_a_package_in_pyproject():
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {
        _name(d / "__init__.py") for d in [SOURCE, *SOURCE.rglob("*")] if d.is_dir() and "__pycache__" not in d.parts
    }
    assert listed == folders


BACKEND_PACKAGES = {  # where a backend's own package may be imported
    "torch": ("kakeya.backends.torch", "kakeya.verifier.torch_backend", "kakeya.drafter.torch_backend"),
    "mlx": ("kakeya.backends.mlx", "kakeya.verifier.mlx_backend", "kakeya.drafter.mlx_backend"),
}
THIRD_PARTY = {"torch": ("torch", "triton"), "mlx": ("mlx", "mlx_lm")}
TRAINERS = "kakeya.training"  # the trainers drive both backends' own training APIs (and transformers)


def _third_party(path: Path) -> set[str]:
    """Top-level names of everything ``path`` imports (module level and inside functions)."""
    found = set()
    for node in ast.walk(_rooms_script().parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_nothing_backend_neutral_imports_torch_or_mlx():
    bad = []
    for mod, path in _modules().items():
        if mod.startswith(TRAINERS):
            continue
        for backend, packages in THIRD_PARTY.items():
            if mod.startswith(BACKEND_PACKAGES[backend]):
                continue
            bad += [f"{mod} imports {name}" for name in sorted(_third_party(path) & set(packages))]
    assert bad == []


def test_services_holds_only_folders_and_the_package_face():
    loose = sorted(p.name for p in SOURCE.glob("*.py") if p.name != "__init__.py")
    assert loose == []


MAX_MODULES = 12  # a folder a newcomer takes in at a glance; more, and it wants rooms of its own


def test_no_folder_holds_more_than_twelve_modules():
    crowded = {}
    for d in [SOURCE, *SOURCE.rglob("*")]:
        if d.is_dir() and "__pycache__" not in d.parts and "models" not in d.relative_to(SOURCE).parts:
            mods = list(d.glob("*.py"))  # every module counts: ``__init__.py`` and protoc's stubs too
            if len(mods) > MAX_MODULES:
                crowded[str(d.relative_to(SOURCE))] = len(mods)
    assert crowded == {}


def test_the_rooms_drawing_in_the_design_doc_is_the_codes():
    """docs/design.md draws the rooms and their imports (``scripts/rooms.py``); a move or a new import
    between rooms redraws it (run the script and paste its output)."""
    rooms = _rooms_script()
    doc = (ROOT / "docs" / "design.md").read_text()
    drawn = doc.split("```mermaid\n")[1].split("```")[0]
    assert drawn == rooms.mermaid(), "docs/design.md's rooms drawing is stale: python scripts/rooms.py"
