"""RMSNorm kernels against the model's own norms (``backends/torch/ops.py``).

bfloat16 (and float16): bit-exact, but for an element whose float32 value lies so near a rounding
boundary that the sum of squares, accumulated in another order (and torch's own rsqrt), puts it
on the other side -- one step, rarely (none in these draws at most sizes). float32 rounds nothing
away, so those last-bit differences show: a few ulps at the row's scale (a residual add that
cancels makes the sum small, not the difference larger).
"""

from __future__ import annotations

import pytest
import torch

from . import reference
from .conftest import cuda_only
from .numerics import assert_within_steps

pytest.importorskip("triton", reason="the kernels need triton (Linux only; no macOS wheels)")

from kakeya.backends.torch.kernels import norm

EPS = 1e-6
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _close(actual, expected):
    if expected.dtype == torch.float32:
        assert_within_steps(actual, expected, 4, row_scale=True)
    else:
        assert_within_steps(actual, expected, 1, exact_at_least=0.99)


def _inputs(device, dtype, rows, H, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, H, generator=g) * 3).to(device, dtype)
    branch = torch.randn(rows, H, generator=g).to(device, dtype)
    w = (torch.randn(H, generator=g) * 0.5 + 1).to(device, dtype)
    bw = (torch.randn(H, generator=g) * 0.5 + 1).to(device, dtype)
    return x, branch, w, bw


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H", [64, 48])  # 48: the block is wider than the row (masked lanes)
@pytest.mark.parametrize("qwen3", [False, True])
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm_matches_the_model_norm(device, dtype, H, qwen3, weighted):
    x, _, w, _ = _inputs(device, dtype, 24, H)
    w = w if weighted else None
    y = norm.rms_norm(x, w, EPS, qwen3=qwen3)
    assert y.shape == x.shape and y.dtype == dtype
    _close(y, reference.rms_norm_reference(x, w, EPS, qwen3=qwen3))


def test_the_two_conventions_differ_in_bf16_and_each_kernel_follows_its_own(device):
    """Gemma-4 rounds once, Qwen3 rounds the normalised row before the weight: in bf16 they differ
    in many elements, so the bit-exact share above is what tells a kernel's convention."""
    x, _, w, _ = _inputs(device, torch.bfloat16, 16, 64, seed=3)
    gemma, qwen = (reference.rms_norm_reference(x, w, EPS, qwen3=q) for q in (False, True))
    assert (gemma != qwen).double().mean() > 0.05
    for qwen3, own, other in ((False, gemma, qwen), (True, qwen, gemma)):
        y = norm.rms_norm(x, w, EPS, qwen3=qwen3)
        assert (y == own).double().mean() >= 0.99 and (y == other).double().mean() < 0.95


def test_leading_axes_and_strided_rows(device):
    x, _, w, _ = _inputs(device, torch.bfloat16, 12, 64)
    x3 = x.view(3, 4, 64)
    assert torch.equal(norm.rms_norm(x3, w, EPS), norm.rms_norm(x, w, EPS).view(3, 4, 64))
    wide = torch.cat([x, x], dim=-1)[:, :64]  # rows 128 apart
    assert torch.equal(norm.rms_norm(wide, w, EPS), norm.rms_norm(x, w, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H", [64, 48])
def test_gemma4_sandwich_residual_with_layer_scalar(device, dtype, H):
    """``h = (x + norm(a; w_a)) * layer_scalar``, then ``norm(h; w)``: the end of a Gemma-4 layer and
    the next layer's input norm in one kernel."""
    x, a, w, bw = _inputs(device, dtype, 16, H, seed=1)
    scale = torch.tensor([0.7], dtype=dtype, device=device)
    for s in (None, scale):
        h, y = norm.add_rms_norm(x, a, w, EPS, branch_weight=bw, scale=s)
        h_ref, y_ref = reference.add_rms_norm_reference(x, a, w, EPS, branch_weight=bw, scale=s)
        _close(h, h_ref)
        _close(y, y_ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_qwen3_residual_add_then_norm(device, dtype):
    """The drafter's pre-norm residual: ``h = x + a`` as is, then its Qwen3 norm."""
    x, a, w, _ = _inputs(device, dtype, 16, 64, seed=2)
    h, y = norm.add_rms_norm(x, a, w, EPS, qwen3=True)
    h_ref, y_ref = reference.add_rms_norm_reference(x, a, w, EPS, qwen3=True)
    assert torch.equal(h, h_ref)  # one rounded add: exact
    _close(y, y_ref)


def test_a_weightless_output_norm(device):
    x, a, _, bw = _inputs(device, torch.bfloat16, 8, 64)
    h, y = norm.add_rms_norm(x, a, None, EPS, branch_weight=bw)
    _close(y, reference.rms_norm_reference(h, None, EPS))


def test_bad_inputs_are_refused(device):
    x, a, w, _ = _inputs(device, torch.bfloat16, 4, 64)
    with pytest.raises(ValueError, match="weight"):
        norm.rms_norm(x, w[:32], EPS)
    with pytest.raises(ValueError, match="branch"):
        norm.add_rms_norm(x, a.float(), w, EPS)
    with pytest.raises(ValueError, match="one element"):
        norm.add_rms_norm(x, a, w, EPS, scale=w)
    with pytest.raises(ValueError, match="unsupported dtype"):
        norm.rms_norm(x.double(), None, EPS)


@cuda_only
@pytest.mark.parametrize("qwen3", [False, True])
def test_real_shape_on_cuda(qwen3):
    """gemma-4-26B-A4B's hidden size, a verify of 16 rows, bf16."""
    x, a, w, bw = _inputs("cuda", torch.bfloat16, 16, 2816)
    h, y = norm.add_rms_norm(x, a, w, EPS, branch_weight=None if qwen3 else bw, qwen3=qwen3)
    h_ref, y_ref = reference.add_rms_norm_reference(x, a, w, EPS, branch_weight=None if qwen3 else bw, qwen3=qwen3)
    _close(h, h_ref)
    _close(y, y_ref)
