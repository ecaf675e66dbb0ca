"""RMSNorm, alone or fused with the residual add before it: one kernel, one read of each row.

The two conventions of ``backends/torch/ops.py``: Gemma-4 multiplies by the weight in float32 and rounds once; Qwen3
(``qwen3=True``: the drafter's layers, and Gemma-4's router input) rounds the normalised row first and multiplies in the
activation dtype. ``weight=None`` is the scale-free norm.

:func:`add_rms_norm` is a decoder layer's residual step: ``h = residual + branch`` (the branch normed first with
``branch_weight``, the sum times ``scale``) and the next norm of ``h``, rounding wherever the eager ops round.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kakeya.backends.torch.kernels import common
from kakeya.backends.torch.kernels.common import rounded, tl_dtype


@triton.jit
def _normed(x, w_ptr, offs, mask, H, eps, HAS_WEIGHT: tl.constexpr, QWEN3: tl.constexpr, DTYPE: tl.constexpr):
    """float32 row ``x`` normalised (and weighted), rounded to ``DTYPE`` where eager rounds."""
    r = tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)
    y = x * r
    if HAS_WEIGHT:
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if QWEN3:
            y = rounded(y, DTYPE) * w
        else:
            y = y * w
    return rounded(y, DTYPE)


@triton.jit
def _row(ptr, stride, H, BLOCK: tl.constexpr):
    """This program's row of ``ptr`` (rows ``stride`` apart) in float32, with its offsets and mask."""
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    return tl.load(ptr + tl.program_id(0) * stride + offs, mask=mask, other=0.0).to(tl.float32), offs, mask


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, y_ptr, x_row, y_row, H, eps,
    HAS_WEIGHT: tl.constexpr, QWEN3: tl.constexpr, DTYPE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    x, offs, mask = _row(x_ptr, x_row, H, BLOCK)
    y = _normed(x, w_ptr, offs, mask, H, eps, HAS_WEIGHT, QWEN3, DTYPE)
    tl.store(y_ptr + tl.program_id(0) * y_row + offs, y.to(DTYPE), mask=mask)


@triton.jit
def _add_rms_norm_kernel(
    res_ptr, b_ptr, bw_ptr, s_ptr, w_ptr, h_ptr, y_ptr, res_row, b_row, out_row, H, eps,
    NORM_BRANCH: tl.constexpr, HAS_SCALE: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, QWEN3: tl.constexpr, DTYPE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    res, offs, mask = _row(res_ptr, res_row, H, BLOCK)
    branch, _, _ = _row(b_ptr, b_row, H, BLOCK)
    row = tl.program_id(0)
    if NORM_BRANCH:
        branch = _normed(branch, bw_ptr, offs, mask, H, eps, True, QWEN3, DTYPE)
    h = rounded(res + branch, DTYPE)
    if HAS_SCALE:
        h = rounded(h * rounded(tl.load(s_ptr).to(tl.float32), DTYPE), DTYPE)
    tl.store(h_ptr + row * out_row + offs, h.to(DTYPE), mask=mask)
    y = _normed(h, w_ptr, offs, mask, H, eps, HAS_WEIGHT, QWEN3, DTYPE)
    tl.store(y_ptr + row * out_row + offs, y.to(DTYPE), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as rows ``[T, H]`` with unit stride along H (a view when it can be)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _check_weight(w: torch.Tensor | None, H: int, name: str) -> None:
    if w is not None and (w.dim() != 1 or w.shape[0] != H or w.stride(0) != 1):
        raise ValueError(f"{name} must be a contiguous [{H}] vector, got shape {tuple(w.shape)}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, *, qwen3: bool = False) -> torch.Tensor:
    """RMSNorm of ``x``'s last axis (any leading shape), in ``x``'s dtype."""
    common.check_device(x, weight)
    dtype = tl_dtype(x)
    H = x.shape[-1]
    _check_weight(weight, H, "weight")
    rows = _rows(x)
    y = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    _rms_norm_kernel[(rows.shape[0],)](
        rows, weight, y, rows.stride(0), y.stride(0), H, eps,
        HAS_WEIGHT=weight is not None, QWEN3=qwen3, DTYPE=dtype, BLOCK=triton.next_power_of_2(H),
    )  # fmt: skip
    return y.view(x.shape)


def add_rms_norm(
    residual: torch.Tensor,
    branch: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    *,
    branch_weight: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    qwen3: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, rms_norm(h, weight))`` with ``h = (residual + branch) * scale``: ``branch`` is normed by
    ``branch_weight`` first when one is given (Gemma-4's sandwich), ``scale`` is a one-element
    tensor (Gemma-4's ``layer_scalar``) or None."""
    common.check_device(residual, branch, weight, branch_weight, scale)
    dtype = tl_dtype(residual)
    if branch.shape != residual.shape or branch.dtype != residual.dtype:
        raise ValueError(
            f"branch {tuple(branch.shape)} {branch.dtype} is not like residual {tuple(residual.shape)} {residual.dtype}"
        )
    H = residual.shape[-1]
    _check_weight(weight, H, "weight")
    _check_weight(branch_weight, H, "branch_weight")
    if scale is not None and scale.numel() != 1:
        raise ValueError(f"scale must hold one element, got shape {tuple(scale.shape)}")
    res, b = _rows(residual), _rows(branch)
    h = torch.empty(res.shape, dtype=residual.dtype, device=residual.device)
    y = torch.empty_like(h)
    _add_rms_norm_kernel[(res.shape[0],)](
        res, b, branch_weight, scale, weight, h, y, res.stride(0), b.stride(0), h.stride(0), H, eps,
        NORM_BRANCH=branch_weight is not None, HAS_SCALE=scale is not None,
        HAS_WEIGHT=weight is not None, QWEN3=qwen3, DTYPE=dtype, BLOCK=triton.next_power_of_2(H),
    )  # fmt: skip
    return h.view(residual.shape), y.view(residual.shape)
