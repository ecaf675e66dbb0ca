"""benchmarks/mlx_blas.py times MLX's products on both BLAS, each in its own process, and says which ran."""

from __future__ import annotations

import json
import sys

import pytest

pytest.importorskip("mlx.core")


@pytest.mark.skipif(sys.platform != "linux", reason="the route exists on Linux only")
def test_both_blas_are_timed_and_named(tmp_path, benchmark_script):
    mod = benchmark_script("mlx_blas")
    mod.SHAPES = [("small", 64, 96)]
    mod.ROWS = (1, 8)
    out = tmp_path / "mb.json"
    assert mod.main(["--reps", "2", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["route"]["torch"] == "torch"
    assert "reference" in got["route"]["reference"]
    assert [(r["shape"], r["rows"]) for r in got["results"]] == [("small", 1), ("small", 8)]
    for r in got["results"]:
        assert all(v > 0 for v in r["us"].values())
        assert r["speedup"] == pytest.approx(r["us"]["reference"] / r["us"]["torch"])
