"""MoE kernels against the model's own ``MoE`` (``verifier/torch_backend/gemma4.py``).

The routing: the same experts (no near-ties in these draws), weights within a few float32 ulps
(the softmax's sums in another order). The experts, bfloat16: bit-exact but where a float32 GEMM
sum, accumulated in another order, lands on the other side of a rounding boundary (one step at the
row's scale; none in these draws). float32: a few ulps at the row's scale (the GEMM sums, and GELU's
tanh from exp).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from .conftest import cuda_only
from .numerics import assert_within_steps

pytest.importorskip("triton", reason="the kernels need triton (Linux only; no macOS wheels)")

from kakeya.backends.torch.kernels import moe
from kakeya.verifier.torch_backend.gemma4 import Gemma4Args, MoE


def _model_moe(device, dtype, E, k, hidden=64, mi=32, seed=0):
    args = Gemma4Args(
        hidden_size=hidden,
        num_hidden_layers=1,
        enable_moe_block=True,
        num_experts=E,
        top_k_experts=k,
        moe_intermediate_size=mi,
        vocab_size=64,
        vocab_size_per_layer_input=64,
        hidden_size_per_layer_input=0,
    )
    m = MoE(args)
    g = torch.Generator().manual_seed(seed)
    for _, b in m.named_buffers():
        b.copy_(torch.randn(b.shape, generator=g) * (b.shape[-1] ** -0.5 if b.dim() == 3 else 0.5) + (b.dim() < 3))
    return m.to(device, dtype)


def _router_logits(m: MoE, x: torch.Tensor) -> torch.Tensor:
    """What ``MoE.route`` feeds its softmax (the router GEMM stays a GEMM)."""
    r = F.rms_norm(x, (x.shape[-1],), None, m.eps) * (m.router_scale * m.root).to(x.dtype)
    return F.linear(r, m.router_proj)


def _close(actual, expected):
    if expected.dtype == torch.float32:
        assert_within_steps(actual, expected, 8, row_scale=True)
    else:
        assert_within_steps(actual, expected, 1, exact_at_least=0.99, row_scale=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T, E, k", [(1, 8, 2), (16, 16, 4), (3, 128, 8)])  # the last: 26B-A4B's router width
def test_route_is_the_model_router(device, dtype, T, E, k):
    m = _model_moe(device, dtype, E, k, seed=E)
    x = torch.randn(T, 64, generator=torch.Generator().manual_seed(T)).to(device, dtype)
    idx_ref, w_ref = m.route(x)
    idx, w = moe.route(_router_logits(m, x), k, m.per_expert_scale)
    assert torch.equal(idx, idx_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=0)
    assert w.dtype == torch.float32 and idx.dtype == torch.int64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T, E, k", [(1, 8, 2), (8, 8, 2), (16, 16, 4)])  # a verify of 1 / 8 / 16 rows
def test_experts_are_the_model_experts(device, dtype, T, E, k):
    m = _model_moe(device, dtype, E, k, seed=T)
    x = torch.randn(T, 64, generator=torch.Generator().manual_seed(T + 1)).to(device, dtype)
    idx, w = m.route(x)
    out = moe.experts(x, idx, w, m.gate_up, m.down)
    assert out.shape == x.shape and out.dtype == dtype
    _close(out, m.experts(x, idx, w))
    _close(out, moe.experts_reference(x, idx, w, m.gate_up, m.down))


def test_experts_no_row_chose_are_never_read(device):
    """NaN in the weights of every expert no row routes to, and uneven routing (one expert taken by
    every row, others by one or none): the output is the one clean weights give."""
    dtype, E, k, T = torch.bfloat16, 16, 2, 8
    m = _model_moe(device, dtype, E, k, seed=4)
    x = torch.randn(T, 64, generator=torch.Generator().manual_seed(5)).to(device, dtype)
    idx = torch.stack([torch.full((T,), 3), torch.tensor([0, 5, 9, 5, 12, 0, 7, 9])], dim=1).to(device)
    w = torch.rand(T, k, generator=torch.Generator().manual_seed(6)).to(device)
    unused = sorted(set(range(E)) - set(idx.flatten().tolist()))
    assert len(unused) == 10
    gate_up, down = m.gate_up.clone(), m.down.clone()
    gate_up[unused], down[unused] = float("nan"), float("nan")
    out = moe.experts(x, idx, w, gate_up, down)
    assert not out.isnan().any()
    assert torch.equal(out, moe.experts(x, idx, w, m.gate_up, m.down))
    _close(out, m.experts(x, idx, w))


def test_bad_inputs_are_refused(device):
    m = _model_moe(device, torch.bfloat16, 8, 2)
    x = torch.randn(4, 64).to(device, torch.bfloat16)
    idx, w = m.route(x)
    with pytest.raises(ValueError, match="rows"):
        moe.experts(x.repeat(17, 1), idx.repeat(17, 1), w.repeat(17, 1), m.gate_up, m.down)
    with pytest.raises(ValueError, match="float32"):
        moe.experts(x, idx, w.bfloat16(), m.gate_up, m.down)
    with pytest.raises(ValueError, match="gate_up"):
        moe.experts(x, idx, w, m.gate_up[:, :40], m.down)
    with pytest.raises(ValueError, match="top_k"):
        moe.route(_router_logits(m, x), 9, m.per_expert_scale)


@cuda_only
@pytest.mark.parametrize("T", [1, 16])
def test_real_shape_on_cuda(T):
    """gemma-4-26B-A4B's MoE (128 experts, top 8, 704 wide, hidden 2816), bf16, against the
    reference's float32 sum (CUDA's own index_add_ rounds each term, in no fixed order)."""
    m = _model_moe("cuda", torch.bfloat16, 128, 8, hidden=2816, mi=704)
    x = torch.randn(T, 2816, device="cuda").bfloat16()
    idx, w = moe.route(_router_logits(m, x), 8, m.per_expert_scale)
    idx_ref, w_ref = m.route(x)
    assert torch.equal(idx, idx_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=0)
    _close(moe.experts(x, idx, w, m.gate_up, m.down), moe.experts_reference(x, idx, w, m.gate_up, m.down))
