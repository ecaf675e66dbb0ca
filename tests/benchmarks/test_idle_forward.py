"""benchmarks/idle_forward.py: one verify timed back to back, after a gap asleep and after a gap spinning."""

from __future__ import annotations

import json


def test_each_way_is_timed_per_gap(tmp_path, benchmark_script):
    mod = benchmark_script("idle_forward")
    out = tmp_path / "idle.json"
    argv = ["--gap-ms", "1", "--rounds", "1", "--sessions", "1", "--steps", "3", "--out", str(out)]
    assert mod.main(argv) == 0
    got = json.loads(out.read_text())["gaps"]["1"]
    med = got["verify_ms_median"]
    assert set(med) == {"back_to_back", "asleep", "spinning"} and all(v > 0 for v in med.values())
    assert got["verifies"] == 3
    assert got["asleep_over_back_to_back"] == round(med["asleep"] / med["back_to_back"], 3)
