"""The MoE experts' two spellings: one grouped GEMM over tokens sorted by expert (offsets found on
the device) and a batched GEMV per (token, expert). Same tokens, same routing, same sums."""

from __future__ import annotations

import pytest
import torch

from kakeya.verifier.torch_backend.gemma4 import Gemma4Args, MoE, grouped_mm_supported

ARGS = dict(
    hidden_size=64,
    num_experts=16,
    top_k_experts=4,
    moe_intermediate_size=32,
    hidden_activation="gelu_pytorch_tanh",
    rms_norm_eps=1e-6,
)


def _moe(dtype):
    with torch.device("meta"):
        moe = MoE(Gemma4Args(**{**_base(), **ARGS}))
    g = torch.Generator().manual_seed(0)
    for name, buf in list(moe._buffers.items()):
        moe._buffers[name] = (
            torch.randn(buf.shape, generator=g) * buf.shape[-1] ** -0.5 + (1 if buf.dim() == 1 else 0)
        ).to(dtype)
    return moe


def _base():
    return dict(
        vocab_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=64,
        layer_types=["full_attention"],
        enable_moe_block=True,
    )


@pytest.mark.skipif(
    not grouped_mm_supported(torch.device("cpu"), torch.bfloat16), reason="torch._grouped_mm not on this CPU"
)
@pytest.mark.parametrize("T", [1, 3, 8, 16])
def test_grouped_experts_equal_the_batched_gemv_experts(T):
    moe = _moe(torch.bfloat16)
    x = torch.randn(T, 64, generator=torch.Generator().manual_seed(T)).to(torch.bfloat16)
    idx, w = moe.route(x)
    assert idx.shape == (T, 4) and w.dtype == torch.float32
    if T * 4 < 16:
        assert len(set(idx.reshape(-1).tolist())) < 16  # experts with no token: empty groups in the offsets
    moe.grouped_mm = True
    grouped = moe.experts(x, idx, w)
    moe.grouped_mm = False
    gemv = moe.experts(x, idx, w)
    assert grouped.shape == x.shape and grouped.abs().sum() > 0
    torch.testing.assert_close(grouped.float(), gemv.float(), rtol=2e-2, atol=2e-2)


def test_routing_weights_are_normalised_top_k_times_the_expert_scale():
    moe = _moe(torch.float32)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    idx, w = moe.route(x)
    r = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * moe.router_scale * moe.root
    probs = torch.softmax(r @ moe.router_proj.T, dim=-1)
    top, ref_idx = torch.topk(probs, 4, dim=-1)
    assert torch.equal(idx, ref_idx)
    torch.testing.assert_close(w, top / top.sum(-1, keepdim=True) * moe.per_expert_scale[idx])
