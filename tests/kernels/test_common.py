"""The shared kernel helpers: rounding to bfloat16 and the float32 tanh / GELU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the kernels need triton (Linux only; no macOS wheels)")

import triton
import triton.language as tl

from kakeya.backends.torch.kernels import common


@triton.jit
def _round(x_ptr, y_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(y_ptr + offs, common.round_to(tl.load(x_ptr + offs), tl.bfloat16))


@triton.jit
def _tanh_gelu(x_ptr, tanh_ptr, gelu_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    tl.store(tanh_ptr + offs, common.tanh(x))
    tl.store(gelu_ptr + offs, common.gelu_tanh(x))


def test_round_to_bfloat16_is_torch_cast_bit_for_bit(device):
    """Nearest even, ties included, overflow to inf, subnormals, signed zeros, NaN stays NaN (the
    interpreter's own cast truncates; this is what a GPU's cast gives)."""
    special = [float("nan"), float("inf"), -float("inf"), 3.3895e38, 0.0, -0.0, 1e-40, -3e-39, 1 + 2**-8, 1 + 3 * 2**-8]
    x = torch.cat(
        [torch.randn(4096 - len(special), generator=torch.Generator().manual_seed(0)) * 10, torch.tensor(special)]
    ).to(device)
    y = torch.empty(x.shape, dtype=torch.bfloat16, device=device)
    _round[(1,)](x, y, N=x.numel())
    y = y.cpu()
    ref = x.cpu().bfloat16()
    assert torch.equal(y.isnan(), ref.isnan())
    assert torch.equal(y[~ref.isnan()].view(torch.int16), ref[~ref.isnan()].view(torch.int16))


def test_tanh_and_gelu_within_a_float32_rounding_of_torch(device):
    """No tanh in triton.language: from exp, within ~1e-7 of torch's, absolutely (GELU's 1 + tanh
    keeps that absolute)."""
    x = torch.linspace(-12, 12, 4096, device=device)
    t, g = torch.empty_like(x), torch.empty_like(x)
    _tanh_gelu[(1,)](x, t, g, N=x.numel())
    torch.testing.assert_close(t, torch.tanh(x), rtol=0, atol=2.5e-7)
    torch.testing.assert_close(g, torch.nn.functional.gelu(x, approximate="tanh"), rtol=2.5e-7, atol=1.5e-6)
    assert torch.equal(t[x.abs() > 9.1].abs(), torch.ones_like(t[x.abs() > 9.1]))  # saturates like float32 tanh


def test_launch_checks(device):
    with pytest.raises(ValueError, match="unsupported dtype"):
        common.tl_dtype(torch.zeros(1, dtype=torch.float64))
    with pytest.raises(ValueError, match="several devices"):
        common.check_device(torch.zeros(1, device=device), torch.zeros(1, device="meta"))
