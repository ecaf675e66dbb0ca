"""q/k norm + RoPE (+ V's norm) against the models' own projections' epilogues.

bfloat16: bit-exact but for the norm's rare boundary case (see test_norm.py); every RoPE op is a
rounded product or sum, as eager. float32: a few ulps at the row's scale, from the norm.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from . import reference
from .conftest import cuda_only
from .numerics import assert_within_steps

pytest.importorskip("triton", reason="the kernels need triton (Linux only; no macOS wheels)")

from kakeya.backends.torch.kernels import rope
from kakeya.backends.torch.ops import default_inv_freq, rope_from_positions

EPS = 1e-6


def _close(actual, expected):
    assert actual.shape == expected.shape
    if expected.dtype == torch.float32:
        assert_within_steps(actual, expected, 4, row_scale=True)
    else:
        assert_within_steps(actual, expected, 1, exact_at_least=0.99)


def _case(device, dtype, T, n_heads, n_kv, D, k_eq_v, inv_freq=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = (n_heads + n_kv * (1 if k_eq_v else 2)) * D
    qkv = (torch.randn(T, width, generator=g) * 2).to(device, dtype)
    qw, kw = ((torch.randn(D, generator=g) * 0.3 + 1).to(device, dtype) for _ in range(2))
    pos = torch.arange(1000, 1000 + T, device=device)  # past the first wavelengths: every angle matters
    inv = default_inv_freq(10_000.0, D) if inv_freq is None else inv_freq
    cos, sin = rope_from_positions(inv.to(device), pos, dtype)
    return qkv, qw, kw, cos, sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "n_heads, n_kv, D, k_eq_v, v_norm, qwen3",
    [
        (4, 2, 32, False, True, False),  # Gemma-4 sliding layer: GQA 2
        (4, 1, 64, True, True, False),  # Gemma-4 full layer: V = raw K, one KV head
        (4, 0, 32, False, True, False),  # a KV-shared layer: queries only
        (4, 2, 32, False, False, True),  # the drafter: Qwen3 norms, V as projected
    ],
)
def test_matches_the_eager_epilogue(device, dtype, n_heads, n_kv, D, k_eq_v, v_norm, qwen3):
    qkv, qw, kw, cos, sin = _case(device, dtype, 4, n_heads, n_kv, D, k_eq_v)
    kw_ = kw if n_kv else None
    out = rope.qkv_norm_rope(qkv, n_heads, n_kv, D, qw, kw_, cos, sin, EPS, k_eq_v=k_eq_v, v_norm=v_norm, qwen3=qwen3)
    ref = reference.qkv_norm_rope_reference(
        qkv, n_heads, n_kv, D, qw, kw_, cos, sin, EPS, k_eq_v=k_eq_v, v_norm=v_norm, qwen3=qwen3
    )
    for got, want in zip(out, ref):
        if want is None:
            assert got is None
        else:
            _close(got, want)
    if n_kv and not v_norm:
        assert out[2].data_ptr() == qkv[:, (n_heads + n_kv) * D :].data_ptr()  # a view: nothing copied


def _gemma4_attention(device, dtype, layer: int):
    from kakeya.verifier.torch_backend.gemma4 import Attention, Gemma4Args, rope_inv_freq

    args = Gemma4Args(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        global_head_dim=64,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        layer_types=["sliding_attention", "full_attention"],
        vocab_size=64,
        vocab_size_per_layer_input=64,
        hidden_size_per_layer_input=0,
    )
    attn = Attention(args, layer)
    g = torch.Generator().manual_seed(layer)
    for name, buf in attn.named_buffers():
        scale, shift = (buf.shape[-1] ** -0.5, 0.0) if buf.dim() == 2 else (0.3, 1.0)  # weights; norm scales near 1
        buf.copy_(torch.randn(buf.shape, generator=g) * scale + shift)
    attn.to(device, dtype)
    inv = rope_inv_freq(args.rope_parameters[args.layer_types[layer]], attn.head_dim)
    return attn, inv


@pytest.mark.parametrize("layer", [0, 1])  # sliding (default RoPE); full (k_eq_v, proportional partial RoPE)
def test_is_the_gemma4_attention_projection(device, layer):
    """The kernel on ``F.linear(x, wqkv)`` gives what ``Attention.project`` of the model gives."""
    attn, inv = _gemma4_attention(device, torch.bfloat16, layer)
    T = 4
    x = torch.randn(1, T, 64, generator=torch.Generator().manual_seed(7)).to(device, torch.bfloat16)
    cos, sin = rope_from_positions(inv.to(device), torch.arange(500, 500 + T, device=device), torch.bfloat16)
    q_ref, k_ref, v_ref = attn.project(x, cos[:, None, :], sin[:, None, :])
    q, k, v = rope.qkv_norm_rope(
        F.linear(x[0], attn.wqkv),
        attn.n_heads,
        attn.n_kv,
        attn.head_dim,
        attn.q_norm,
        attn.k_norm,
        cos,
        sin,
        attn.eps,
        k_eq_v=attn.k_eq_v,
    )
    for got, want in ((q, q_ref), (k, k_ref), (v, v_ref)):
        _close(got, want[0].transpose(0, 1))


def test_is_the_drafter_projection(device):
    """The DFlash drafter's fused ``Attention.qkv``: Qwen3 norms, RoPE, V as projected."""
    from kakeya.drafter.config import DFlashConfig
    from kakeya.drafter.torch_backend.model import Attention

    cfg = DFlashConfig(
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=64,
        vocab_size=64,
        rms_norm_eps=EPS,
        rope_theta=10_000.0,
        max_position_embeddings=4096,
        block_size=8,
        target_layer_ids=(0,),
        mask_token_id=1,
    )
    torch.manual_seed(3)
    attn = Attention(cfg, 0)
    with torch.no_grad():
        attn.q_norm.weight.normal_(1, 0.3)
        attn.k_norm.weight.normal_(1, 0.3)
    attn = attn.to(device, torch.bfloat16).requires_grad_(False)
    attn.fuse()
    T = 4
    h = torch.randn(1, T, 64).to(device, torch.bfloat16)
    cos, sin = rope_from_positions(
        default_inv_freq(10_000.0, 32).to(device), torch.arange(40, 40 + T, device=device), torch.bfloat16
    )
    q_ref, k_ref, v_ref = attn.qkv(h, cos, sin)
    q, k, v = rope.qkv_norm_rope(
        F.linear(h[0], attn.wqkv),
        4,
        2,
        32,
        attn.q_norm.weight,
        attn.k_norm.weight,
        cos,
        sin,
        EPS,
        v_norm=False,
        qwen3=True,
    )
    for got, want in ((q, q_ref), (k, k_ref), (v, v_ref)):
        _close(got, want[0].transpose(0, 1))


