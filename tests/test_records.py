"""Every figure the README and docs/ give as current was measured on the ``services/`` code HEAD holds.

The convention (docs/benchmarks.md, "How to read a figure"): a figure cites the results JSON it comes from
by name in backticks (`benchmarks/results/X.json`, or `X.json` for a file there). A section whose heading
says "History" (and everything under it, to the next heading of its level or above) holds history: figures
kept with the date or commit they measured, which no code here promises; so does a paragraph (or list
item) that opens with "**History", for a measurement told inside a section about design. Anywhere else a
cited JSON is a *current* figure: its ``record`` (``benchmarks/record.py``) must name the ``services/`` tree
HEAD has, from a clean tree. ``benchmarks/refresh.sh`` re-runs every current figure's JSON on the commit it is run on.
Commands in fenced code blocks (how to re-run something) cite nothing.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import record

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# `benchmarks/results/a/b.json`, `b.json`, `benchmarks/results/a_ab/` (a folder: each JSON in it)
CITATION = re.compile(r"`(?:benchmarks/results/)?([\w./-]+\.json|[\w-]+/)`|benchmarks/results/([\w./-]+\.json)")
HEADING = re.compile(r"^(#{1,6})\s+(.*)")
ITEM = re.compile(r"^\s*(?:[-*]|\d+\.)\s+")  # a list item's marker


@dataclass(frozen=True)
class Citation:
    doc: str
    line: int
    section: str
    name: str  # relative to benchmarks/results/
    history: bool


def citations(path: Path) -> list[Citation]:
    """Every results JSON ``path`` cites, with the section it sits in and whether that section is history."""
    out, stack, fenced = [], [], False  # stack: (level, heading) of the sections the line is in
    marked, previous = False, ""  # marked: the paragraph the line is in opens with **History
    for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        if m := HEADING.match(line):
            level = len(m.group(1))
            stack = [s for s in stack if s[0] < level] + [(level, m.group(2))]
            continue
        if not previous.strip() or ITEM.match(line):  # a paragraph or a list item starts here
            marked = ITEM.sub("", line).lstrip().startswith("**History")
        previous = line
        history = marked or any("history" in h.lower() for _, h in stack)
        section = stack[-1][1] if stack else ""
        for m in CITATION.finditer(line):
            name = m.group(1) or m.group(2)
            names = [name]
            if name.endswith("/"):
                if not (RESULTS / name).is_dir():
                    continue  # a folder of the repository, not of results
                names = [str(p.relative_to(RESULTS)) for p in sorted((RESULTS / name).rglob("*.json"))]
            elif not (RESULTS / name).is_file() and not m.group(0).lstrip("`").startswith("benchmarks/results/"):
                continue  # a bare name that is no result (config.json, report.json): not a results citation
            for n in names:
                out.append(Citation(str(path.relative_to(ROOT)), no, section, n, history))
    return out


def services_tree() -> str:
    """HEAD's ``services/`` as a result's record names it (``benchmarks/record.py``: Markdown left out)."""
    tree = record.code_tree()
    assert tree, "git ls-tree found no services/ at HEAD"
    return tree


def problem(c: Citation, head_tree: str) -> str | None:
    """Why citation ``c`` breaks the convention, or None."""
    path = RESULTS / c.name
    if not path.is_file():
        return "cites a results JSON that does not exist"
    if c.history:
        return None
    record = json.loads(path.read_text()).get("record") if path.suffix == ".json" else None
    if not record:
        return "a current figure from a JSON with no record (re-run it: benchmarks/refresh.sh; or move it to History)"
    if record.get("dirty"):
        return f"a current figure measured on uncommitted services/ code (commit {record.get('commit', '?')[:9]})"
    if record.get("services_tree") != head_tree:
        return (
            f"a current figure measured on other services/ code (commit {record.get('commit', '?')[:9]}): "
            "re-run benchmarks/refresh.sh, or move the figure to a History section"
        )
    return None


def problems(docs: list[Path], head_tree: str) -> list[str]:
    return [
        f"{c.doc}:{c.line} ({c.section!r}) {c.name}: {why}"
        for doc in docs
        for c in citations(doc)
        if (why := problem(c, head_tree))
    ]


def test_every_current_figure_was_measured_on_heads_services_tree():
    found = problems(DOCS, services_tree())
    assert not found, "figures that are not current:\n" + "\n".join(found)


def test_every_cited_result_exists_and_refresh_regenerates_every_current_one():
    """What the docs give as current is what benchmarks/refresh.sh writes; history cites files that exist."""
    script = (ROOT / "benchmarks" / "refresh.sh").read_text()
    current = {c.name for doc in DOCS for c in citations(doc) if not c.history}
    missing = sorted(n for n in current if f"benchmarks/results/{n}" not in script)
    assert not missing, f"current figures refresh.sh does not re-run: {missing}"
    absent = sorted({c.name for doc in DOCS for c in citations(doc) if not (RESULTS / c.name).is_file()})
    assert not absent, f"cited results that do not exist: {absent}"


def test_the_check_tells_current_from_history_and_stale_from_fresh(tmp_path):
    """A made-up doc: the same stale JSON passes under a History heading and fails outside it; a JSON whose
    record names HEAD's tree passes; a dirty one and one without a record fail; fenced commands cite nothing."""
    head = services_tree()
    fresh, stale, dirty, bare = "zz_fresh.json", "zz_stale.json", "zz_dirty.json", "zz_bare.json"
    files = {
        fresh: {"record": {"commit": "a" * 40, "services_tree": head, "dirty": False}},
        stale: {"record": {"commit": "b" * 40, "services_tree": "0" * 40, "dirty": False}},
        dirty: {"record": {"commit": "c" * 40, "services_tree": head, "dirty": True}},
        bare: {"tok_s": 1.0},
    }
    try:
        for name, body in files.items():
            (RESULTS / name).write_text(json.dumps(body))
        doc = tmp_path / "doc.md"
        doc.write_text(
            f"# Doc\n\nFast: 2x (`benchmarks/results/{fresh}`).\n\nOld: 1x (`{stale}`).\n\n"
            f"Dirty: (`{dirty}`). Bare: (`{bare}`).\n\n```\npython x.py --out benchmarks/results/{stale}\n```\n\n"
            f"## History: before the change\n\nOld: 1x (`{stale}`, `{bare}`).\n\n### Its detail\n\n(`{stale}`)\n\n"
            f"## Now\n\nAgain: (`{fresh}`)\n\n**History (2026-11-28).** It was 1x then (`{stale}`),\n"
            f"and (`{bare}`).\n\n* a design point\n* **History.** measured (`{stale}`)\n"
            f"  on two lines (`{bare}`)\n* a current point (`{fresh}`)\n"
        )
        global ROOT
        root, ROOT = ROOT, tmp_path  # citations() names the doc relative to ROOT
        try:
            got = problems([doc], head)
        finally:
            ROOT = root
        assert [g.split(" ", 1)[0] for g in got] == ["doc.md:5", "doc.md:7", "doc.md:7"], got
        assert "other services/ code" in got[0] and "uncommitted" in got[1] and "no record" in got[2]
        kinds = {(c.name, c.history) for c in citations_under(tmp_path, doc)}
        assert (stale, True) in kinds and (fresh, False) in kinds and (fresh, True) not in kinds
    finally:
        for name in files:
            (RESULTS / name).unlink(missing_ok=True)


