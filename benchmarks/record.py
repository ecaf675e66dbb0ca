"""Every results JSON says what it measured: the commit, whether the tree was dirty, when, where and how.

    from record import write_result          # benchmarks/ is on sys.path when a script runs from it
    write_result(path, result)               # result gains a "record" block, the file is written

The ``record`` block is what ``tests/test_records.py`` reads to tell a *current* figure (measured on the
``services/`` tree HEAD has) from a stale one: ``commit`` (``git rev-parse HEAD`` when the run started),
``services_tree`` (:func:`code_tree`: a digest of what runs under ``services/`` at that commit, its Markdown
left out, so re-rendering a model card from a result does not make that result stale), ``dirty``
(uncommitted changes to those files when the run started: then the figure measured code no commit holds), ``date`` (UTC),
``machine`` (host, CPU count, platform, Python) and ``command`` (the command line that re-runs it).

Paths inside the repository are written relative to its root (:func:`repo_relative`), in the result and in
the command alike: a result read in another checkout names the model and the file it measured, not the
worktree that happened to run it (``/work/main/services/models/demo/target`` -> ``services/models/demo/target``).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str:
    res = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    return res.stdout.strip() if res.returncode == 0 else ""


def code_tree(rev: str = "HEAD") -> str:
    """A digest of the files under ``services/`` at ``rev`` that can change a measurement: all but ``*.md``."""
    listing = _git("ls-tree", "-r", rev, "--", "services")
    kept = "\n".join(line for line in listing.splitlines() if not line.endswith(".md"))
    return hashlib.sha1(kept.encode()).hexdigest() if kept else ""


def _dirty() -> bool:
    changed = _git("status", "--porcelain", "--", "services").splitlines()
    return any(not line.rstrip().endswith(".md") for line in changed)


def repo_relative(value):
    """``value`` (a JSON-able tree) with each string that is an absolute path inside the repository made
    relative to its root; every other value as it is (a path elsewhere, an HTTP route such as ``/v1/models``)."""
    if isinstance(value, dict):
        return {k: repo_relative(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [repo_relative(v) for v in value]
    if isinstance(value, str) and os.path.isabs(value):
        for path in (Path(value), Path(value).resolve()):  # as written, then through any link
            if path.is_relative_to(ROOT):
                return path.relative_to(ROOT).as_posix()
    return value


def provenance(argv: list[str] | None = None) -> dict:
    """The record of this run: call it when the run starts (a commit made during a long run is not what ran)."""
    argv = sys.argv if argv is None else argv
    script = Path(argv[0])
    try:  # the command as a person re-runs it from the repository root
        script = script.resolve().relative_to(ROOT)
    except ValueError:
        pass
    return {
        "commit": _git("rev-parse", "HEAD"),
        "services_tree": code_tree(),
        "dirty": _dirty(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": {
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "command": shlex.join(["python", str(script), *repo_relative(argv[1:])]),
    }


_STARTED = provenance()  # taken at import, i.e. when the benchmark started


def write_result(path: Path | str, result: dict, record: dict | None = None) -> Path:
    """Write ``result`` as JSON at ``path`` with its ``record`` (this run's, taken when it started)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    out = {"record": record or _STARTED, **repo_relative({k: v for k, v in result.items() if k != "record"})}
    path.write_text(json.dumps(out, indent=1) + "\n")
    return path
