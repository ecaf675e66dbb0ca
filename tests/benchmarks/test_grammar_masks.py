"""benchmarks/grammar_masks.py: both libraries replay every case's valid output and are timed."""

from __future__ import annotations

import json


def test_both_libraries_replay_every_case(tmp_path, benchmark_script):
    mod = benchmark_script("grammar_masks")
    out = tmp_path / "gm.json"
    assert mod.main(["--repeats", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    for lib in ("llguidance", "xgrammar"):
        assert set(result[lib]) == set(mod.OUTPUTS), lib  # each replay consumed every token (asserted inside)
        assert all(v["us_per_token"] > 0 for v in result[lib].values())
