"""The README's first-run line is one a benchmark run printed, not a figure typed by hand.

``benchmarks/first_request.py`` runs README command 1 in fresh processes and keeps each run's
summary line in ``benchmarks/results/first_request.json``; the README quotes one of them.
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def quoted_first_run_line(readme: str) -> str:
    """The line the Quick start shows under README command 1 (the one starting ``speculative (``)."""
    quick = readme[readme.index("## Quick start") :]
    quick = quick[: quick.index("\n## ", 1)]
    lines = [ln for ln in quick.splitlines() if ln.startswith("speculative (")]
    assert len(lines) == 1, "the Quick start quotes exactly one first-run line"
    return lines[0]


def test_readme_quotes_a_line_the_first_request_benchmark_printed():
    quoted = quoted_first_run_line((ROOT / "README.md").read_text(encoding="utf-8"))
    results = json.loads((ROOT / "benchmarks" / "results" / "first_request.json").read_text())
    printed = [ln for s in results["settings"].values() for ln in s["lines"]]
    assert quoted in printed, f"README quotes a line no run in first_request.json printed: {quoted}"


def test_the_check_notices_a_hand_typed_figure():
    readme = "## Quick start\n\n```\nspeculative (DFlash, block 8, torch/cpu): 999 tok/s\n```\n\n## Next\n"
    assert quoted_first_run_line(readme) == "speculative (DFlash, block 8, torch/cpu): 999 tok/s"
