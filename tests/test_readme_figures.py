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


def printed_lines() -> list[str]:
    """Every summary line a run in ``benchmarks/results/first_request.json`` printed."""
    results = json.loads((ROOT / "benchmarks" / "results" / "first_request.json").read_text())
    return [ln for s in results["settings"].values() for ln in s["lines"]]


def unprinted_quote(readme: str, printed: list[str]) -> str | None:
    """The README's first-run line if no benchmark run printed it (a figure typed by hand), else None."""
    quoted = quoted_first_run_line(readme)
    return None if quoted in printed else quoted


def test_readme_quotes_a_line_the_first_request_benchmark_printed():
    quoted = unprinted_quote((ROOT / "README.md").read_text(encoding="utf-8"), printed_lines())
    assert quoted is None, f"README quotes a line no run in first_request.json printed: {quoted}"


def test_the_check_notices_a_hand_typed_figure():
    """A README whose line is a printed one with one figure changed by hand is refused; the line itself passes."""
    printed = printed_lines()
    real = printed[0]
    typed = real.replace(" tok/s", "0 tok/s", 1)  # its first speed gains a digit
    assert typed != real
    readme = "## Quick start\n\n```\n{}\n```\n\n## Next\n"
    assert unprinted_quote(readme.format(typed), printed) == typed
    assert unprinted_quote(readme.format(real), printed) is None
