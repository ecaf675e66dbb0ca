"""The production shapes the GPU benchmarks project onto: gemma-4-26B-A4B and its DFlash drafter, and the
HBM bandwidth of the GPUs they run on (``gpu_projection.py`` and ``kernels.py`` both read them)."""

from __future__ import annotations

MAX_L = 16


def layer_types_of(n: int, period: int = 6) -> list[str]:
    """Gemma-4: five sliding layers, then one full-attention layer (the last is full)."""
    return ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(n)]


# gemma-4-26B-A4B text model, from its published config (google/gemma-4-26B-A4B-it):
# hidden 2816, 30 layers (25 sliding + 5 full), 16 heads, 8 KV heads (head_dim 256) on
# sliding layers, 2 KV heads (global_head_dim 512, K = V) on full layers, window 1024,
# dense GeGLU MLP 2112 beside an MoE block of 128 experts (top 8, 704 wide), vocab
# 262144 tied, soft-cap 30. transformers' Gemma4TextConfig notes num_global_key_value_heads=2
# for this model; mlx-lm's gemma4_text marks k_eq_v and the MoE block as the 26B features.
GEMMA4_26B_A4B = dict(
    vocab_size=262_144,
    hidden_size=2816,
    intermediate_size=2112,
    num_hidden_layers=30,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=256,
    global_head_dim=512,
    num_global_key_value_heads=2,
    attention_k_eq_v=True,
    sliding_window=1024,
    layer_types=layer_types_of(30),
    final_logit_softcapping=30.0,
    tie_word_embeddings=True,
    hidden_size_per_layer_input=0,
    vocab_size_per_layer_input=262_144,
    num_kv_shared_layers=0,
    enable_moe_block=True,
    num_experts=128,
    top_k_experts=8,
    moe_intermediate_size=704,
    max_position_embeddings=262_144,
)

# DFlash drafter for it: 5 Qwen3-style layers at the target's width (~0.4B parameters),
# context from 5 target layers (dflash's build_target_layer_ids(30, 5)), block 16.
DRAFT_26B = dict(
    hidden_size=2816,
    num_hidden_layers=5,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=6144,
    target_layer_ids=[1, 8, 14, 20, 27],
    block_size=16,
)


# HBM bandwidth (bytes/s) by device-name fragment; the roofline divides the bytes a step must read by it
HBM_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12}


def hbm_bandwidth(device_name: str) -> float | None:
    for key, bw in HBM_BANDWIDTH.items():
        if key in device_name:
            return bw
    return None
