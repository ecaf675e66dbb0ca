"""benchmarks/draft_sources.py: the corpus lookup, and every source of candidates commits the target's tokens."""

from __future__ import annotations

import numpy as np


def test_corpus_lookup_continues_the_longest_suffix_seen_twice_by_majority(benchmark_script):
    mod = benchmark_script("draft_sources")
    corpus = np.array([7, 1, 2, 3, 5, 9, 8, 1, 2, 3, 5, 9, 4, 1, 2, 3, 6, 0, 8, 2, 3, 4])
    lookup = mod.CorpusLookup(corpus, min_match=2)
    # (1, 2, 3) ends three times, followed by 5, 5, 6: 5 wins, then 9 (both runs that are left), then they split
    assert lookup.propose([0, 1, 2, 3], 5) == (5, 9)
    # (8, 2, 3) occurs once, so the lookup falls back to (2, 3): 5 / 5 / 6 after it (its last occurrence is
    # too near the end for 3 tokens)
    assert lookup.propose([8, 2, 3], 3) == (5, 9)
    assert lookup.propose([4, 4], 3) == ()  # never seen
    assert lookup.propose([1, 2, 3], 0) == ()
    # a lookup that must trust 3 tokens or more does not answer from a 2-token match
    assert mod.CorpusLookup(corpus, min_match=3).propose([8, 2, 3], 3) == ()


def test_every_source_commits_the_targets_tokens_and_a_corpus_of_its_own_text_copies_well(demo_pair, benchmark_script):
    from kakeya.core.request import Request
    from kakeya.orchestrator.assembly import build_local_engine
    from kakeya.orchestrator.text import TextCodec

    mod = benchmark_script("draft_sources")
    codec = TextCodec(demo_pair.target)
    prompts = [codec.encode("def parse(self, text):\n    "), codec.encode("import os\nimport sys\n\n\nclass ")]
    engine = build_local_engine(str(demo_pair.target), str(demo_pair.draft), "torch", "cpu")
    refs = [engine.generate(Request(p, max_tokens=40, block_size=1, ignore_eos=True)).token_ids for p in prompts]
    # A corpus holding the target's own continuations (twice: a suffix must occur twice to be trusted)
    own = np.concatenate([np.asarray(p + r) for p, r in zip(prompts, refs)] * 2)
    got = mod.measure(prompts, [8], 40, own, corpus_min_match=(4,), pair=demo_pair)["8"]
    assert set(got) == {"drafter", "engine", "oracle", "corpus_4"}
    assert all(row["lossless_vs_block1"] for row in got.values())
    assert got["drafter"]["copied_share"] == 0.0  # copies off: the card's figure
    assert got["corpus_4"]["copied_share"] > got["engine"]["copied_share"]
    assert got["corpus_4"]["tokens_per_block"] > max(got["drafter"]["tokens_per_block"], 6.0)
