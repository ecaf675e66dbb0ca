"""Extra tiny Gemma-4 checkpoints for the torch backend's parity tests.

``make_tiny`` (services/checkpoints/tiny.py) covers the 26B-A4B-style features
(k_eq_v full layers, MoE). The features of the small Gemma-4 variants -- per-layer
inputs, KV sharing across the last layers, double-wide MLP on shared layers,
tied embeddings, separate V projection on full layers -- are covered by a
checkpoint written here by transformers itself (random init, then every tensor
jittered so that no norm is exactly 1), optionally under the multimodal
``model.language_model.`` prefix.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

FEATURES_CONFIG = dict(
    vocab_size=512,
    vocab_size_per_layer_input=512,
    hidden_size=64,
    intermediate_size=48,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
    sliding_window=8,
    attention_k_eq_v=False,
    hidden_size_per_layer_input=16,
    num_kv_shared_layers=3,
    use_double_wide_mlp=True,
    final_logit_softcapping=30.0,
    tie_word_embeddings=True,
    rope_parameters={
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 1e6, "factor": 2.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    },
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)


def make_features_target(out: Path, seed: int = 0, multimodal_names: bool = False) -> Path:
    """A ``gemma4_text`` checkpoint with PLE + KV sharing + double-wide MLP + tied head."""
    from safetensors.torch import save_file
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    cfg = Gemma4TextConfig(**FEATURES_CONFIG)
    model = Gemma4ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    tensors = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        t = t.detach().clone().float()
        if t.ndim == 1:
            t = t + 0.1 * torch.randn(t.shape, generator=g)
        else:
            t = torch.randn(t.shape, generator=g) / t.shape[-1] ** 0.5
            if "embed_tokens.weight" in name and "per_layer" not in name:
                t = t * 2.0  # logits of a useful spread through the tied head
        if name.endswith("layer_scalar"):
            t = torch.full_like(t, 0.9)
        tensors[name] = t.contiguous()
    d = cfg.to_dict()
    d["architectures"] = ["Gemma4ForCausalLM"]
    d["model_type"] = "gemma4_text"
    # transformers' own spelling, as save_pretrained writes it (per_layer_config since 5.2): both
    # backends read it through checkpoints/config.py.
    if multimodal_names:
        tensors = {k.replace("model.", "model.language_model.", 1): v for k, v in tensors.items()}
        d = {"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"], "text_config": d}
    (out / "config.json").write_text(json.dumps(d, indent=2))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
