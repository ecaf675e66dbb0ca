"""The MoE block of a few rows: the router's top-k, then every routed expert once for all the rows that chose it (each
expert's weights read once per call, the expert-union floor), in two kernels and no host sync.

Semantics of Gemma-4's ``MoE`` (``verifier/torch_backend/gemma4.py``): float32 router softmax, top ``k`` renormalised,
times the per-expert scale; each expert's fused ``gate_up`` ``[2 * mi, h]``, tanh-GELU GeGLU, ``down`` ``[h, mi]``; each
row's weighted outputs summed in float32 in ascending expert order and rounded once.

* :func:`route`: one program per row over the router logits.
* :func:`experts`: ``_gate_up_kernel`` (one program per routed expert and slice of ``mi``, for every row that chose it),
  then ``_down_kernel`` (one program per slice of ``h``, experts in ascending order: deterministic, no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kakeya.backends.torch.kernels import common
from kakeya.backends.torch.kernels.common import gelu_tanh, round_to, rounded, tl_dtype

MAX_ROWS = 64  # rows per call: beyond a few verifies' worth, the grouped GEMM is the better kernel


@triton.jit
def _route_kernel(
    logits_ptr, scale_ptr, idx_ptr, w_ptr, row_stride, E, K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr
):
    t = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + t * row_stride + e, mask=e < E, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)
    s = tl.arange(0, BLOCK_K)
    top_p = tl.zeros([BLOCK_K], tl.float32)
    top_i = tl.zeros([BLOCK_K], tl.int32)
    for j in range(K):  # the k largest, largest first (the lowest index of equals first)
        i = tl.argmax(p, axis=0)
        top_p = tl.where(s == j, tl.max(p, axis=0), top_p)
        top_i = tl.where(s == j, i, top_i)
        p = tl.where(e == i, -1.0, p)
    scale = tl.load(scale_ptr + top_i, mask=s < K, other=0.0).to(tl.float32)
    w = top_p / tl.sum(top_p, axis=0) * scale
    tl.store(idx_ptr + t * K + s, top_i.to(tl.int64), mask=s < K)
    tl.store(w_ptr + t * K + s, w, mask=s < K)


@triton.jit
def _choices(idx_ptr, T, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    """The routed experts ``[BLOCK_T, BLOCK_K]`` (-1 past the rows) and each pair's flat index."""
    t = tl.arange(0, BLOCK_T)
    s = tl.arange(0, BLOCK_K)
    pair = t[:, None] * K + s[None, :]
    ids = tl.load(idx_ptr + pair, mask=(t < T)[:, None] & (s < K)[None, :], other=-1)
    return t, s, pair, ids