def citations_under(root: Path, doc: Path) -> list[Citation]:
    global ROOT
    saved, ROOT = ROOT, root
    try:
        return citations(doc)
    finally:
        ROOT = saved


def test_results_name_paths_inside_the_repository_relative_to_its_root(tmp_path):
    """A result run in one worktree (``/work/main/...``) names its models and files as any checkout has them;
    a path elsewhere and an HTTP route stay as they are, and so does the command's."""
    demo = str(record.ROOT / "services" / "models" / "demo" / "target")
    out = record.write_result(
        tmp_path / "r.json",
        {"target": demo, "runs": [{"out": str(record.ROOT / "benchmarks" / "results" / "x.json")}],
         "scratch": str(tmp_path), "route": "/v1/models", "n": 3},
        record={"commit": "a" * 40},
    )  # fmt: skip
    got = json.loads(out.read_text())
    assert got["target"] == "services/models/demo/target" and got["runs"] == [{"out": "benchmarks/results/x.json"}]
    assert (got["scratch"], got["route"], got["n"]) == (str(tmp_path), "/v1/models", 3)
    command = record.provenance(
        [str(record.ROOT / "benchmarks" / "split.py"), "--target", demo, "--out", "/tmp/s.json"]
    )
    assert command["command"] == "python benchmarks/split.py --target services/models/demo/target --out /tmp/s.json"
