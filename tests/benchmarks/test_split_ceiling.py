"""benchmarks/split.py's overlap ceiling: a colocated block against a verify plus one bare round trip."""

from __future__ import annotations


def test_ceiling_prices_a_block_as_one_verify_and_one_round_trip(benchmark_script):
    mod = benchmark_script("split")
    row = {
        "block_ms_median": {"colocated": 7.0},
        "verify_ms_median": {"colocated": 6.0, "split": 6.7},
    }
    got = mod.overlap_ceiling(row, 0.3)
    assert got["with_split_verify"] == round(7.0 / 7.0, 3) and got["with_colocated_verify"] == round(7.0 / 6.3, 3)
    assert got["colocated_block_ms"] == 7.0 and got["round_trip_ms"] == 0.3
    # the split's own verify is the slower one here, so its ceiling is the lower
    assert got["with_split_verify"] < got["with_colocated_verify"]
    assert (
        mod.overlap_ceiling(row | {"verify_ms_median": {"colocated": 0.0, "split": 0.0}}, 0.3)["with_split_verify"]
        == 0.0
    )