@triton.jit
def _gate_up_kernel(
    x_ptr, idx_ptr, gu_ptr, act_ptr, T, H, MI, x_row, gu_e, gu_r, act_row,
    K: tl.constexpr, DTYPE: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    p = tl.program_id(0)
    t, s, pair, ids = _choices(idx_ptr, T, K, BLOCK_T, BLOCK_K)
    e = tl.load(idx_ptr + p)
    named = ids == e
    first = tl.min(tl.min(tl.where(named, pair, BLOCK_T * BLOCK_K), axis=1), axis=0)
    if first == p:  # else an earlier pair does this expert
        hit = tl.max(named.to(tl.int32), axis=1) > 0  # rows that chose e
        slot = tl.sum(tl.where(named, s[None, :], 0), axis=1)
        i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        i_ok = i < MI
        gate = tl.zeros([BLOCK_T, BLOCK_I], tl.float32)
        up = tl.zeros([BLOCK_T, BLOCK_I], tl.float32)
        w_base = gu_ptr + e.to(tl.int64) * gu_e
        for h0 in range(0, H, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            h_ok = h < H
            x = tl.load(x_ptr + t[:, None] * x_row + h[None, :], mask=hit[:, None] & h_ok[None, :], other=0.0)
            w_ok = i_ok[:, None] & h_ok[None, :]
            wg = tl.load(w_base + i[:, None] * gu_r + h[None, :], mask=w_ok, other=0.0)
            wu = tl.load(w_base + (MI + i)[:, None] * gu_r + h[None, :], mask=w_ok, other=0.0)
            x = x.to(DOT)
            gate += tl.dot(x, tl.trans(wg.to(DOT)), input_precision=PRECISION)
            up += tl.dot(x, tl.trans(wu.to(DOT)), input_precision=PRECISION)
        gate, up = rounded(gate, DTYPE), rounded(up, DTYPE)
        act = rounded(gelu_tanh(gate), DTYPE) * up
        tl.store(
            act_ptr + (t * K + slot)[:, None] * act_row + i[None, :],
            round_to(act, DTYPE),
            mask=hit[:, None] & i_ok[None, :],
        )


@triton.jit
def _down_kernel(
    act_ptr, idx_ptr, w_ptr, down_ptr, out_ptr, T, E, H, MI, act_row, d_e, d_r, out_row,
    K: tl.constexpr, DTYPE: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    t, s, pair, ids = _choices(idx_ptr, T, K, BLOCK_T, BLOCK_K)
    weights = tl.load(w_ptr + pair, mask=ids >= 0, other=0.0)
    h = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < H
    out = tl.zeros([BLOCK_T, BLOCK_H], tl.float32)
    for e in range(E):  # ascending: each row's terms add in the eager order
        named = ids == e
        hit = tl.max(named.to(tl.int32), axis=1) > 0
        if tl.max(hit.to(tl.int32), axis=0) > 0:
            slot = tl.sum(tl.where(named, s[None, :], 0), axis=1)
            weight = rounded(tl.sum(tl.where(named, weights, 0.0), axis=1), DTYPE)
            y = tl.zeros([BLOCK_T, BLOCK_H], tl.float32)
            for i0 in range(0, MI, BLOCK_I):
                i = i0 + tl.arange(0, BLOCK_I)
                i_ok = i < MI
                a = tl.load(
                    act_ptr + (t * K + slot)[:, None] * act_row + i[None, :],
                    mask=hit[:, None] & i_ok[None, :],
                    other=0.0,
                )
                wd = tl.load(down_ptr + h[:, None] * d_r + i[None, :], mask=h_ok[:, None] & i_ok[None, :], other=0.0)
                y += tl.dot(a.to(DOT), tl.trans(wd.to(DOT)), input_precision=PRECISION)
            out += tl.where(hit[:, None], rounded(rounded(y, DTYPE) * weight[:, None], DTYPE), 0.0)
        down_ptr += d_e  # expert e + 1 (a 64-bit pointer step: no 32-bit e * d_e to overflow)
    tl.store(out_ptr + t[:, None] * out_row + h[None, :], round_to(out, DTYPE), mask=(t < T)[:, None] & h_ok[None, :])


def route(logits: torch.Tensor, top_k: int, per_expert_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(idx [T, k] int64, weights [T, k] float32)`` from router logits ``[T, E]`` (the router's
    GEMM output, any float dtype): the ``k`` most probable experts, largest first."""
    common.check_device(logits, per_expert_scale)
    T, E = logits.shape
    if per_expert_scale.shape != (E,) or logits.stride(1) != 1 or not 1 <= top_k <= E:
        raise ValueError(
            f"logits [T, {E}] (unit column stride), per_expert_scale [{E}], 1 <= top_k <= {E}; got "
            f"{tuple(logits.shape)}, {tuple(per_expert_scale.shape)}, top_k={top_k}"
        )
    idx = torch.empty((T, top_k), dtype=torch.int64, device=logits.device)
    w = torch.empty((T, top_k), dtype=torch.float32, device=logits.device)
    _route_kernel[(T,)](
        logits, per_expert_scale, idx, w, logits.stride(0), E,
        K=top_k, BLOCK_E=triton.next_power_of_2(E), BLOCK_K=triton.next_power_of_2(top_k),
    )  # fmt: skip
    return idx, w


def experts(
    x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """The routed experts' weighted sum ``[T, h]`` for rows ``x`` ``[T, h]`` routed by ``idx``/``weights``
    ``[T, k]`` (:func:`route`), with ``gate_up`` ``[E, 2 * mi, h]`` and ``down`` ``[E, h, mi]``."""
    common.check_device(x, idx, weights, gate_up, down)
    dtype = tl_dtype(x)
    T, H = x.shape
    E, two_mi, _ = gate_up.shape
    MI = two_mi // 2
    K = idx.shape[1]
    if not 1 <= T <= MAX_ROWS:
        raise ValueError(f"{T} rows: this kernel takes 1..{MAX_ROWS} (more rows want the grouped GEMM)")
    if gate_up.shape != (E, 2 * MI, H) or down.shape != (E, H, MI) or gate_up.dtype != x.dtype or down.dtype != x.dtype:
        raise ValueError(
            f"gate_up must be [E, 2 * mi, {H}] and down [E, {H}, mi] in {x.dtype}, got "
            f"{tuple(gate_up.shape)} {gate_up.dtype}, {tuple(down.shape)} {down.dtype}"
        )
    if idx.shape != (T, K) or weights.shape != (T, K) or weights.dtype != torch.float32 or idx.dtype.is_floating_point:
        raise ValueError(
            f"idx (integer) and weights (float32) must be [{T}, k], got {tuple(idx.shape)} {idx.dtype}, "
            f"{tuple(weights.shape)} {weights.dtype}"
        )
    rows_ok = x.stride(1) == 1 and gate_up.stride(2) == 1 and down.stride(2) == 1
    if not (idx.is_contiguous() and weights.is_contiguous() and rows_ok):
        raise ValueError("idx and weights must be contiguous; x, gate_up and down need unit stride along their rows")
    act = torch.empty((T * K, MI), dtype=x.dtype, device=x.device)  # each (row, choice) pair's GeGLU output
    out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    blocks = dict(K=K, DTYPE=dtype, DOT=common.dot_dtype(x), PRECISION=common.dot_precision(x), BLOCK_I=64)
    blocks |= dict(BLOCK_T=max(16, triton.next_power_of_2(T)), BLOCK_K=triton.next_power_of_2(K), BLOCK_H=64)
    _gate_up_kernel[(T * K, triton.cdiv(MI, 64))](
        x, idx, gate_up, act, T, H, MI, x.stride(0), gate_up.stride(0), gate_up.stride(1), act.stride(0), **blocks
    )
    blocks["BLOCK_H"] = DOWN_BLOCK_H
    _down_kernel[(triton.cdiv(H, DOWN_BLOCK_H),)](
        act, idx, weights, down, out, T, E, H, MI, act.stride(0), down.stride(0), down.stride(1), out.stride(0),
        **blocks,
    )  # fmt: skip
    return out


DOWN_BLOCK_H = 32  # h columns per down-projection program: enough programs to stream every expert's down rows at once
