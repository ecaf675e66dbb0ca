"""Smoke runs of the trainers (a handful of steps, tiny sizes), resume, and the block-forward parity."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from kakeya.app.tools import drafter_arguments, target_arguments
from kakeya.checkpoints import tokenizer as tk
from kakeya.training import drafter as tdraft
from kakeya.training import target as ttarget


def _args(add, argv):
    p = argparse.ArgumentParser()
    add(p)
    return p.parse_args(argv)


TINY_TARGET = [
    "--hidden",
    "32",
    "--intermediate",
    "64",
    "--layers",
    "3",
    "--heads",
    "2",
    "--kv-heads",
    "1",
    "--head-dim",
    "16",
    "--global-head-dim",
    "32",
    "--sliding-window",
    "16",
    "--seq-len",
    "32",
    "--batch",
    "2",
    "--eval-windows",
    "2",
    "--eval-every",
    "2",
    "--save-every",
    "1",
    "--max-bytes",
    "20000",
    "--quiet",
    "--warmup",
    "1",
]


@pytest.mark.parametrize("backend", ["mlx", "torch"])
def test_train_target_smoke_resume_and_load(tmp_path, backend):
    out = tmp_path / "t"
    rep = ttarget.train(
        _args(target_arguments, ["--out", str(out), "--steps", "2", "--backend", backend] + TINY_TARGET)
    )
    assert rep["steps"] == 2 and len(rep["loss_curve"]) == 2
    assert rep["device"] == "cpu" if backend == "torch" else rep["device"].startswith("mlx ")  # the card says where
    rep2 = ttarget.train(
        _args(target_arguments, ["--out", str(out), "--steps", "3", "--resume", "--backend", backend] + TINY_TARGET)
    )
    assert rep2["steps"] == 3 and [s for s, _ in rep2["loss_curve"]] == [1, 2, 3]
    assert rep2["loss_curve"][:2] == rep["loss_curve"]  # resumed, not restarted
    saved = json.loads((out / "report.json").read_text())
    assert saved["final"]["heldout_perplexity"] > 1 and saved["corpus"]["heldout_files"] > 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "gemma4_text" and "full_attention" in cfg["layer_types"]

    import mlx.core as mx
    from mlx_lm import load

    model, tok = load(str(out))
    ids = tok.encode("def f(x):\n    return x")
    assert model(mx.array([ids])).shape == (1, len(ids), cfg["vocab_size"])


def test_heldout_split_is_by_file_and_deterministic():
    from kakeya.training import data

    files = data.all_files()
    held = [f for f in files if data.is_heldout(f, 5)]
    assert 0 < len(held) < len(files) // 5
    assert held == [f for f in files if data.is_heldout(f, 5)]


TINY_DRAFT = [
    "--sequences",
    "4",
    "--prompt-len",
    "12",
    "--gen-len",
    "10",
    "--gen-batch",
    "4",
    "--batch",
    "2",
    "--anchors",
    "3",
    "--head-dim",
    "16",
    "--layers",
    "1",
    "--intermediate",
    "32",
    "--train-block-sizes",
    "4,8",
    "--save-every",
    "1",
    "--quiet",
    "--warmup",
    "1",
    "--val-sequences",
    "3",
    "--eval-every",
    "2",
]


def test_train_drafter_smoke_resume_and_strict_load(tmp_path, tiny_pair):
    out = tmp_path / "d"
    base = ["--target", str(tiny_pair.target), "--out", str(out)] + TINY_DRAFT
    rep = tdraft.train(_args(drafter_arguments, base + ["--steps", "2", "--no-eval"]))
    assert rep["steps"] == 2 and rep["device"] == "cpu"
    rep2 = tdraft.train(
        _args(
            drafter_arguments,
            base
            + ["--steps", "3", "--resume", "--eval-prompts", "1", "--eval-max-tokens", "6", "--eval-block-sizes", "4"],
        )
    )
    assert [c[0] for c in rep2["loss_curve"]] == [1, 2, 3] and rep2["loss_curve"][:2] == rep["loss_curve"]
    # held-out curve: evaluated at step 2 (eval-every) and at the last step; carried across --resume
    held = rep2["heldout_curve"]
    assert [h["step"] for h in held] == [2, 3] and held[0] == rep["heldout_curve"][0]
    assert rep2["data"]["heldout_sequences"] == 3
    for h in held:
        assert h["block_size"] == 8 and len(h["acc_per_position"]) == 7 and 1.0 <= h["acceptance"] <= 8.0
        assert h["loss"] > 0
    acc = rep2["acceptance"]["per_block_size"]["4"]
    assert acc["mean_acceptance"] >= 1 and acc["lossless_vs_block1"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dflash_config"]["mask_token_id"] == 4 and cfg["dflash_config"]["input_embedding_scale"] == 1.0

    from kakeya.drafter.mlx_backend.model import load_dflash_mlx

    load_dflash_mlx(out, tiny_pair.target)  # strict load of the reference layout

    # --init-from (steps 0: the written weights are exactly the source's) and --bos-prompts
    out2 = tmp_path / "d2"
    base2 = ["--target", str(tiny_pair.target), "--out", str(out2)] + TINY_DRAFT
    tdraft.train(
        _args(drafter_arguments, base2 + ["--steps", "0", "--no-eval", "--init-from", str(out), "--bos-prompts"])
    )
    from safetensors.numpy import load_file

    a, b = load_file(out / "model.safetensors"), load_file(out2 / "model.safetensors")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    seqs = np.load(out2 / "ckpt" / "data" / "seqs.npy")
    assert (seqs[:, 0] == tk.BOS_ID).all() and (seqs[:, 1:] != tk.BOS_ID).any()
    with pytest.raises(ValueError, match="init-from"):  # another head size: another config, refused
        tdraft.train(
            _args(drafter_arguments, base2 + ["--steps", "0", "--no-eval", "--init-from", str(out), "--head-dim", "8"])
        )


def test_sampled_continuations_and_the_soft_label_loss(tmp_path, tiny_pair):
    """--temperatures cycles generation batches through greedy and sampled continuations (seeded:
    the same data twice); the target's soft labels are its own logits for the token each block
    position predicts; the KL term is >= 0 and training with it runs and resumes."""
    import torch

    from kakeya.training.block_trainer import BlockTrainer, TorchTarget, make_dataset

    tt = TorchTarget(tiny_pair.target, torch.device("cpu"))
    stream = np.arange(5, 400, dtype=np.int32)
    make = lambda: make_dataset(
        tt,
        stream,
        6,
        8,
        12,
        [0, 2],
        seed=3,
        gen_batch=2,
        quiet=True,
        temperatures=(0.0, 1.0),
    )
    a, b = make(), make()
    assert a.temperature.tolist() == [0, 0, 1, 1, 0, 0]
    assert np.array_equal(a.seqs, b.seqs)  # seeded
    greedy = tt.continue_(a.seqs[2:4, :8], 12, 0.0)
    assert not np.array_equal(greedy, a.seqs[2:4])  # the sampled batch is not the greedy one
    assert np.array_equal(tt.continue_(a.seqs[:2, :8], 12, 0.0), a.seqs[:2])
    # soft labels: the target's logits at position a+k-1 for block position k (transformers' own head)
    trainer = BlockTrainer(json.loads((tiny_pair.draft / "config.json").read_text()), tiny_pair.target, 0, "cpu")
    anchors, B = np.array([[9, 12]] * 6), 4
    soft = trainer.target_logits(a.final.astype(np.float32), anchors, B)
    with torch.no_grad():
        ref = tt.model(torch.from_numpy(a.seqs.astype(np.int64))).logits  # [N, T, V]
    for n in range(6):
        for j, anc in enumerate(anchors[n]):
            assert torch.allclose(soft[n * 2 + j], ref[n, anc : anc + B - 1], atol=2e-2)
    loss_hard, _ = trainer.loss(a.seqs, a.aux.astype(np.float32), anchors, B, 2.0)
    loss_both, _ = trainer.loss(
        a.seqs, a.aux.astype(np.float32), anchors, B, 2.0, final=a.final, hard=np.ones(6, np.float32), soft_weight=1.0
    )
    loss_soft, _ = trainer.loss(
        a.seqs, a.aux.astype(np.float32), anchors, B, 2.0, final=a.final, hard=np.zeros(6, np.float32), soft_weight=1.0
    )
    loss_soft, loss_both, loss_hard = (float(x.detach()) for x in (loss_soft, loss_both, loss_hard))
    assert loss_soft > 0 and loss_both == pytest.approx(loss_hard + loss_soft, rel=1e-5)
    # end to end: train-drafter with sampled data and the KL term, resumed from its memory-mapped data
    out = tmp_path / "d"
    base = (
        [
            "--target",
            str(tiny_pair.target),
            "--out",
            str(out),
            "--temperatures",
            "0,1",
            "--soft-weight",
            "0.5",
            "--no-eval",
        ]
        + TINY_DRAFT
        + ["--gen-batch", "2"]
    )  # two generation batches: one greedy, one sampled
    rep = tdraft.train(_args(drafter_arguments, base + ["--steps", "2"]))
    rep2 = tdraft.train(_args(drafter_arguments, base + ["--steps", "3", "--resume"]))
    assert rep2["loss_curve"][:2] == rep["loss_curve"] and "KL" in rep2["data"]["labels"]
    temps = np.load(out / "ckpt" / "data" / "temperature.npy")
    assert sorted(set(temps.tolist())) == [0.0, 1.0]


def test_interrupted_data_generation_continues_where_it_stopped(tmp_path, tiny_pair):
    """A data set written batch by batch survives an interruption: the rerun makes only the batches
    that are missing, and the result equals an uninterrupted run's."""
    import torch

    from kakeya.training.block_trainer import TorchTarget, cached_continuations, make_dataset

    tt = TorchTarget(tiny_pair.target, torch.device("cpu"))

    class Interrupted(Exception):
        pass

    class StopsAfter:
        def __init__(self, n):
            self.n, self.hidden_states = n, tt.hidden_states

        def continue_(self, *a, **k):
            if self.n == 0:
                raise Interrupted
            self.n -= 1
            return tt.continue_(*a, **k)

    stream = np.arange(5, 400, dtype=np.int32)
    key = {"test": 1}

    def make(target):
        return lambda out: make_dataset(
            target, stream, 6, 8, 6, [1], 4, 2, quiet=True, temperatures=(0.0, 1.0), out=out
        )

    with pytest.raises(Interrupted):
        cached_continuations(tmp_path / "a", key, make(StopsAfter(2)), quiet=True)
    assert json.loads((tmp_path / "a" / "progress.json").read_text())["sequences"] == 4
    resumed = StopsAfter(1)  # only the last batch may be made again
    got, _ = cached_continuations(tmp_path / "a", key, make(resumed), quiet=True)
    assert resumed.n == 0
    want, _ = cached_continuations(tmp_path / "b", key, make(tt), quiet=True)
    for f in got._fields:
        assert np.array_equal(getattr(got, f), getattr(want, f)), f
    again, _ = cached_continuations(tmp_path / "a", key, make(StopsAfter(0)), quiet=True)  # finished: reused
    assert np.array_equal(again.seqs, want.seqs)


