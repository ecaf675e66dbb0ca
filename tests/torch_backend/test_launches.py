"""benchmarks/launches.py: what the host still launches around the static steps stays a handful.

A regression here means a CUDA graph no longer covers some per-call work (before the
drafter's extension moved into its step, a draft call launched 114 ops from Python), or that
the kernels inside the graph multiplied again (unfused norms: 4,420 per verify instead of 1,622)."""

from __future__ import annotations

import json


def test_static_steps_leave_only_copies_to_the_host(tmp_path, benchmark_script):
    mod = benchmark_script("launches")
    out = tmp_path / "launches.json"
    assert mod.main(["--ctx", "40", "--out", str(out)]) == 0
    counts = json.loads(out.read_text())["counts"]
    assert set(counts) == {
        "verify(1) + commit",
        "verify(8) + commit",
        "verify(16) + commit",
        "draft(8), 3 new context rows",
        "draft(16), 3 new context rows",
    }
    for name, c in counts.items():
        assert c["graphed"] > 100, name  # the model's work ran inside the step
        assert c["host"] <= 8, (name, c["host_ops"])  # staging copies and the one sync, nothing else
        assert not {"linear", "mul", "add", "index_copy_"} & set(c["host_ops"]), (name, c["host_ops"])
        # every RMSNorm is one fused kernel in bf16 too, not ~9 (cast, pow, mean, add, rsqrt, mul, ...)
        assert "rms_norm" in c["graphed_top"] and not {"rsqrt", "pow", "mean"} & set(c["graphed_top"]), name


def test_demo_pair_counts_and_block_cost_in_ar_steps(tmp_path, benchmark_script):
    mod = benchmark_script("launches")
    out = tmp_path / "launches_demo.json"
    assert mod.main(["--demo", "--ctx", "40", "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["dtype"] == "float32" and d["target"].startswith("embedded demo target")
    c = d["counts"]
    ar = c["verify(1) + commit"]["graphed"]
    for L in ("8", "16"):
        block = c[f"verify({L}) + commit"]["graphed"] + c[f"draft({L}), 3 new context rows"]["graphed"]
        assert d["block_cost_in_ar_steps"][L] == block / ar > 1
    assert all(r["host"] <= 8 for r in c.values())
