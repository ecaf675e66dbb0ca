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
        json.dumps({"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"],
                    "text_config": text})
    )
    cfg = load_target_config(tmp_path)
    assert cfg["model_type"] == "gemma4_text" and cfg["hidden_size"] == text["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma4"}))
    with pytest.raises(CheckpointError, match="text_config"):
        load_target_config(tmp_path)


def test_draft_without_dflash_config(tiny_pair, tmp_path):
    d = _edit(tiny_pair.draft, tmp_path / "plain", lambda c: c.pop("dflash_config"))
    with pytest.raises(CheckpointError, match=r"no 'dflash_config'.*not a DFlash drafter") as e:
        load_draft_config(d)
    assert str(d) in str(e.value)
    # a target directory is not a drafter either
    with pytest.raises(CheckpointError, match="dflash_config"):
        load_draft_config(tiny_pair.target)


@pytest.mark.parametrize("field", ["target_layer_ids", "mask_token_id", "block_size"])
def test_draft_missing_field(tiny_pair, tmp_path, field):
    d = _edit(tiny_pair.draft, tmp_path / field, lambda c: c["dflash_config"].pop(field))
    with pytest.raises(CheckpointError, match=rf"'dflash_config\.{field}' is missing"):
        load_draft_config(d)


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
