"""services/backends/torch/ops.py: the two RMSNorm conventions against their transformers references, RoPE."""

from __future__ import annotations

import pytest
import torch

from kakeya.backends.torch.ops import (
    apply_rope,
    default_inv_freq,
    gemma4_rms_norm,
    qwen3_rms_norm,
    resolve_device,
    resolve_dtype,
    rope_cos_sin,
)

EPS = 1e-6


def _inputs(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 7, 64, generator=g) * 3).to(dtype)
    w = (torch.randn(64, generator=g) * 0.5 + 1).to(dtype)
    return x, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma4_rms_norm_matches_transformers(dtype):
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

    x, w = _inputs(dtype)
    ref = Gemma4RMSNorm(64, eps=EPS).to(dtype)
    ref.weight.data.copy_(w)
    assert torch.equal(gemma4_rms_norm(x, w, EPS), ref(x))
    bare = Gemma4RMSNorm(64, eps=EPS, with_scale=False)
    assert torch.equal(gemma4_rms_norm(x, None, EPS), bare(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qwen3_rms_norm_matches_transformers(dtype):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    x, w = _inputs(dtype)
    ref = Qwen3RMSNorm(64, eps=EPS).to(dtype)
    ref.weight.data.copy_(w)
    assert torch.equal(qwen3_rms_norm(x, w, EPS), ref(x))


def test_the_two_norms_differ_where_they_round_and_only_there():
    """Gemma-4 scales in float32 and rounds once; Qwen3 rounds, then scales in bf16 (rounds again).
    Neither is Gemma 1-3's ``1 + w``."""
    x, w = _inputs(torch.float32)
    assert torch.equal(gemma4_rms_norm(x, w, EPS), qwen3_rms_norm(x, w, EPS))  # same numbers in float32
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    assert not torch.allclose(gemma4_rms_norm(x, w, EPS), normed * (1 + w), atol=1e-2)
    xb, wb = _inputs(torch.bfloat16)
    g, q = gemma4_rms_norm(xb, wb, EPS), qwen3_rms_norm(xb, wb, EPS)
    assert g.dtype == q.dtype == torch.bfloat16
    assert not torch.equal(g, q)  # double rounding shows up in bf16 ...
    assert torch.allclose(g.float(), q.float(), rtol=2e-2, atol=2e-2)  # ... as rounding, nothing more


def test_rope_rotates_pairs_by_position():
    inv = default_inv_freq(10_000.0, 8)
    assert torch.allclose(inv, 1.0 / 10_000.0 ** (torch.arange(0, 8, 2).float() / 8))
    assert torch.equal(default_inv_freq(10_000.0, 8, n_pairs=2), inv[:2])
    cos, sin = rope_cos_sin(inv, 3, 2, "cpu", torch.float32)
    assert (
        cos.shape == (2, 8) and torch.allclose(cos[0, :4], torch.cos(3 * inv)) and torch.equal(cos[:, :4], cos[:, 4:])
    )
    x = torch.randn(2, 8)
    y = apply_rope(x, cos, sin)
    # pair (i, i + 4) turned by angle p * inv_i: a rotation keeps each pair's length
    assert torch.allclose(y[:, :4] ** 2 + y[:, 4:] ** 2, x[:, :4] ** 2 + x[:, 4:] ** 2, atol=1e-5)
    assert torch.allclose(y[1, 0], x[1, 0] * torch.cos(4 * inv[0]) - x[1, 4] * torch.sin(4 * inv[0]))
    c2, s2 = rope_cos_sin(inv, 3, 2, "cpu", torch.float32, scale=2.0)
    assert torch.allclose(c2, 2 * cos) and torch.allclose(s2, 2 * sin)


def test_device_and_dtype_resolution():
    assert resolve_dtype(None) is torch.float32 and resolve_dtype("BF16") is torch.bfloat16
    assert resolve_device(None) == torch.device("cpu")
    with pytest.raises(ValueError, match="unsupported dtype"):
        resolve_dtype("int3")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda"):
            resolve_device("cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_rms_norms_are_the_reference_formulas_bit_for_bit(dtype):
    """Both norms run as one fused kernel (F.rms_norm); it must round where the unfused
    float32 formula rounds: Gemma-4 once after the weight, Qwen3 before it."""
    from kakeya.backends.torch.ops import _normalized_f32

    g = torch.Generator().manual_seed(0)
    for D in (16, 64, 256, 2816):
        for L in (1, 8, 100):
            x = (torch.randn(1, L, D, generator=g) * 7).to(dtype)
            w = (torch.randn(D, generator=g) * 0.5 + 1).to(dtype)
            assert torch.equal(gemma4_rms_norm(x, w, 1e-6), (_normalized_f32(x, 1e-6) * w.float()).to(dtype))
            assert torch.equal(gemma4_rms_norm(x, None, 1e-6), _normalized_f32(x, 1e-6).to(dtype))
            assert torch.equal(qwen3_rms_norm(x, w, 1e-6), w * _normalized_f32(x, 1e-6).to(dtype))


def test_rms_norm_with_a_weight_of_another_dtype_takes_the_unfused_formula():
    x, w = _inputs(torch.bfloat16)
    out = gemma4_rms_norm(x, w.float(), EPS)  # float32 weight on bf16 rows: scale in float32, round once
    assert out.dtype == torch.bfloat16
    ref = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + EPS) * w.float()).to(torch.bfloat16)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("G,L,D", [(1, 5, 64), (2, 1, 512), (2, 16, 256), (4, 7, 128), (8, 3, 64), (8, 16, 64)])
def test_folded_gqa_attention_equals_sdpa_gqa(G, L, D):
    """The CUDA attention path (query heads folded per KV head; two GEMMs up to DECODE_ROWS rows, the
    fused kernel beyond) computes SDPA's GQA, masks included."""
    from kakeya.backends.torch.ops import sdpa_folded

    g = torch.Generator().manual_seed(G * 100 + L)
    Hkv, K = 2, 40 if L != 16 else 1040  # 1040 keys: the split-K path (16 chunks of 65)
    q = torch.randn(1, Hkv * G, L, D, generator=g)
    k, v = torch.randn(1, Hkv, K, D, generator=g), torch.randn(1, Hkv, K, D, generator=g)
    mask = torch.rand(L, K, generator=g) > 0.3
    mask[:, 0] = True  # every query sees at least one key
    for m in (mask, mask[:1], None):  # [1, K]: one row for every query (a non-causal drafter block's)
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.3, enable_gqa=True)
        out = sdpa_folded(
            q.transpose(1, 2).contiguous().transpose(1, 2), k, v, m, 0.3
        )  # non-contiguous q, as callers pass it
        assert out.shape == ref.shape
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_fused_rms_norms_round_like_the_reference(dtype):
    """On CUDA the fused kernel sums squares in its own order, so its float32 rstd may differ
    from ``mean``'s in the last bit: allowed to move an output by a few rounding steps (and, in
    bf16, rarely). The budget, relative to the output: the rstd's last bit (1 eps), the
    reference's two roundings in the Qwen3 form (normalised row, then times the weight: 1 eps),
    the fused kernel's own rounding (0.5 eps). A float32 row of 64 on an H200 reached 2.x eps."""
    from kakeya.backends.torch.ops import _normalized_f32

    g = torch.Generator().manual_seed(0)
    for D in (64, 256, 2816):
        x = (torch.randn(1, 64, D, generator=g) * 7).to(dtype).cuda()
        w = (torch.randn(D, generator=g) * 0.5 + 1).to(dtype).cuda()
        for fused, ref in (
            (gemma4_rms_norm(x, w, 1e-6), (_normalized_f32(x, 1e-6) * w.float()).to(dtype)),
            (qwen3_rms_norm(x, w, 1e-6), w * _normalized_f32(x, 1e-6).to(dtype)),
        ):
            diff = (fused.float() - ref.float()).abs()
            step = torch.finfo(dtype).eps * ref.float().abs().clamp_min(1e-3)
            assert bool((diff <= 3 * step).all()), (D, dtype, (diff / step).max().item())
            if dtype != torch.float32:  # in float32 a last-bit rstd change moves a whole row by an ulp
                assert (fused != ref).float().mean().item() < 0.01, (D, dtype)
