"""Fixtures: small random DFlash drafts (reference layout) + minimal fake targets.

A fake target directory holds only ``config.json`` (a valid ``gemma4_text``
config) and a safetensors file with the embedding table and (when untied) the
LM head: that is all the drafter may read from a target.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

HIDDEN = 64
VOCAB = 1024
TARGET_LAYERS = 6


@dataclass(frozen=True)
class Variant:
    name: str
    layer_types: tuple[str, ...]
    sliding_window: int | None = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    softcap: float | None = 30.0
    tied: bool = False
    multimodal_names: bool = False  # target tensors under model.language_model.*
    block_size: int = 8
    target_layer_ids: tuple[int, ...] = (1, 4)
    mask_token_id: int = 4
    extra: dict = field(default_factory=dict)


VARIANTS = {
    "full": Variant("full", ("full_attention", "full_attention")),
    # sliding + full layers, non-unit scales, tied multimodal-named target
    "mixed": Variant(
        "mixed",
        ("sliding_attention", "full_attention", "sliding_attention"),
        sliding_window=8,
        input_embedding_scale=1.5,
        output_multiplier=0.7,
        softcap=20.0,
        tied=True,
        multimodal_names=True,
        target_layer_ids=(1, 3, 4),
    ),
}


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def _linear(t, seed, name, out_dim, in_dim):
    t[name] = (_rng(seed, name).standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)).astype(np.float32)


def _norm(t, seed, name, dim):
    t[name] = (1.0 + 0.1 * _rng(seed, name).standard_normal(dim)).astype(np.float32)


def draft_config(v: Variant) -> dict:
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": HIDDEN,
        "intermediate_size": 96,
        "num_hidden_layers": len(v.layer_types),
        "num_target_layers": TARGET_LAYERS,
        "layer_types": list(v.layer_types),
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 131072,
        "vocab_size": VOCAB,
        "sliding_window": v.sliding_window,
        "dflash_config": {
            "block_size": v.block_size,
            "target_layer_ids": list(v.target_layer_ids),
            "mask_token_id": v.mask_token_id,
            "input_embedding_scale": v.input_embedding_scale,
            "output_multiplier": v.output_multiplier,
        },
    }
    if v.softcap is not None:
        cfg["final_logit_softcapping"] = v.softcap
    cfg.update(v.extra)
    return cfg


def write_draft(path: Path, v: Variant, seed: int = 0) -> Path:
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    cfg = draft_config(v)
    h, hd, nq, nkv, inter = HIDDEN, 16, 4, 2, cfg["intermediate_size"]
    t: dict[str, np.ndarray] = {}
    _linear(t, seed, "fc.weight", h, len(v.target_layer_ids) * h)
    _norm(t, seed, "hidden_norm.weight", h)
    for i in range(len(v.layer_types)):
        p = f"layers.{i}."
        _linear(t, seed, p + "self_attn.q_proj.weight", nq * hd, h)
        _linear(t, seed, p + "self_attn.k_proj.weight", nkv * hd, h)
        _linear(t, seed, p + "self_attn.v_proj.weight", nkv * hd, h)
        _linear(t, seed, p + "self_attn.o_proj.weight", h, nq * hd)
        _norm(t, seed, p + "self_attn.q_norm.weight", hd)
        _norm(t, seed, p + "self_attn.k_norm.weight", hd)
        _linear(t, seed, p + "mlp.gate_proj.weight", inter, h)
        _linear(t, seed, p + "mlp.up_proj.weight", inter, h)
        _linear(t, seed, p + "mlp.down_proj.weight", h, inter)
        _norm(t, seed, p + "input_layernorm.weight", h)
        _norm(t, seed, p + "post_attention_layernorm.weight", h)
    _norm(t, seed, "norm.weight", h)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(t, str(path / "model.safetensors"))
    return path


def target_config(tied: bool) -> dict:
    return {
        "architectures": ["Gemma4ForCausalLM"],
        "model_type": "gemma4_text",
        "hidden_size": HIDDEN,
        "num_hidden_layers": TARGET_LAYERS,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "head_dim": 16,
        "global_head_dim": 16,
        "num_key_value_heads": 1,
        "vocab_size": VOCAB,
        "vocab_size_per_layer_input": VOCAB,
        "hidden_size_per_layer_input": 0,
        "num_kv_shared_layers": 0,
        "sliding_window": 32,
        "final_logit_softcapping": 30.0,
        "tie_word_embeddings": tied,
    }


def target_tensors(seed: int = 0, tied: bool = False) -> dict[str, np.ndarray]:
    t = {"embed": (_rng(seed, "embed").standard_normal((VOCAB, HIDDEN)) / np.sqrt(HIDDEN)).astype(np.float32)}
    if not tied:
        t["lm_head"] = (4.0 * _rng(seed, "lm_head").standard_normal((VOCAB, HIDDEN)) / np.sqrt(HIDDEN)).astype(
            np.float32
        )
    return t


def write_target(path: Path, v: Variant, seed: int = 0) -> Path:
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    raw = target_tensors(seed, v.tied)
    pre = "model.language_model." if v.multimodal_names else "model."
    t = {pre + "embed_tokens.weight": raw["embed"]}
    if "lm_head" in raw:
        t["lm_head.weight"] = raw["lm_head"]
    # a tensor the drafter must never need
    t[pre + "norm.weight"] = np.ones(HIDDEN, np.float32)
    cfg = target_config(v.tied)
    if v.multimodal_names:
        cfg = {
            "model_type": "gemma4",
            "architectures": ["Gemma4ForConditionalGeneration"],
            "text_config": cfg,
            "tie_word_embeddings": v.tied,
        }
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(t, str(path / "model.safetensors"))
    return path


@dataclass(frozen=True)
class Pair:
    variant: Variant
    draft: Path
    target: Path


@pytest.fixture(scope="session")
def pairs(tmp_path_factory) -> dict[str, Pair]:
    root = tmp_path_factory.mktemp("dflash_ckpt")
    out = {}
    for name, v in VARIANTS.items():
        out[name] = Pair(v, write_draft(root / name / "draft", v), write_target(root / name / "target", v))
    return out


@pytest.fixture(params=sorted(VARIANTS))
def pair(request, pairs) -> Pair:
    return pairs[request.param]


def random_aux(n: int, width: int, seed: int = 0):
    import mlx.core as mx

    return mx.array(np.random.default_rng(seed).standard_normal((n, width)).astype(np.float32))


@pytest.fixture
def ref_loader(monkeypatch):
    """``load_draft`` of the dflash reference, resolving a local directory."""
    import dflash.model_mlx as ref

    monkeypatch.setattr(ref, "snapshot_download", lambda repo_id, **kw: str(repo_id))
    return ref.load_draft
