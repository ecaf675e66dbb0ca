"""benchmarks/predraft.py on the demo pair: every setting commits the same tokens; rejections' pre-drafts get used."""

from __future__ import annotations

import json


def test_predrafts_are_counted_per_setting_with_the_same_tokens(tmp_path, demo_pair, benchmark_script):
    mod = benchmark_script("predraft")
    out = tmp_path / "predraft.json"
    argv = ["--target", str(demo_pair.target), "--draft", str(demo_pair.draft), "--prompts", "2", "--max-tokens", "48",
            "--block-sizes", "4", "--alternatives", "0", "2", "--out", str(out)]  # fmt: skip
    assert mod.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["all_outputs_identical"]
    row = result["results"]["held_out"]["4"]
    assert row["none"]["hit_rate"] is None and row["none"]["predrafts_started"] == 0
    # prepared for rejections too, more pre-drafts are used than for the full acceptance alone
    assert row["alternatives_2"]["hit_rate"] > row["alternatives_0"]["hit_rate"]
    assert row["alternatives_2"]["tokens_per_used_block"] >= 1