def test_block_training_forward_equals_mlx_drafter(tiny_pair):
    """The batched training forward (many blocks, per-block masks) == the MLX drafter's inference forward,
    with aux from the verifier's own capture (TargetMLX.body)."""
    import mlx.core as mx
    import torch
    from mlx_lm.models.cache import KVCache

    from kakeya.checkpoints.config import load_draft_config
    from kakeya.drafter.backend import extend
    from kakeya.drafter.mlx_backend.model import load_dflash_mlx
    from kakeya.verifier.mlx_backend.target import TargetMLX

    target = TargetMLX.load(tiny_pair.target)
    dcfg = load_draft_config(tiny_pair.draft)
    tids = dcfg["dflash_config"]["target_layer_ids"]
    rng = np.random.default_rng(0)
    T, B = 24, 6
    seq = rng.integers(5, 1000, size=(1, T)).astype(np.int32)
    # aux from the verifier path (full causal forward on a fresh cache; T < the tiny sliding window)
    cache = [KVCache() for _ in range(target.n_cached)]
    from mlx_lm.models.base import create_causal_mask

    mask = create_causal_mask(T, 0)
    _, saved = target.body(mx.array(seq), cache, {"full_attention": "causal", "sliding_attention": mask}, tids)
    aux = np.array(mx.concatenate([saved[i][0] for i in tids], axis=-1))  # [T, A]
    # the same aux from the trainer's torch hooks
    tt = tdraft.TorchTarget(tiny_pair.target, torch.device("cpu"))
    aux_t = tt.hidden_states(seq, tids)[0][0]
    assert np.allclose(aux, aux_t, atol=2e-4)

    trainer = tdraft.BlockTrainer(json.loads((tiny_pair.draft / "config.json").read_text()), tiny_pair.target, 0, "cpu")
    ref = torch.load  # noqa: F841 (keep torch imported)
    from safetensors.numpy import load_file

    w = load_file(str(tiny_pair.draft / "model.safetensors"))
    trainer.model.load_state_dict({k: torch.from_numpy(v) for k, v in w.items()})
    anchors = np.array([[5, 11, 17]])
    with torch.no_grad():
        logits, labels = trainer.block_logits(seq, aux_t[None], anchors, B)
    draft = load_dflash_mlx(tiny_pair.draft, tiny_pair.target)
    for k, a in enumerate(anchors[0]):
        c = draft.make_cache()
        extend(draft, [c], [mx.array(aux[:a])])
        block = mx.array([int(seq[0, a])] + [dcfg["dflash_config"]["mask_token_id"]] * (B - 1))
        want = np.array(draft.block_logits([(c, block.tolist())]))
        assert np.allclose(logits[k].numpy(), want, atol=2e-3), k
        assert labels[k].tolist() == seq[0, a + 1 : a + B].tolist()


