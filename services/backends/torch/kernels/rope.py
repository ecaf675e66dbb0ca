"""The q/k/v epilogue of an attention layer's fused projection: per-head RMSNorm of q and k, RoPE (half-split pairs),
and V's own norm, in one kernel over the projection's rows.

Gemma-4: ``q = rope(norm(q; q_norm))``, ``k = rope(norm(k; k_norm))``, ``v = norm(v)`` without a weight. The DFlash
drafter (``qwen3=True, v_norm=False``): Qwen3 norms, V as projected. ``cos``/``sin`` are ``[T, head_dim]`` tables from
``ops.rope_from_positions``, so Gemma-4's partial RoPE is in the tables (cos 1, sin 0 past the rotated pairs).

``cache=(k_pool, v_pool, rows)`` writes K and V straight into a K/V pool (row ``rows[t]`` for projection row ``t``)
instead of returning them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kakeya.backends.torch.kernels import common
from kakeya.backends.torch.kernels.common import round_to, rounded, tl_dtype


@triton.jit
def _load_halves(ptr, offs, mask, HALF):
    lo = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)
    hi = tl.load(ptr + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    return lo, hi


@triton.jit
def _norm_halves(
    lo, hi, w_ptr, offs, mask, HALF, eps, HAS_WEIGHT: tl.constexpr, QWEN3: tl.constexpr, DTYPE: tl.constexpr
):
    """RMSNorm of a head split in its two halves, rounded where eager rounds (``kernels/norm.py``)."""
    r = tl.rsqrt((tl.sum(lo * lo, axis=0) + tl.sum(hi * hi, axis=0)) / (2 * HALF) + eps)
    lo, hi = lo * r, hi * r
    if HAS_WEIGHT:
        w_lo, w_hi = _load_halves(w_ptr, offs, mask, HALF)
        if QWEN3:
            lo, hi = rounded(lo, DTYPE), rounded(hi, DTYPE)
        lo, hi = lo * w_lo, hi * w_hi
    return rounded(lo, DTYPE), rounded(hi, DTYPE)


@triton.jit
def _rope_halves(lo, hi, cos_ptr, sin_ptr, offs, mask, HALF, DTYPE: tl.constexpr):
    """``x * cos + rotate_half(x) * sin`` with each op rounded, as eager ``apply_rope`` does."""
    c_lo, c_hi = _load_halves(cos_ptr, offs, mask, HALF)
    s_lo, s_hi = _load_halves(sin_ptr, offs, mask, HALF)
    out_lo = rounded(rounded(lo * c_lo, DTYPE) - rounded(hi * s_lo, DTYPE), DTYPE)
    out_hi = rounded(rounded(hi * c_hi, DTYPE) + rounded(lo * s_hi, DTYPE), DTYPE)
    return out_lo, out_hi


@triton.jit
def _store_halves(ptr, lo, hi, offs, mask, HALF, DTYPE: tl.constexpr):
    tl.store(ptr + offs, round_to(lo, DTYPE), mask=mask)
    tl.store(ptr + HALF + offs, round_to(hi, DTYPE), mask=mask)


@triton.jit
def _qkv_kernel(
    qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, rows_ptr,
    qkv_row, cs_row, q_row, kv_row, kv_head, eps, N_HEADS, HALF,
    V_OFFSET: tl.constexpr, V_NORM: tl.constexpr, WRITE_V: tl.constexpr, QWEN3: tl.constexpr,
    TO_POOL: tl.constexpr, HAS_KV: tl.constexpr, DTYPE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    head = tl.program_id(1)  # query heads first, then KV heads
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    D = 2 * HALF
    src = qkv_ptr + t * qkv_row + head * D
    cos_ptr += t * cs_row
    sin_ptr += t * cs_row
    lo, hi = _load_halves(src, offs, mask, HALF)
    if head < N_HEADS:
        lo, hi = _norm_halves(lo, hi, qw_ptr, offs, mask, HALF, eps, True, QWEN3, DTYPE)
        lo, hi = _rope_halves(lo, hi, cos_ptr, sin_ptr, offs, mask, HALF, DTYPE)
        _store_halves(q_ptr + t * q_row + head * D, lo, hi, offs, mask, HALF, DTYPE)
    elif HAS_KV:
        # A constexpr, so a KV-shared layer's (n_kv=0) kernel has no K/V branch: the compiler
        # traces a branch no program takes (the interpreter does not), and kw_ptr is None there.
        j = (head - N_HEADS).to(tl.int64)  # 64-bit offsets: a shared pool may be large
        dst = t * kv_row + j * kv_head  # row t of the outputs, or pool row rows[t]
        if TO_POOL:
            dst = tl.load(rows_ptr + t).to(tl.int64) * kv_row + j * kv_head
        k_lo, k_hi = _norm_halves(lo, hi, kw_ptr, offs, mask, HALF, eps, True, QWEN3, DTYPE)
        k_lo, k_hi = _rope_halves(k_lo, k_hi, cos_ptr, sin_ptr, offs, mask, HALF, DTYPE)
        _store_halves(k_ptr + dst, k_lo, k_hi, offs, mask, HALF, DTYPE)
        if WRITE_V:
            if V_OFFSET != 0:  # else k_eq_v: V is this head's raw K projection, already loaded
                lo, hi = _load_halves(src + V_OFFSET, offs, mask, HALF)
            if V_NORM:
                lo, hi = _norm_halves(lo, hi, kw_ptr, offs, mask, HALF, eps, False, QWEN3, DTYPE)
            _store_halves(v_ptr + dst, lo, hi, offs, mask, HALF, DTYPE)


def qkv_norm_rope(
    qkv: torch.Tensor,
    n_heads: int,
    n_kv: int,
    head_dim: int,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    *,
    k_eq_v: bool = False,
    v_norm: bool = True,
    qwen3: bool = False,
    cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
):
    """``(q [T, n_heads, D], k [T, n_kv, D], v [T, n_kv, D])`` from the fused projection ``qkv`` ``[T,
    (n_heads + n_kv * (1 if k_eq_v else 2)) * D]``; ``n_kv=0``: queries only (a KV-shared layer),
    ``k`` and ``v`` None. Without ``v_norm`` (and ``cache``), ``v`` is a view of ``qkv``. With
    ``cache``, K and V go into the pool rows and are returned as None."""
    common.check_device(qkv, q_weight, k_weight, cos, sin, *(cache or ()))
    dtype = tl_dtype(qkv)
    T, D = qkv.shape[0], head_dim
    q_cols, k_cols = n_heads * D, n_kv * D
    v_cols = 0 if k_eq_v else k_cols
    if qkv.dim() != 2 or qkv.shape[1] != q_cols + k_cols + v_cols or qkv.stride(1) != 1:
        raise ValueError(f"qkv must be [T, {q_cols + k_cols + v_cols}] with unit column stride, got {tuple(qkv.shape)}")
    if D % 2:
        raise ValueError(f"head_dim must be even, got {D}")
    cos, sin = cos.reshape(-1, D), sin.reshape(-1, D)
    if cos.shape != (T, D) or sin.shape != (T, D) or cos.stride() != sin.stride() or cos.stride(1) != 1:
        raise ValueError(f"cos/sin must be [{T}, {D}] tables alike, got {tuple(cos.shape)} / {tuple(sin.shape)}")
    if n_kv and k_weight is None:
        raise ValueError("k_weight is needed when the layer projects K")
    for w, name in ((q_weight, "q_weight"), (k_weight if n_kv else None, "k_weight")):
        if w is not None and (w.shape != (D,) or w.stride(0) != 1):
            raise ValueError(f"{name} must be a contiguous [{D}] vector, got {tuple(w.shape)}")
    q = torch.empty((T, n_heads, D), dtype=qkv.dtype, device=qkv.device)
    write_v = v_norm or cache is not None
    v_raw = qkv[:, q_cols : q_cols + k_cols] if k_eq_v else qkv[:, q_cols + k_cols :]
    if cache is not None:
        k, v, rows = cache
        for pool, name in ((k, "k_pool"), (v, "v_pool")):
            if pool.dim() != 3 or pool.shape[0] != n_kv or pool.shape[2] != D or pool.dtype != qkv.dtype:
                raise ValueError(
                    f"{name} must be a [{n_kv}, slots, {D}] {qkv.dtype} view, got {tuple(pool.shape)} {pool.dtype}"
                )
        if k.stride() != v.stride() or k.stride(2) != 1 or rows.shape != (T,):
            raise ValueError(f"k_pool/v_pool must be laid out alike (unit stride along D), rows be [{T}]")
        kv_row, kv_head = k.stride(1), k.stride(0)
    else:
        k = torch.empty((T, n_kv, D), dtype=qkv.dtype, device=qkv.device)
        v = torch.empty_like(k) if write_v else v_raw.view(T, n_kv, D)
        rows, kv_row, kv_head = None, k.stride(0), k.stride(1)
    _qkv_kernel[(T, n_heads + n_kv)](
        qkv, q_weight, k_weight, cos, sin, q, k, v, rows,
        qkv.stride(0), cos.stride(0), q.stride(0), kv_row, kv_head, eps, n_heads, D // 2,
        V_OFFSET=0 if k_eq_v else k_cols, V_NORM=v_norm, WRITE_V=write_v, QWEN3=qwen3, TO_POOL=cache is not None,
        HAS_KV=n_kv > 0, DTYPE=dtype, BLOCK=triton.next_power_of_2(D // 2),
    )  # fmt: skip
    if n_kv == 0 or cache is not None:
        return q, None, None
    return q, k, v