def test_writes_k_and_v_into_pool_rows(device):
    """``cache=``: K/V land in the pool rows given (a ring's slots), as the step's ``index_copy_`` puts them."""
    n_heads, n_kv, D, T = 2, 2, 32, 3
    qkv, qw, kw, cos, sin = _case(device, torch.bfloat16, T, n_heads, n_kv, D, False, seed=5)
    q_ref, k_ref, v_ref = rope.qkv_norm_rope(qkv, n_heads, n_kv, D, qw, kw, cos, sin, EPS)
    pool_k = torch.zeros(1, n_kv, 10, D, dtype=torch.bfloat16, device=device)  # the caches' [1, kv, slots, D]
    pool_v = torch.zeros_like(pool_k)
    rows = torch.tensor([7, 2, 9], device=device)
    q, k, v = rope.qkv_norm_rope(qkv, n_heads, n_kv, D, qw, kw, cos, sin, EPS, cache=(pool_k[0], pool_v[0], rows))
    assert torch.equal(q, q_ref) and k is None and v is None
    want_k = torch.zeros_like(pool_k).index_copy_(2, rows, k_ref.transpose(0, 1)[None])
    want_v = torch.zeros_like(pool_v).index_copy_(2, rows, v_ref.transpose(0, 1)[None])
    assert torch.equal(pool_k, want_k) and torch.equal(pool_v, want_v)


def test_bad_inputs_are_refused(device):
    qkv, qw, kw, cos, sin = _case(device, torch.bfloat16, 4, 4, 2, 32, False)
    with pytest.raises(ValueError, match="qkv must be"):
        rope.qkv_norm_rope(qkv, 4, 2, 32, qw, kw, cos, sin, EPS, k_eq_v=True)
    with pytest.raises(ValueError, match="cos/sin"):
        rope.qkv_norm_rope(qkv, 4, 2, 32, qw, kw, cos[:2], sin[:2], EPS)
    with pytest.raises(ValueError, match="k_weight"):
        rope.qkv_norm_rope(qkv, 4, 2, 32, qw, None, cos, sin, EPS)


@cuda_only
@pytest.mark.parametrize("n_kv, D, k_eq_v", [(8, 256, False), (2, 512, True)])  # 26B-A4B sliding / full layers
def test_real_shape_on_cuda(n_kv, D, k_eq_v):
    inv = default_inv_freq(1e6, D, n_pairs=D // 8) if k_eq_v else None
    if inv is not None:  # proportional partial RoPE: a quarter of the pairs rotate
        inv = torch.cat([inv, torch.zeros(D // 2 - inv.numel())])
    qkv, qw, kw, cos, sin = _case("cuda", torch.bfloat16, 16, 16, n_kv, D, k_eq_v, inv_freq=inv)
    out = rope.qkv_norm_rope(qkv, 16, n_kv, D, qw, kw, cos, sin, EPS, k_eq_v=k_eq_v)
    ref = reference.qkv_norm_rope_reference(qkv, 16, n_kv, D, qw, kw, cos, sin, EPS, k_eq_v=k_eq_v)
    for got, want in zip(out, ref):
        _close(got, want)
