"""The demo pair's model card is rendered from its two report.json files and the measured cost
table (benchmarks/results/pair_cost.json), not written by hand."""

from __future__ import annotations

from pathlib import Path

from kakeya.training import card

PAIR_COST = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "pair_cost.json"


def test_shipped_card_is_the_rendering_of_its_reports(demo_pair):
    root = demo_pair.target.parent
    assert (root / "README.md").read_text(encoding="utf-8") == card.render(root, PAIR_COST)
