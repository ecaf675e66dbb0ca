"""benchmarks/small_gemm.py: every spelling of a few-row linear computes what F.linear computes."""

from __future__ import annotations

import json


def test_every_variant_is_right_and_timed(tmp_path, benchmark_script):
    mod = benchmark_script("small_gemm")
    mod.SHAPES = {"float32": [("demo gate_up", 128, 768)], "bfloat16": [("wide", 512, 256)]}
    out = tmp_path / "sg.json"
    assert mod.main(["--device", "cpu", "--reps", "2", "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert len(results) == 2 * len(mod.ROWS)
    for r in results:
        assert set(r["us"]) == {"linear", "matmul_wT", "w_matmul_xT", "per_row_mv"}
        assert all(isinstance(v, float) and v > 0 for v in r["us"].values()), r  # none "wrong result"
        assert r["fastest"] in r["us"]
