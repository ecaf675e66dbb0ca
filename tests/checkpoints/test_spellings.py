"""Every published spelling of a config field has one reading (``checkpoints/config.py``), the one the tool that
wrote the file reads back: transformers' config classes are the oracle here; the compatibility suite
(tests/compat/) loads whole checkpoints those tools wrote."""

from __future__ import annotations

import json

import pytest

from kakeya.checkpoints.config import (
    CheckpointError,
    chat_template_source,
    draft_config,
    load_target_config,
    mlx_model_config,
    target_config,
)

S, F = "sliding_attention", "full_attention"
TEXT = dict(
    vocab_size=200, vocab_size_per_layer_input=200, hidden_size=24, intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=2, num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1,
    attention_k_eq_v=True, layer_types=[S, F, S, F], sliding_window=6, hidden_size_per_layer_input=0,
)  # fmt: skip


def _saved(**overrides) -> dict:
    """The config.json transformers >= 5.2 writes for these arguments (per_layer_config)."""
    from transformers import Gemma4TextConfig

    return Gemma4TextConfig(**{**TEXT, **overrides}).to_dict()


def test_per_layer_config_reads_as_the_hub_spelling():
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    raw = _saved()
    assert "per_layer_config" in raw
    mine = target_config(raw)
    assert "per_layer_config" not in mine
    assert (mine["global_head_dim"], mine["num_global_key_value_heads"]) == (16, 1)
    hub = {k: v for k, v in raw.items() if k != "per_layer_config"} | {
        "global_head_dim": 16,
        "num_global_key_value_heads": 1,
    }
    assert target_config(hub) == mine  # the two spellings, one reading
    assert target_config(mine) == mine  # idempotent
    # transformers' model built from the saved file has the shapes our reading names
    model = Gemma4ForCausalLM(Gemma4TextConfig(**raw))
    for i, layer in enumerate(model.model.layers):
        full = raw["layer_types"][i] == F
        assert layer.self_attn.head_dim == (16 if full else 8)
        assert layer.self_attn.k_proj.out_features == (1 if full else 2) * layer.self_attn.head_dim


def test_full_layers_shaped_as_the_sliding_ones_read_as_transformers_builds_them():
    """Full layers with the sliding layers' head size and key/value heads: transformers writes no override,
    ``per_layer_config: {}``, and builds them at ``head_dim``, not its 512 default for an absent field."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    raw = _saved(global_head_dim=8, num_global_key_value_heads=2)
    assert raw["per_layer_config"] == {} and "global_head_dim" not in raw
    mine = target_config(raw)
    assert (mine["global_head_dim"], mine["num_global_key_value_heads"]) == (8, None)
    model = Gemma4ForCausalLM(Gemma4TextConfig(**raw))
    assert {layer.self_attn.head_dim for layer in model.model.layers} == {8}


def test_mlx_lm_reads_the_reading():
    """mlx-lm's own args, from what the MLX path hands it, have the shapes transformers built."""
    from mlx_lm.models import gemma4, gemma4_text

    raw = _saved(tie_word_embeddings=True)
    text = target_config(raw)
    args = gemma4_text.ModelArgs.from_dict({**raw, **mlx_model_config(raw, text)})
    attn = gemma4_text.Attention(args, 1)
    assert (attn.head_dim, attn.n_kv_heads) == (16, 1)
    assert args.use_double_wide_mlp is False and args.final_logit_softcapping is None  # transformers' defaults
    wrapper = {"model_type": "gemma4", "text_config": raw}  # transformers writes no top-level vocab_size
    margs = gemma4.ModelArgs.from_dict({**wrapper, **mlx_model_config(wrapper, target_config(wrapper))})
    assert margs.text_config["vocab_size"] == 200 and margs.text_config["global_head_dim"] == 16
    assert gemma4.ModelArgs.from_dict(wrapper).text_config["vocab_size"] == 262144  # unaided: mlx-lm's default


def test_vocab_size_at_either_level():
    raw = _saved()
    inner = {k: v for k, v in raw.items() if k != "vocab_size"}
    assert target_config({"model_type": "gemma4", "text_config": raw})["vocab_size"] == 200
    assert target_config({"model_type": "gemma4", "vocab_size": 200, "text_config": inner})["vocab_size"] == 200
    with pytest.raises(CheckpointError, match="field 'vocab_size' must be an integer"):
        target_config({"model_type": "gemma4", "text_config": inner})


