"""benchmarks/heap.py: two servers (glibc's defaults, the kept thresholds) take turns, each window counted."""

from __future__ import annotations

import json
import sys

import pytest


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and glibc's thresholds: Linux only")
def test_the_servers_take_turns_and_each_window_is_counted(tmp_path, benchmark_script):
    mod = benchmark_script("heap")
    out = tmp_path / "heap.json"
    args = ["--streams", "2", "--windows", "4", "--window-s", "1", "--max-tokens", "12", "--out", str(out)]
    assert mod.main(args) == 0
    got = json.loads(out.read_text())["results"]["2"]
    assert {name: len(rows) for name, rows in got["windows"].items()} == {"system": 2, "kept": 2}
    assert all(w["tok_s"] > 0 and w["faults_s"] >= 0 for rows in got["windows"].values() for w in rows)
    kept = [w["tok_s"] for w in got["windows"]["kept"]]
    assert got["kept"]["tok_s"] == pytest.approx(sum(kept) / 2)  # the median of two
    assert got["tok_s_ratio_pairs"] > 0
