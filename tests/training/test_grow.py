"""Growing a trained drafter (``training/grow.py``, ``train-drafter --init-from`` with a larger shape):
the grown drafter computes what the small one did, so training starts where the small one is."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kakeya.app.train import drafter_arguments
from kakeya.core.contract import FULL
from kakeya.training import drafter as tdraft
from kakeya.training import grow
from kakeya.training.block_trainer import BlockTrainer

from .test_trainers import TINY_DRAFT, _args


def _bigger(cfg: dict, layers: int, intermediate: int) -> dict:
    return cfg | {"num_hidden_layers": layers, "layer_types": [FULL] * layers, "intermediate_size": intermediate}


def _logits(trainer: BlockTrainer, width: int) -> torch.Tensor:
    rng = np.random.default_rng(0)
    seqs = rng.integers(5, 200, size=(2, 40)).astype(np.int64)
    aux = rng.standard_normal((2, 40, width)).astype(np.float32)
    with torch.no_grad():
        return trainer.block_logits(seqs, aux, np.array([[10, 25], [7, 30]]), 8)[0]


def test_a_grown_drafter_computes_what_the_small_one_did(tiny_pair):
    small_cfg = json.loads((tiny_pair.draft / "config.json").read_text())
    small = BlockTrainer(small_cfg, tiny_pair.target, 0, torch.device("cpu"))
    small.load_weights(tiny_pair.draft)
    width = small.dcfg.aux_width
    for layers, intermediate in [
        (small_cfg["num_hidden_layers"] + 1, small_cfg["intermediate_size"]),
        (small_cfg["num_hidden_layers"], 2 * small_cfg["intermediate_size"]),
        (small_cfg["num_hidden_layers"] + 2, 3 * small_cfg["intermediate_size"]),
    ]:
        big_cfg = _bigger(small_cfg, layers, intermediate)
        assert grow.why_not(small_cfg, big_cfg) is None
        big = BlockTrainer(big_cfg, tiny_pair.target, 1, torch.device("cpu"))
        fresh = big.tensors()
        assert not torch.allclose(_logits(big, width), _logits(small, width), atol=1e-3)  # random: another function
        big.load_tensors(grow.grow(small.read_weights(tiny_pair.draft), fresh))
        torch.testing.assert_close(_logits(big, width), _logits(small, width), atol=2e-5, rtol=1e-5)
        # and it can learn: every weight the growth zeroed gets a gradient at once
        big.model.zero_grad()
        rng = np.random.default_rng(1)
        seqs, aux = (
            rng.integers(5, 200, size=(2, 40)).astype(np.int64),
            rng.standard_normal((2, 40, width)).astype(np.float32),
        )
        big.block_logits(seqs, aux, np.array([[10, 25], [7, 30]]), 8)[0].logsumexp(-1).sum().backward()
        zeroed = [n for n, p in big.model.named_parameters() if n.endswith(grow.ZEROED)]
        assert zeroed and all(big.model.get_parameter(n).grad.abs().sum() > 0 for n in zeroed)


def test_what_cannot_grow_is_refused_naming_why(tiny_pair):
    cfg = json.loads((tiny_pair.draft / "config.json").read_text())
    assert "never shrinks" in grow.why_not(cfg, cfg | {"intermediate_size": cfg["intermediate_size"] - 1})
    assert "hidden_size" in grow.why_not(cfg, cfg | {"hidden_size": 2 * cfg["hidden_size"]})
    assert "num_attention_heads" in grow.why_not(cfg, _bigger(cfg, 2, 64) | {"num_attention_heads": 7})
    with pytest.raises(ValueError, match="lacks"):
        grow.grow({"extra.weight": np.zeros(2)}, {})


def test_train_drafter_grows_its_init_from(tmp_path, tiny_pair):
    """``--init-from`` a 1-layer drafter with ``--layers 2 --intermediate 64`` writes (at 0 steps) a 2-layer
    drafter whose blocks are the 1-layer one's; a shape that cannot grow is refused naming ``--init-from``."""
    small, big = tmp_path / "small", tmp_path / "big"
    base = ["--target", str(tiny_pair.target)] + TINY_DRAFT
    tdraft.train(_args(drafter_arguments, base + ["--out", str(small), "--steps", "2", "--no-eval"]))
    tdraft.train(
        _args(
            drafter_arguments,
            base
            + [
                "--out",
                str(big),
                "--steps",
                "0",
                "--no-eval",
                "--init-from",
                str(small),
                "--layers",
                "2",
                "--intermediate",
                "64",
            ],
        )
    )
    cfgs = [json.loads((d / "config.json").read_text()) for d in (small, big)]
    assert (cfgs[1]["num_hidden_layers"], cfgs[1]["intermediate_size"]) == (2, 64)
    trainers = []
    for d, cfg in zip((small, big), cfgs):
        t = BlockTrainer(cfg, tiny_pair.target, 0, torch.device("cpu"))
        t.load_weights(d)
        trainers.append(t)
    torch.testing.assert_close(
        _logits(trainers[1], trainers[1].dcfg.aux_width),
        _logits(trainers[0], trainers[0].dcfg.aux_width),
        atol=2e-5,
        rtol=1e-5,
    )
    with pytest.raises(ValueError, match="init-from.*shrinks"):
        tdraft.train(
            _args(
                drafter_arguments,
                base
                + [
                    "--out",
                    str(tmp_path / "x"),
                    "--steps",
                    "0",
                    "--no-eval",
                    "--init-from",
                    str(big),
                    "--intermediate",
                    "32",
                ],
            )
        )
