"""The demo pair's model card is rendered from its two report.json files, not written by hand."""

from __future__ import annotations

from kakeya.training import card


def test_shipped_card_is_the_rendering_of_its_reports(demo_pair):
    root = demo_pair.target.parent
    assert (root / "README.md").read_text(encoding="utf-8") == card.render(root)
