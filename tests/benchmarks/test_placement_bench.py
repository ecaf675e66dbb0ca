"""benchmarks/placement.py: split.py runs pinned and unpinned, reduced to medians per placement and auto / off."""

from __future__ import annotations


def split_run(placement, wire, tok_s, ratio, aggregate, identical=True):
    """The parts of a split.py result the placement benchmark reads (block 8 and auto, 1 and 16 streams)."""
    row = lambda b, w: {
        "block_size": b,
        "output_identical": identical,
        "decode_tok_s_median": {"split": tok_s},
        "over_colocated": {"split": ratio},
        "critical_path_ms_median": {"split": {"wire": w}},
    }
    return {"placement": placement, "one_stream": [row(8, wire), row(0, wire + 0.1)],
            "streams": [{"streams": 1, "split": {"aggregate_tok_s": tok_s, "mismatched": 0}},
                        {"streams": 16, "split": {"aggregate_tok_s": aggregate, "mismatched": 0}}]}  # fmt: skip


def test_runs_reduce_to_medians_per_placement_and_their_ratio(benchmark_script):
    mod = benchmark_script("placement")
    runs = []
    for asked, wire, agg in (
        ("off", 1.2, 1000),
        ("auto", 0.8, 1300),
        ("off", 1.4, 1100),
        ("auto", 0.9, 1200),
        ("off", 1.3, 900),
    ):
        runs.append(
            {"asked": asked} | mod.figures(split_run({} if asked == "off" else {"verifier": "0"}, wire, 300, 0.8, agg))
        )
    assert set(runs[0]["block"]) == {"8", "auto"} and set(runs[0]["streams"]) == {"1", "16"}
    m = mod.medians(runs)
    assert m["off"]["block"]["8"]["wire_ms"] == 1.3 and m["auto"]["block"]["8"]["wire_ms"] == 0.85
    assert m["off"]["block"]["auto"]["wire_ms"] == 1.4  # each block size its own figures
    assert m["off"]["streams"]["16"] == 1000 and m["auto"]["streams"]["16"] == 1250
    assert m["auto_over_off"]["block"]["8"]["wire_ms"] == round(0.85 / 1.3, 3)
    assert m["auto_over_off"]["streams"]["16"] == 1.25 and m["auto_over_off"]["streams"]["1"] == 1.0
