"""Checkpoint validation: one readable error naming the path and the field."""

from __future__ import annotations

import json
import shutil

import pytest

from kakeya.checkpoints.config import CheckpointError, check_pair, load_draft_config, load_target_config


def _edit(src, dst, fn):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    fn(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_good_pair(tiny_pair):
    t = load_target_config(tiny_pair.target)
    d = load_draft_config(tiny_pair.draft)
    assert t["model_type"] == "gemma4_text" and t["num_hidden_layers"] == 6
    assert d["dflash_config"]["target_layer_ids"] == [1, 4]
    check_pair(t, d)


def test_error_is_a_value_error():
    assert issubclass(CheckpointError, ValueError)


def test_missing_dir(tmp_path):
    with pytest.raises(CheckpointError, match=r"nope.*does not exist"):
        load_target_config(tmp_path / "nope")
    with pytest.raises(CheckpointError, match=r"nope.*does not exist"):
        load_draft_config(tmp_path / "nope")


def test_no_config_json(tmp_path):
    with pytest.raises(CheckpointError, match=r"no config\.json") as e:
        load_target_config(tmp_path)
    assert str(tmp_path) in str(e.value)


def test_bad_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="unreadable config.json"):
        load_target_config(tmp_path)


def test_wrong_model_type(tiny_pair, tmp_path):
    d = _edit(tiny_pair.target, tmp_path / "llama", lambda c: c.update(model_type="llama"))
    with pytest.raises(CheckpointError, match=r"'model_type' is 'llama'") as e:
        load_target_config(d)
    assert str(d) in str(e.value)


def test_multimodal_wrapper_returns_text_config(tiny_pair, tmp_path):
    text = json.loads((tiny_pair.target / "config.json").read_text())
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"], "text_config": text})
    )
    cfg = load_target_config(tmp_path)
    assert cfg["model_type"] == "gemma4_text" and cfg["hidden_size"] == text["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma4"}))
    with pytest.raises(CheckpointError, match="text_config"):
        load_target_config(tmp_path)


def test_eos_ids_come_from_generation_config_as_transformers_and_mlx_lm_read_them(tiny_pair, tmp_path):
    """An instruction-tuned Gemma lists its end-of-turn id in generation_config.json; config.json may name
    <eos> alone, and a multimodal checkpoint names it at the top level, outside text_config."""
    assert load_target_config(tiny_pair.target)["eos_token_id"] == [1]
    d = tmp_path / "it"
    shutil.copytree(tiny_pair.target, d)
    gen = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps(gen | {"eos_token_id": [1, 106]}))
    assert load_target_config(d)["eos_token_id"] == [1, 106]
    (d / "generation_config.json").write_text(json.dumps(gen | {"eos_token_id": "end"}))
    with pytest.raises(CheckpointError, match=r"generation_config\.json: field 'eos_token_id'"):
        load_target_config(d)
    (d / "generation_config.json").unlink()
    assert load_target_config(d)["eos_token_id"] == [1]
    text = json.loads((d / "config.json").read_text())
    text.pop("eos_token_id")
    (tmp_path / "mm").mkdir()
    (tmp_path / "mm" / "config.json").write_text(json.dumps({"model_type": "gemma4", "eos_token_id": [1, 106],
                                                             "text_config": text}))  # fmt: skip
    assert load_target_config(tmp_path / "mm")["eos_token_id"] == [1, 106]


def test_a_generation_stops_at_any_listed_end(tiny_pair, tmp_path):
    from kakeya.core.request import Request
    from kakeya.orchestrator.assembly import build_local_engine

    free = build_local_engine(str(tiny_pair.target), str(tiny_pair.draft), "torch", device="cpu")
    prompt = free.codec.encode("def main(argv):\n")
    run = free.generate(Request(list(prompt), max_tokens=24, block_size=4)).token_ids
    end = run[10]
    d = tmp_path / "target"
    shutil.copytree(tiny_pair.target, d)
    gen = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps(gen | {"eos_token_id": [1, end]}))
    stopping = build_local_engine(str(d), str(tiny_pair.draft), "torch", device="cpu")
    assert stopping.verifier.info.eos_token_ids == (1, end)
    out = stopping.generate(Request(list(prompt), max_tokens=24, block_size=4))
    assert out.token_ids == run[: run.index(end) + 1] and out.finish_reason == "stop"


def test_draft_without_dflash_config(tiny_pair, tmp_path):
    d = _edit(tiny_pair.draft, tmp_path / "plain", lambda c: c.pop("dflash_config"))
    with pytest.raises(CheckpointError, match=r"no 'dflash_config'.*not a DFlash drafter") as e:
        load_draft_config(d)
    assert str(d) in str(e.value)
    # a target directory is not a drafter either
    with pytest.raises(CheckpointError, match="dflash_config"):
        load_draft_config(tiny_pair.target)


def _dflash_reading(cfg: dict) -> dict:
    """What the ``dflash`` package's own DFlashDraftModel reads from a config (the oracle)."""
    from dflash.model import DFlashDraftModel
    from transformers import Qwen3Config

    model = DFlashDraftModel(Qwen3Config(**{k: v for k, v in cfg.items() if k not in ("architectures",)}))
    return {"block_size": model.block_size, "target_layer_ids": list(model.target_layer_ids),
            "mask_token_id": model.mask_token_id}  # fmt: skip


