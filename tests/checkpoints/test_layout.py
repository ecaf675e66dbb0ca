"""checkpoints/layout.py: shard lists, tensor -> file maps, and where the embedding / LM head live."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from kakeya.checkpoints.layout import (
    SAFETENSORS_INDEX,
    find_text_tensors,
    is_quantized,
    safetensors_header,
    shard_files,
    tensor_files,
)


def _w(*names: str) -> dict[str, np.ndarray]:
    return {n: np.zeros((2, 3), np.float32) for n in names}


def test_single_file_checkpoint_lists_its_tensors_from_the_header(tmp_path):
    save_file(_w("model.embed_tokens.weight", "model.norm.weight"), str(tmp_path / "model.safetensors"))
    assert shard_files(tmp_path) == [tmp_path / "model.safetensors"]
    assert tensor_files(tmp_path) == {
        "model.embed_tokens.weight": tmp_path / "model.safetensors",
        "model.norm.weight": tmp_path / "model.safetensors",
    }
    assert sorted(safetensors_header(tmp_path / "model.safetensors")) == [
        "model.embed_tokens.weight",
        "model.norm.weight",
    ]


def test_sharded_checkpoint_follows_the_index_weight_map(tmp_path):
    save_file(_w("model.embed_tokens.weight"), str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(_w("lm_head.weight", "model.norm.weight"), str(tmp_path / "model-00002-of-00002.safetensors"))
    save_file(_w("stray.weight"), str(tmp_path / "not-a-shard.safetensors"))  # not in the index: ignored
    wm = {
        "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
        "lm_head.weight": "model-00002-of-00002.safetensors",
        "model.norm.weight": "model-00002-of-00002.safetensors",
    }
    (tmp_path / SAFETENSORS_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    assert [f.name for f in shard_files(tmp_path)] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    assert tensor_files(tmp_path) == {k: tmp_path / v for k, v in wm.items()}


def test_missing_shards_and_empty_dirs_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        shard_files(tmp_path)
    (tmp_path / SAFETENSORS_INDEX).write_text(json.dumps({"weight_map": {"a.weight": "gone.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="gone.safetensors"):
        tensor_files(tmp_path)
    (tmp_path / SAFETENSORS_INDEX).write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match="weight_map"):
        shard_files(tmp_path)


def test_text_only_checkpoint_with_an_untied_head():
    t = find_text_tensors(
        ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "lm_head.weight"], "", False
    )
    assert (t.prefix, t.embed, t.head) == ("model.", "model.embed_tokens", "lm_head")


def test_tied_embeddings_have_no_head_even_beside_a_stray_lm_head():
    """tie_word_embeddings makes the embedding the head, as transformers ties it: an lm_head.weight left beside (a
    re-save's) is not read, by the verifier nor by a drafter borrowing the target's head."""
    for names in (["model.embed_tokens.weight", "model.norm.weight"], ["model.embed_tokens.weight", "lm_head.weight"]):
        t = find_text_tensors(names, "", True)
        assert (t.prefix, t.embed, t.head) == ("model.", "model.embed_tokens", None)
    with pytest.raises(ValueError, match="tie_word_embeddings is false, yet no lm_head.weight"):
        find_text_tensors(["model.embed_tokens.weight"], "/ckpt", False)


def test_multimodal_names_skip_the_towers_and_per_layer_tables():
    names = [
        "model.vision_tower.embed_tokens.weight",
        "model.language_model.embed_tokens_per_layer.weight",
        "model.language_model.embed_tokens.weight",
        "model.language_model.norm.weight",
    ]
    t = find_text_tensors(names, "", True)
    assert (t.prefix, t.embed, t.head) == ("model.language_model.", "model.language_model.embed_tokens", None)
    # an unlisted nesting is still found by suffix, towers still skipped; the head under the same prefix
    t = find_text_tensors(["audio.x.embed_tokens.weight", "a.b.embed_tokens.weight", "a.b.lm_head.weight"], "", False)
    assert (t.prefix, t.embed, t.head) == ("a.b.", "a.b.embed_tokens", "a.b.lm_head")


def test_no_embedding_is_a_value_error_naming_the_checkpoint():
    with pytest.raises(ValueError, match="no embed_tokens weight in target checkpoint /ckpt"):
        find_text_tensors(["model.norm.weight", "model.vision_tower.embed_tokens.weight"], "/ckpt", True)


def test_quantized_checkpoints_are_recognised():
    assert is_quantized(["model.embed_tokens.weight", "model.embed_tokens.scales"])
    assert not is_quantized(["model.embed_tokens.weight", "model.layers.0.router.scale"])


def test_not_a_safetensors_file(tmp_path):
    (tmp_path / "x.safetensors").write_bytes(b"\x04")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        safetensors_header(tmp_path / "x.safetensors")
