"""The shipped demo pair: it is the no-flag default, it is lossless, and its drafter accepts something."""

from __future__ import annotations

import json

from kakeya.checkpoints.tiny import embedded_pair

PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    parser = "


def test_demo_pair_is_the_no_flag_default(demo_pair):
    assert embedded_pair() == demo_pair
    from kakeya.orchestrator.assembly import build_local_engine

    engine = build_local_engine(None, None)
    assert engine.target == str(demo_pair.target) and engine.draft == str(demo_pair.draft)


def test_demo_pair_is_small_and_documented(demo_pair):
    root = demo_pair.target.parent
    size = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    assert size <= 40 * 2**20
    assert (root / "README.md").is_file()
    cfg = json.loads((demo_pair.target / "config.json").read_text())
    assert {"sliding_attention", "full_attention"} <= set(cfg["layer_types"])


def test_demo_pair_greedy_speculative_equals_mlx_lm_ar_and_accepts(demo_pair):
    from kakeya.orchestrator.assembly import build_local_engine
    from kakeya.orchestrator.decode.engine import Request
    from kakeya.verifier.mlx_backend.reference import greedy_reference

    engine = build_local_engine(str(demo_pair.target), str(demo_pair.draft))
    ids = engine.codec.encode(PROMPT)
    window = json.loads((demo_pair.target / "config.json").read_text())["sliding_window"]
    n = window + 48  # the sliding ring wraps during generation
    gen = engine.generate(Request(ids, max_tokens=n, block_size=8, ignore_eos=True))
    ref, _, _ = greedy_reference(engine.verifier.target.model, ids, n)
    assert gen.token_ids == ref
    assert gen.mean_acceptance > 1.0, gen.acceptance_lengths


def test_heldout_replay_predicts_the_engines_blocks(demo_pair):
    """train-drafter's held-out acceptance replays the loop: teacher-forced candidates at every anchor
    (target-greedy labels, the target's aux) give the same blocks as the real engine, block for block."""
    import numpy as np
    import torch

    from kakeya.orchestrator.assembly import build_local_engine
    from kakeya.orchestrator.decode.engine import Request
    from kakeya.training.block_trainer import BlockTrainer, TorchTarget
    from kakeya.training.drafter_eval import leading_right, replay

    engine = build_local_engine(str(demo_pair.target), str(demo_pair.draft), ngram=False)  # the drafter alone
    cfg = json.loads((demo_pair.draft / "config.json").read_text())
    trainer = BlockTrainer(cfg, demo_pair.target, 0, torch.device("cpu"))
    trainer.load_weights(demo_pair.draft)
    texts = [PROMPT, "class Parser:\n    def __init__(self, text):\n        self.text = "]
    P = 16
    prompts = np.array([engine.codec.encode(t)[:P] for t in texts])
    target = TorchTarget(demo_pair.target, torch.device("cpu"))
    n_new, B = 48, 8
    seqs = target.continue_(prompts, n_new, 0.0)
    lead, _, _ = leading_right(
        trainer, seqs, target.hidden_states(seqs, cfg["dflash_config"]["target_layer_ids"])[0], P, B
    )
    total = 0
    for p, s, row in zip(prompts, seqs, lead):
        g = engine.generate(Request(p.tolist(), max_tokens=n_new, block_size=B, ignore_eos=True))
        assert g.token_ids == s[P:].tolist()  # transformers' greedy == ours
        walk = replay(row)
        assert g.acceptance_lengths[: len(walk)] == walk
        total += sum(walk)
    assert total > 2 * len(prompts) * 8  # several blocks replayed, not a trivial prefix


# The card's 32 held-out prompts at block 8 (2026-12-06, this code: the 32 reproduce the card's 3.0858 exactly)
# commit 127 tokens in 17-69 blocks each, so a few prompts swing the pooled figure far: drawing 8 of the 32
# with replacement 2000 times (drafter_eval.bootstrap_interval, size 8) puts 99 % of 8-prompt figures within
# 0.76-1.44x the 32-prompt one (2.34-4.46). Every 4th prompt (8 of them) measured 2.80.
HELD_OUT_SAMPLE, LOW, HIGH = 8, 0.75, 1.45


def test_demo_drafters_held_out_acceptance_is_its_cards(demo_pair):
    """The drafter alone (no n-gram copies), greedy, block 8, on every 4th of the card's held-out prompts:
    tokens per block within the sample's spread of the figure its model card shows (report.json renders it)."""
    import re

    from kakeya.training import data, drafter_eval

    report = json.loads((demo_pair.draft / "report.json").read_text())["acceptance"]
    card_figure = report["per_block_size"]["8"]["mean_acceptance"]
    card = (demo_pair.target.parent / "README.md").read_text()
    assert re.search(rf"^\| 8 \| {card_figure:.2f} \|", card, re.MULTILINE), (
        "the card shows report.json's block-8 figure"
    )
    corpus = data.load_corpus(data.target_tokenizer(demo_pair.target))
    prompts = drafter_eval.heldout_prompts(corpus, report["prompts"], report["prompt_len"])  # the card's prompts
    engine = drafter_eval._engine(demo_pair.target, demo_pair.draft, "torch")
    sample = prompts[:: report["prompts"] // HELD_OUT_SAMPLE]
    gens = drafter_eval.greedy_runs(engine, sample, 8, report["max_tokens"])
    got = drafter_eval.pooled(drafter_eval.block_counts(gens))
    assert LOW * card_figure <= got <= HIGH * card_figure, (got, card_figure)