def _top_level_only(c):
    """Every DFlash field at the top level, as z-lab's configs through May 2026 kept block_size."""
    dflash = c.pop("dflash_config")
    c.update(dflash)
    c["dflash_config"] = {}


@pytest.mark.parametrize(
    "edit",
    [
        lambda c: c["dflash_config"].pop("block_size"),  # top-level block_size (8) only
        lambda c: (c["dflash_config"].pop("block_size"), c.pop("block_size")),  # neither: the package's 16
        lambda c: c["dflash_config"].update(block_size=5),  # dflash_config's wins over the top level's
        lambda c: c["dflash_config"].pop("target_layer_ids"),  # spread over num_target_layers
        _top_level_only,
    ],
    ids=["top-level-block", "no-block", "both-blocks", "no-layer-ids", "all-top-level"],
)
def test_draft_fields_read_as_the_dflash_package_reads_them(tiny_pair, tmp_path, edit):
    d = _edit(tiny_pair.draft, tmp_path / "d", edit)
    raw = json.loads((d / "config.json").read_text())
    mine = load_draft_config(d)["dflash_config"]
    assert {k: mine[k] for k in ("block_size", "target_layer_ids", "mask_token_id")} == _dflash_reading(raw)


@pytest.mark.parametrize(
    "edit,field",
    [
        (lambda c: c["dflash_config"].pop("mask_token_id"), "mask_token_id"),
        (lambda c: (c["dflash_config"].pop("target_layer_ids"), c.pop("num_target_layers")), "target_layer_ids"),
    ],
)
def test_draft_missing_field(tiny_pair, tmp_path, edit, field):
    d = _edit(tiny_pair.draft, tmp_path / field, edit)
    with pytest.raises(CheckpointError, match=rf"config\.json: field 'dflash_config\.{field}' is missing") as e:
        load_draft_config(d)
    assert str(d) in str(e.value)


def test_draft_bad_layer_ids(tiny_pair, tmp_path):
    d = _edit(tiny_pair.draft, tmp_path / "ids", lambda c: c["dflash_config"].update(target_layer_ids=[]))
    with pytest.raises(CheckpointError, match="target_layer_ids"):
        load_draft_config(d)


def _pair_error(tiny_pair, tmp_path, fn):
    d = _edit(tiny_pair.draft, tmp_path / "d", fn)
    with pytest.raises(CheckpointError) as e:
        check_pair(load_target_config(tiny_pair.target), load_draft_config(d))
    msg = str(e.value)
    assert str(d) in msg and str(tiny_pair.target) in msg
    return msg


def test_pair_layer_ids_out_of_range(tiny_pair, tmp_path):
    msg = _pair_error(tiny_pair, tmp_path, lambda c: c["dflash_config"].update(target_layer_ids=[1, 6]))
    assert "target_layer_ids" in msg and "[6]" in msg and "num_hidden_layers 6" in msg


def test_pair_hidden_size_mismatch(tiny_pair, tmp_path):
    msg = _pair_error(tiny_pair, tmp_path, lambda c: c.update(hidden_size=128))
    assert "'hidden_size' is 128" in msg and "hidden_size 64" in msg


def test_pair_mask_token_out_of_vocab(tiny_pair, tmp_path):
    msg = _pair_error(tiny_pair, tmp_path, lambda c: c["dflash_config"].update(mask_token_id=1024))
    assert "mask_token_id" in msg and "vocab_size 1024" in msg


def test_pair_vocab_size_mismatch_is_refused_by_a_load_as_by_inspect(tiny_pair, tmp_path, capsys):
    """A drafter trained for a target with another vocabulary (another Gemma-4's tokenizer): ``kakeya inspect``
    said it does not fit, ``kakeya generate`` served it, drafting with the wrong token ids."""
    from kakeya.app.main import main

    msg = _pair_error(tiny_pair, tmp_path, lambda c: c.update(vocab_size=2048))
    assert "field 'vocab_size' is 2048, target" in msg and "vocab_size 1024" in msg
    argv = ["generate", "--target", str(tiny_pair.target), "--draft", str(tmp_path / "d"), "--max-tokens", "2"]
    assert main(argv) == 2 and msg in capsys.readouterr().err
    assert main(["inspect", str(tiny_pair.target), "--draft", str(tmp_path / "d")]) == 2
    assert "field 'vocab_size' is 2048" in capsys.readouterr().err


def test_pair_names_every_field_that_does_not_fit_in_one_line(tiny_pair, tmp_path):
    """A drafter made for another target: every misfit is named at once, not one per try."""
    msg = _pair_error(tiny_pair, tmp_path, lambda c: c.update(hidden_size=128, dflash_config={**c["dflash_config"], "target_layer_ids": [9], "mask_token_id": 4096}))  # fmt: skip
    assert msg.startswith(f"draft checkpoint {tmp_path / 'd'}: ") and len(msg.splitlines()) == 1
    assert msg.count(str(tiny_pair.target)) == 3 and all(f in msg for f in ("[9]", "'hidden_size' is 128", "is 4096"))
