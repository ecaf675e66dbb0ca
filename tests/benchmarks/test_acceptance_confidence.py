"""benchmarks/acceptance_confidence.py on the demo pair: every block binned once, and transformers reads the
engine's tokens as its own argmax."""

from __future__ import annotations


def test_blocks_are_binned_by_the_targets_confidence(demo_pair, benchmark_script):
    from kakeya.orchestrator.text import TextCodec

    mod = benchmark_script("acceptance_confidence")
    codec = TextCodec(demo_pair.target)
    prompts = [codec.encode("def parse(self, text):\n    "), codec.encode("import os\nimport sys\n\n\nclass ")]
    got = mod.measure(demo_pair, prompts, block_size=4, max_tokens=40)
    assert got["reference_argmax_agrees"] == 1.0  # transformers' target picks what the engine committed
    for key in ("by_mean_confidence", "by_first_confidence"):
        bins = got[key]
        assert sum(b["blocks"] for b in bins) == got["blocks"] > 0  # each block in exactly one bin
        assert abs(sum(b["share_of_blocks"] for b in bins) - 1) < 1e-3
        assert all(1 <= b["tokens_per_block"] <= 4 for b in bins if b["blocks"])
    mean = sum(b["tokens_per_block"] * b["blocks"] for b in got["by_mean_confidence"] if b["blocks"]) / got["blocks"]
    assert abs(mean - got["tokens_per_block"]) < 1e-2
