"""The demo pair's model card is rendered from its two report.json files and the measured cost
table (benchmarks/results/pair_cost.json), not written by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from kakeya.training import card

PAIR_COST = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "pair_cost.json"


def test_shipped_card_is_the_rendering_of_its_reports(demo_pair):
    root = demo_pair.target.parent
    assert (root / "README.md").read_text(encoding="utf-8") == card.render(root, PAIR_COST)


def test_the_card_says_where_a_stage_trained():
    """The device the trainer resolved (its report's ``device``: a GPU's name on CUDA), not only the flag,
    which is empty when the trainer picked CUDA by itself; threads only on a CPU."""
    args = {"device": None, "threads": 2}
    assert card._where({"args": args, "device": "cuda (NVIDIA H100 80GB HBM3)"}) == "cuda (NVIDIA H100 80GB HBM3)"
    assert card._where({"args": args, "device": "cpu"}) == "cpu (2 threads)"
    assert card._where({"args": {"device": None, "threads": 0}}) == "cpu (all threads)"  # reports before the field
    assert card._where({"args": {"device": "cuda", "threads": 0}}) == "cuda"


def test_the_card_renders_every_stage_of_a_fine_tuned_drafter(demo_pair, tmp_path):
    """Stage k's report is ``draft/report_stagek.json``, the shipped weights' is ``report.json``: each
    stage gets its lines and its reproduce command, fine-tuned from the directory the one before wrote."""
    import json
    import shutil

    root = tmp_path / "pair"
    shutil.copytree(demo_pair.target.parent, root)
    stages = card._stages(root, json.loads((root / "draft" / "report.json").read_text()))
    n = len(stages)
    assert n >= 2 and all(s["args"].get("init_from") for s in stages[1:])
    text = card.render(root)
    for k in range(1, n + 1):
        assert f"- Stage {k} " in text
    assert f"--init-from OUT/draft-stage{n - 1} " in text and text.count("--out OUT/draft ") == 1
    (root / "draft" / "report_stage1.json").rename(root / "draft" / "kept_aside.json")
    with pytest.raises(FileNotFoundError, match="report_stage1.json"):
        card.render(root)