def test_drafter_data_is_tokenized_with_the_targets_own_tokenizer(tmp_path, tiny_pair):
    """train-drafter reads prompts with the target's tokenizer.json, not one trained again from this
    interpreter's standard library (another Python's would differ); a target without one gets the
    project's, trained here."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers

    from kakeya.training import data

    target = tmp_path / "target"
    shutil.copytree(tiny_pair.target, target)
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    trained_here = tk.train_tokenizer(vocab).to_str()
    other = Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "def": 5}, unk_token="<unk>"))
    other.pre_tokenizer = pre_tokenizers.Whitespace()
    other.save(str(target / "tokenizer.json"))
    got = data.target_tokenizer(target)
    assert got.to_str() == other.to_str() != trained_here
    assert got.encode("def x").ids == [5, 3]
    (target / "tokenizer.json").unlink()
    assert data.target_tokenizer(target).to_str() == trained_here


def test_drafter_eval_measures_a_drafter_directory(tiny_pair, capsys):
    """``python -m kakeya.training.drafter_eval TARGET DRAFT``: the card's acceptance measurement for a
    drafter trained elsewhere, one JSON line per drafter, lossless against block size 1."""
    from kakeya.training import drafter_eval

    assert (
        drafter_eval.main(
            [
                str(tiny_pair.target),
                str(tiny_pair.draft),
                "--prompts",
                "2",
                "--block-sizes",
                "2,4",
                "--max-tokens",
                "6",
                "--prompt-len",
                "12",
            ]
        )
        == 0
    )
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["draft"] == str(tiny_pair.draft) and line["lossless"] is True
    assert set(line["mean_acceptance"]) == {"2", "4"}
    assert 1.0 <= line["mean_acceptance"]["2"] <= 2.0 and 1.0 <= line["mean_acceptance"]["4"] <= 4.0
    # sampled acceptance by default at T 0.7 and 1.0, block 8 and 16, each run checked against AR sampling
    assert set(line["sampled_mean_acceptance"]) == {"0.7", "1"}
    assert all(
        set(row) == {"8", "16"} and all(1.0 <= v <= 16.0 for v in row.values())
        for row in line["sampled_mean_acceptance"].values()
    )


def test_sampled_acceptance_is_checked_against_ar_sampling(tiny_pair, monkeypatch):
    """Each sampled run must reproduce AR sampling with its seed (the coupled rule); a run that does not is
    reported as not lossless rather than averaged in silently."""
    from kakeya.orchestrator.decode.engine import Engine
    from kakeya.training import drafter_eval

    prompts = [[2] + list(range(100, 111)), [2] + list(range(200, 211))]
    engine = drafter_eval._engine(tiny_pair.target, tiny_pair.draft, "torch")
    args = (engine, prompts, (0.8,), (4,), 8)
    got = drafter_eval.measure_sampled(*args)
    assert got["0.8"]["4"]["lossless_vs_ar_sampling"] is True and got["0.8"]["4"]["blocks"] >= 2 * 2
    real = Engine.generate

    def broken(self, req, options=None):  # a speculative run (block size > 1) whose last token is wrong
        gen = real(self, req, options)
        if req.block_size != 1:
            gen.token_ids[-1] = (gen.token_ids[-1] + 1) % 1024
        return gen

    monkeypatch.setattr(Engine, "generate", broken)
    assert drafter_eval.measure_sampled(*args)["0.8"]["4"]["lossless_vs_ar_sampling"] is False


def test_drafter_eval_records_its_measurement_in_the_drafters_report(tiny_pair, tmp_path):
    """``--record``: the measurement becomes the report's ``acceptance`` (the model card's table), the
    rest of the report as it was; a directory without a report is refused, not given a made-up one."""
    import shutil

    from kakeya.training import drafter_eval

    draft = tmp_path / "draft"
    shutil.copytree(tiny_pair.draft, draft)
    argv = [
        str(tiny_pair.target),
        str(draft),
        "--prompts",
        "2",
        "--block-sizes",
        "2",
        "--max-tokens",
        "6",
        "--prompt-len",
        "12",
        "--record",
    ]
    (draft / "report.json").unlink(missing_ok=True)
    with pytest.raises(SystemExit, match="report.json does not exist"):
        drafter_eval.main(argv)
    (draft / "report.json").write_text(json.dumps({"steps": 7, "acceptance": {"stale": True}}))
    assert drafter_eval.main(argv) == 0
    rep = json.loads((draft / "report.json").read_text())
    assert rep["steps"] == 7 and "stale" not in rep["acceptance"]
    acc = rep["acceptance"]
    assert acc["prompts"] == 2 and acc["prompt_len"] == 12 and acc["max_tokens"] == 6
    assert set(acc["per_block_size"]) == {"2"} and acc["per_block_size"]["2"]["lossless_vs_block1"] is True
    lo, hi = acc["per_block_size"]["2"]["interval_90"]  # how precise the figure is, over its prompts
    assert lo <= acc["per_block_size"]["2"]["mean_acceptance"] <= hi
    assert set(acc["sampled"]["per_temperature"]) == {"0.7", "1"} and "coupled" in acc["sampled"]["rule"]


def test_training_data_on_the_device_trains_the_same_steps(tmp_path, tiny_pair):
    """``--data-on-device on`` copies the whole set to the device once and gathers each batch there (what
    a GPU run does by default): the same batches, so the same losses, as gathering from the files."""
    curves = {}
    for mode in ("off", "on"):
        base = (
            [
                "--target",
                str(tiny_pair.target),
                "--out",
                str(tmp_path / mode),
                "--temperatures",
                "0,1",
                "--soft-weight",
                "0.5",
                "--no-eval",
                "--data-on-device",
                mode,
            ]
            + TINY_DRAFT
            + ["--gen-batch", "2"]
        )
        curves[mode] = tdraft.train(_args(drafter_arguments, base + ["--steps", "3"]))["loss_curve"]
    assert len(curves["on"]) == 3 and curves["on"] == curves["off"]
    with pytest.raises(SystemExit):  # a mode that does not exist is refused by the parser
        _args(drafter_arguments, ["--target", "t", "--out", "o", "--data-on-device", "gpu"])


def test_a_time_budget_decays_the_learning_rate_by_the_time_spent():
    """A run that its --time-budget stops ends on a decayed rate: the cosine follows whichever of steps
    and time runs out first (the H200's stage 3 stopped at step 1,948 of 6,000 still at ~0.8 of its peak)."""
    from kakeya.training import common

    lr = 1e-3
    assert common.lr_at(2000, 6000, lr, 100) == common.lr_at(2000, 6000, lr, 100, spent=0.0)
    assert common.lr_at(2000, 6000, lr, 100) > 0.7 * lr  # by steps alone: a third of the way down
    assert common.lr_at(2000, 6000, lr, 100, spent=1.0) == pytest.approx(0.1 * lr)  # budget used up: the floor
    assert common.lr_at(5900, 6000, lr, 100, spent=0.1) < 0.11 * lr  # steps ahead of time: steps rule
    assert common.lr_at(10, 6000, lr, 100, spent=0.9) == pytest.approx(lr * 11 / 100)  # warm-up first
    assert common.budget_spent(105.0, 210.0) == 0.5 and common.budget_spent(500.0, 210.0) == 1.0
    assert common.budget_spent(105.0, 0.0) == 0.0


def test_train_target_refuses_a_torch_device_on_mlx(tmp_path):
    """train-target's default backend is MLX, which picks its own device: --device cuda is refused by name
    before any work, never trained past on another device."""
    args = _args(target_arguments, ["--out", str(tmp_path / "t"), "--steps", "1", "--device", "cuda", *TINY_TARGET])
    with pytest.raises(ValueError, match="--device: for --backend torch only"):
        ttarget.train(args)
    assert not (tmp_path / "t").exists()
