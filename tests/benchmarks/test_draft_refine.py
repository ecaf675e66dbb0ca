"""benchmarks/draft_refine.py: its one pass is the card's count, and showing the target's own prefix never loses it."""

from __future__ import annotations

import json

import numpy as np


def test_one_pass_is_the_cards_count_and_the_oracle_keeps_its_prefix(demo_pair, benchmark_script):
    import torch

    from kakeya.training import data
    from kakeya.training.block_trainer import BlockTrainer, TorchTarget, make_dataset
    from kakeya.training.drafter_eval import leading_right

    mod = benchmark_script("draft_refine")
    assert list(mod.leading(np.array([[1, 2, 3], [1, 9, 3], [0, 2, 3]]), np.array([1, 2, 3]))) == [3, 1, 0]
    cfg = json.loads((demo_pair.draft / "config.json").read_text())
    tids = cfg["dflash_config"]["target_layer_ids"]
    corpus = data.load_corpus(data.target_tokenizer(demo_pair.target))
    made = make_dataset(TorchTarget(demo_pair.target, torch.device("cpu")), corpus.heldout, 2, 16, 24, tids, 0, 2,
                        quiet=True, bos=True)  # fmt: skip
    trainer = BlockTrainer(cfg, demo_pair.target, 0, torch.device("cpu"))
    trainer.load_weights(demo_pair.draft)
    B = 8
    ways = mod.leading_by_way(trainer, made.seqs, made.aux, 16, B, confidence=0.5)
    card, _, _ = leading_right(trainer, made.seqs, made.aux.astype(np.float32), 16, B)
    assert ways["one_pass"].shape == card.shape == (2, 24 - B + 1)
    assert (ways["one_pass"] == card).all()
    # shown the target's tokens up to the first miss, the second pass keeps them right
    assert (ways["oracle_prefix"] >= np.minimum(ways["one_pass"], B - 2)).all()
    assert ((ways["two_pass"] >= 0) & (ways["two_pass"] <= B - 1)).all()
    got = mod.measure(trainer, made.seqs, made.aux, 16, B, 0.5)
    assert 1.0 <= got["one_pass"]["tokens_per_block"] <= B and got["one_pass"]["blocks"] >= 24 // B
