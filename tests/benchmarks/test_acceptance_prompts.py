"""benchmarks/acceptance_prompts.py: the pooled count, its bootstrap interval, and one pair measured end to end."""

from __future__ import annotations

import argparse
from pathlib import Path


def test_pooled_counts_every_block_and_the_interval_brackets_it(benchmark_script):
    mod = benchmark_script("acceptance_prompts")
    per = [(10, 30), (5, 25), (20, 40), (8, 24)]  # (blocks, tokens) per prompt
    assert mod.pooled(per) == 119 / 43  # not the mean of the per-prompt means
    lo, hi = mod.bootstrap_interval(per)
    assert lo < mod.pooled(per) < hi and (lo, hi) == mod.bootstrap_interval(per)  # seeded: the same twice
    lo1, hi1 = mod.bootstrap_interval(per * 8)
    assert hi1 - lo1 < hi - lo  # more prompts, a narrower interval
    lo32, hi32 = mod.bootstrap_interval(per * 8, size=4)  # as few prompts as before: as wide again
    assert hi32 - lo32 > hi1 - lo1
    assert mod.pooled([(7, 7)] * 3) == 1.0 and mod.bootstrap_interval([(7, 7)] * 3) == (1.0, 1.0)


def test_a_pair_is_measured_on_both_splits(tiny_pair, benchmark_script):
    mod = benchmark_script("acceptance_prompts")
    args = argparse.Namespace(splits=["heldout", "train"], prompts=3, prompt_len=16, max_tokens=12, block_sizes=[4])
    row = mod.run_pair("tiny", Path(tiny_pair.target), Path(tiny_pair.draft), args)
    for split in ("heldout", "train"):
        got = row["splits"][split]["4"]
        assert len(got["per_prompt"]) == 3 and got["blocks"] == sum(b for b, _ in got["per_prompt"])
        assert all(b <= t <= 4 * b for b, t in got["per_prompt"])  # each block commits 1..4 tokens
        lo, hi = got["interval_90"]
        assert lo <= got["tokens_per_block"] <= hi
