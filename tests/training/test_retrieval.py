"""Synthetic recall text (``train-target --retrieval-frac``) and targets whose every layer slides."""

from __future__ import annotations

import argparse
import itertools
import re

import numpy as np
import pytest

from kakeya.app.tools import target_arguments
from kakeya.checkpoints import tiny
from kakeya.checkpoints import tokenizer as tk
from kakeya.orchestrator.niah import QUESTION
from kakeya.training import common, retrieval
from kakeya.training import target as ttarget
from tests.training.test_trainers import TINY_TARGET


def _args(argv):
    p = argparse.ArgumentParser()
    target_arguments(p)
    return p.parse_args(argv)


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tiny.DEMO_DIR / "target" / "tokenizer.json"))


def test_windows_plant_a_needle_and_ask_for_it(tokenizer):
    text = retrieval.RetrievalText(tokenizer, 257, max_bytes=200_000)
    w, answers = text.windows(4, seed=0, step=3)
    assert w.shape == answers.shape == (4, 257) and w.dtype == np.int32 and answers.dtype == bool
    assert np.array_equal(w, text.windows(4, seed=0, step=3)[0])  # a function of (seed, step)
    assert not np.array_equal(w, text.windows(4, seed=0, step=4)[0])
    # the mask marks exactly the answers: " NNNN." and its newline after each question
    marked = [tokenizer.decode(list(row[m]), skip_special_tokens=False) for row, m in zip(w, answers)]
    assert all(re.fullmatch(r"( \d{4}\.\n)*( \d{0,4}\.?)?", text) for text in marked)
    answered = 0
    for row in w:
        assert row[0] == tk.BOS_ID  # each window starts an example, as a niah prompt starts
        for example in tokenizer.decode(list(row), skip_special_tokens=False).split("<bos>")[1:]:
            planted = re.findall(r"^The secret code is (\d{4})\.$", example, re.MULTILINE)
            assert len(planted) <= 1  # one needle per example: the answer can only come from it
            asked = re.search(re.escape(QUESTION) + r" (\d{4})\.\n", example)
            if asked:
                answered += 1
                assert planted == [asked.group(1)]
    assert answered >= 4
    assert sum(len(re.findall(r" \d{4}\.\n", t)) for t in marked) >= answered


def test_examples_keep_to_their_cap(tokenizer):
    """--retrieval-max-example: every example (from one <bos> to the next) within the cap, so an all-sliding
    target sees its needles within its window."""
    text = retrieval.RetrievalText(tokenizer, 257, max_bytes=200_000, max_example=80)
    w, _ = text.windows(4, seed=1, step=0)
    for row in w:
        starts = [i for i, t in enumerate(row) if t == tk.BOS_ID] + [len(row)]
        assert len(starts) >= 4
        assert (
            max(b - a for a, b in itertools.pairwise(starts)) <= 80 + 12
        )  # the budget counts words, not tokens exactly


def test_train_target_mixes_recall_rows_in(tmp_path):
    argv = ["--out", str(tmp_path / "t"), "--steps", "1", "--backend", "torch", "--retrieval-frac", "0.5"]
    with pytest.raises(ValueError, match="--seq-len"):  # 32 tokens hold no needle, question and answer
        ttarget.train(_args(argv + TINY_TARGET))
    rep = ttarget.train(_args(argv + TINY_TARGET + ["--seq-len", "96", "--answer-weight", "10"]))
    assert rep["retrieval"]["rows_per_batch"] == 1 and rep["retrieval"]["hay_lines"] > 0
    assert rep["retrieval"]["answer_weight"] == 10
    with pytest.raises(ValueError, match="--answer-weight"):
        ttarget.train(_args(argv + TINY_TARGET + ["--seq-len", "96", "--answer-weight", "0"]))
    with pytest.raises(ValueError, match="--retrieval-frac"):
        ttarget.train(_args(["--out", str(tmp_path / "u"), "--retrieval-frac", "1.5"] + TINY_TARGET))


def test_a_target_whose_every_layer_slides_trains_as_the_verifier_runs_it():
    """transformers forces a Gemma-4's last layer full; hf_text_config keeps the config's layer types, so
    the torch trainer's model is the one mlx-lm (the MLX verifier's model code) builds from config.json."""
    import mlx.core as mx
    import torch
    from mlx_lm.models.gemma4_text import Model, ModelArgs
    from transformers import Gemma4ForCausalLM

    cfg = ttarget.build_config(_args(["--out", "x", "--pattern", "s"] + TINY_TARGET))
    assert set(cfg["layer_types"]) == {"sliding_attention"}
    conf = common.hf_text_config(cfg)
    conf._attn_implementation = "eager"
    assert conf.layer_types == cfg["layer_types"]
    model = Gemma4ForCausalLM(conf).eval()
    w = tiny.target_weights(cfg, 0)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in w.items()}, strict=True)
    ref = Model(ModelArgs.from_dict(cfg))
    ref.load_weights([(k, mx.array(v)) for k, v in w.items()], strict=True)
    ids = np.random.default_rng(0).integers(5, cfg["vocab_size"], size=(1, 3 * cfg["sliding_window"]))
    with torch.no_grad():
        got = model(torch.from_numpy(ids)).logits.numpy()
    want = np.array(ref(mx.array(ids)))
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-3)
    # a hybrid pattern is left exactly as transformers builds it
    hybrid = ttarget.build_config(_args(["--out", "x", "--pattern", "s,s,f"] + TINY_TARGET))
    assert common.hf_text_config(hybrid).layer_types == hybrid["layer_types"]


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_answer_weight_weighs_the_answers(tmp_path, backend):
    """The weighted loss is the weighted mean of the per-token losses: all ones give the plain mean, and the
    weight moves the loss towards the weighted tokens' own."""
    args = _args(["--out", str(tmp_path / "t"), "--backend", backend] + TINY_TARGET)
    cfg = ttarget.build_config(args)
    be = (ttarget.TorchBackend if backend == "torch" else ttarget.MLXBackend)(cfg, args)
    batch = np.random.default_rng(0).integers(3, 200, (2, 17)).astype(np.int32)
    if backend == "torch":
        loss = lambda w=None: float(be._loss(batch, w).detach())
    else:
        import mlx.core as mx

        loss = lambda w=None: float(ttarget.loss_fn(be.model, mx.array(batch), None if w is None else mx.array(w)))
    ones = np.ones((2, 16), np.float32)
    only = np.zeros((2, 16), np.float32)
    only[0, 3] = 1.0
    heavy = ones.copy()
    heavy[0, 3] = 1e6
    assert loss(ones) == pytest.approx(loss(), rel=1e-5)
    assert loss(heavy) == pytest.approx(loss(only), rel=1e-3)  # one token weighted far above the rest: its loss
    assert loss(only) != pytest.approx(loss(), rel=1e-3)