@pytest.mark.parametrize(
    "per_layer,match",
    [
        ({"0": {"head_dim": 16}, "1": {"head_dim": 16}, "3": {"head_dim": 16}}, r"overrides layers \[0\]"),
        ({"1": {"head_dim": 16}, "3": {"head_dim": 32}}, "different shapes"),
        ({"1": {"head_dim": 16, "sliding_window": 3}, "3": {"head_dim": 16, "sliding_window": 3}}, "sliding_window"),
    ],
)
def test_per_layer_configs_gemma4_cannot_mean_are_refused_by_name(per_layer, match):
    raw = _saved()
    raw["per_layer_config"] = per_layer
    with pytest.raises(CheckpointError, match=rf"field 'per_layer_config' .*{match}"):
        target_config(raw)


def test_other_global_kv_heads_without_k_eq_v_are_refused_by_name():
    raw = _saved(attention_k_eq_v=False)
    raw["per_layer_config"] = {
        "1": {"head_dim": 16, "num_key_value_heads": 1},
        "3": {"head_dim": 16, "num_key_value_heads": 1},
    }
    with pytest.raises(CheckpointError, match="without 'attention_k_eq_v'"):
        target_config(raw)


def test_absent_fields_mean_transformers_defaults_and_layer_pattern():
    from transformers import Gemma4TextConfig

    raw = {"model_type": "gemma4_text", "hidden_size": 24, "num_hidden_layers": 7, "vocab_size": 50}
    mine = target_config(raw)
    theirs = Gemma4TextConfig(**raw)
    assert mine["layer_types"] == theirs.layer_types  # not mlx-lm's sliding_window_pattern 5
    for key in ("use_double_wide_mlp", "final_logit_softcapping", "num_kv_shared_layers", "sliding_window"):
        assert mine[key] == getattr(theirs, key), key
    assert mine["global_head_dim"] == 512


def test_eos_lists_and_chat_template_from_either_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**_saved(), "eos_token_id": 1}))
    assert load_target_config(tmp_path)["eos_token_id"] == [1]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 106]}))
    assert load_target_config(tmp_path)["eos_token_id"] == [1, 106]
    assert chat_template_source(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]})
    )
    assert load_target_config(tmp_path)["chat_template"] == "D"
    (tmp_path / "chat_template.jinja").write_text("J")
    assert chat_template_source(tmp_path) == "J"  # transformers prefers the .jinja file
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": 7}))
    (tmp_path / "chat_template.jinja").unlink()
    with pytest.raises(CheckpointError, match=r"tokenizer_config\.json: field 'chat_template'"):
        chat_template_source(tmp_path)


DRAFT = dict(
    model_type="qwen3", hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    head_dim=8, intermediate_size=64, vocab_size=100, num_target_layers=6,
    dflash_config={"block_size": 8, "mask_token_id": 99, "target_layer_ids": [1, 4]},
)  # fmt: skip


@pytest.mark.parametrize(
    "spelling",
    [
        {},  # no RoPE field: the default theta
        {"rope_theta": 5e5},  # through May 2026 (transformers 4)
        {"rope_theta": 5e5, "rope_scaling": None},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},  # June 2026 (transformers 5)
        {"rope_theta": 5e5, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
        {"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}},
        {"rope_parameters": {"rope_type": "default"}, "rope_theta": 3e5},
    ],
)
def test_draft_rope_reads_as_qwen3config(spelling):
    from transformers import Qwen3Config

    mine = draft_config({**DRAFT, **spelling})
    theirs = Qwen3Config(**{**DRAFT, **spelling}).rope_parameters
    assert mine["rope_theta"] == theirs["rope_theta"]
    assert mine["rope_parameters"]["rope_type"] == theirs["rope_type"]
    assert mine["rope_parameters"].get("factor") == theirs.get("factor")
    assert draft_config(mine) == mine


@pytest.mark.parametrize(
    "spelling",
    [
        {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1},  # layers from 1 on slide
        {"use_sliding_window": False, "sliding_window": 6},  # no sliding layer
        {"use_sliding_window": True, "sliding_window": 6, "layer_types": [S, S, F]},  # June 2026
    ],
)
def test_draft_sliding_layers_read_as_qwen3config(spelling):
    from transformers import Qwen3Config

    mine = draft_config({**DRAFT, **spelling})
    theirs = Qwen3Config(**{**DRAFT, **spelling})
    assert mine["layer_types"] == theirs.layer_types
    assert mine["sliding_window"] == (theirs.sliding_window if S in theirs.layer_types else None)


def test_draft_sliding_layers_without_a_window_are_refused_by_name():
    with pytest.raises(CheckpointError, match=r"field 'sliding_window' is None, expected a positive integer"):
        draft_config({**DRAFT, "layer_types": [S, S, F], "sliding_window": None})
