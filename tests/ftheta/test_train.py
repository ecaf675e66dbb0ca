"""`kakeya train-ftheta` end to end on the tiny pair: smoke run, report, resume, loss going down."""

import json

import mlx.core as mx
import numpy as np
import pytest

from kakeya.app.main import main
from kakeya.training.ftheta import REPORT_FILE, STATE_DIR, TrainArgs, train
from kakeya.verifier.mlx_backend.ftheta import load_ftheta

SMALL = dict(rank=8, batch=2, data_tokens=12_000, eval_seqs=2, lr=3e-3, warmup=4, log_every=8)


@pytest.fixture(scope="module")
def straight(tmp_path_factory, tiny_pair):
    """24 steps in one go, through the CLI."""
    out = tmp_path_factory.mktemp("straight")
    argv = [
        "train-ftheta",
        "--target",
        str(tiny_pair.target),
        "--draft",
        str(tiny_pair.draft),
        "--out",
        str(out),
        "--steps",
        "24",
        "--rank",
        "8",
        "--batch",
        "2",
        "--data-tokens",
        "12000",
        "--eval-seqs",
        "2",
        "--lr",
        "3e-3",
        "--warmup",
        "4",
        "--log-every",
        "8",
        "--save-every",
        "100",
    ]
    assert main(argv) == 0
    return out


def test_smoke_run_writes_an_ftheta_dir_and_a_report(straight, mlx_target, capsys):
    report = json.loads((straight / REPORT_FILE).read_text())
    for key in ("loss_curve", "final_loss", "eval", "eval_initial", "kv_error", "args", "data", "elapsed_s", "notes"):
        assert key in report, key
    assert [p["step"] for p in report["loss_curve"]] == list(range(1, 25))
    assert {"loss", "attn", "dir", "mag", "lr"} <= set(report["loss_curve"][0])
    by_type = report["eval"]["by_type"]
    assert set(by_type) == {"sliding", "full"} and by_type["sliding"]["restored"] and not by_type["full"]["restored"]
    for row in by_type.values():
        assert {"rel_mse_k", "rel_mse_v", "cos_k", "cos_v", "attn", "baseline_rel_mse_k"} <= set(row)
    assert "S5" in by_type["full"]["note"]
    assert set(report["eval"]["per_layer"]) == {"0", "1", "2", "3", "4", "5"}
    assert report["kv_error"]["sliding"]["rel_mse_k"] == by_type["sliding"]["rel_mse_k"]
    assert "standard library" in report["data"]["source"]
    r = load_ftheta(straight)  # the out dir is a usable f_theta directory
    r.check_target(mlx_target)
    assert r.config.rank == 8
    # warm-up then cosine decay
    lrs = [p["lr"] for p in report["loss_curve"]]
    assert lrs[0] < lrs[3] and lrs[4] > lrs[-1]


def test_resume_continues_exactly(straight, tmp_path, tiny_pair):
    out = tmp_path / "resumed"
    args = TrainArgs(steps=24, save_every=100, **SMALL)
    assert train(tiny_pair.target, tiny_pair.draft, out, args, stop_at=12, log=lambda m: None) == {"stopped_at": 12}
    assert (out / STATE_DIR / "state.json").is_file() and not (out / REPORT_FILE).exists()
    with pytest.raises(ValueError, match="--resume"):
        train(tiny_pair.target, tiny_pair.draft, out, TrainArgs(steps=24, save_every=100, **SMALL), log=lambda m: None)
    report = train(
        tiny_pair.target,
        tiny_pair.draft,
        out,
        TrainArgs(steps=24, save_every=100, **SMALL),
        resume=True,
        log=lambda m: None,
    )
    assert report["resumed_at"] == [12]
    ref = json.loads((straight / REPORT_FILE).read_text())
    assert [p["step"] for p in report["loss_curve"]] == list(range(1, 25))
    assert np.allclose([p["loss"] for p in report["loss_curve"]], [p["loss"] for p in ref["loss_curve"]], rtol=1e-4)
    a, b = mx.load(str(out / "ftheta.safetensors")), mx.load(str(straight / "ftheta.safetensors"))
    assert set(a) == set(b) and all(np.allclose(np.array(a[k]), np.array(b[k]), atol=1e-5) for k in a)


def test_loss_decreases(straight):
    report = json.loads((straight / REPORT_FILE).read_text())
    curve = [p["loss"] for p in report["loss_curve"]]
    assert np.mean(curve[-8:]) < np.mean(curve[:8])  # batches of 2 sequences: a noisy curve
    # held-out text, same sequences before and after: the hybrid loss and the K/V error go down
    before, after = report["eval_initial"]["sliding"], report["eval"]["by_type"]["sliding"]
    assert after["loss"] < 0.9 * before["loss"]
    assert after["rel_mse_k"] < before["rel_mse_k"] and after["rel_mse_v"] < before["rel_mse_v"]
