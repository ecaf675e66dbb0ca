"""Split-K (flash-decoding) attention of a few query rows per session over a K/V pool read through an index table: the
sliding ring and the full-attention buffers of a verify or a draft block.

Per session ``b``: slot ``j`` holds pool row ``table[b, j]`` at position ``key_pos[b, j]`` (negative: empty), in any
order (a ring is read as it lies). Query row ``l`` at ``query_pos[b, l]`` sees key position ``k`` iff ``0 <= k <= q``
and, with a ``window``, ``k > q - window`` or ``k < sinks``: ``verifier/layout.py``'s mask, built from positions. A full
layer is ``table = key_pos = arange(S)``, ``window=0``; the drafter's block puts every query row at its last position.

GQA is folded (one program takes a KV head's ``G * L`` query rows, so each K/V row is read once per KV head); keys are
split over programs, each keeping an online softmax and a float32 partial, combined by a second kernel.

Numerics follow the eager ``ops.decode_attention`` (scores rounded to the activation dtype, soft-cap op by op, float32
softmax, probabilities rounded for ``p @ v``, float32 accumulation), except that the probabilities are rounded before
the softmax is normalised here (the running sum is not final yet), after it eagerly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kakeya.backends.torch.kernels import common
from kakeya.backends.torch.kernels.common import round_to, rounded, tanh, tl_dtype

NO_MAX = tl.constexpr(-1.0e30)  # the running max before any visible key: finite, so exp(NO_MAX - NO_MAX) is 1, not NaN


@triton.jit
def _tile(pid, M_TILES, HKV):
    """(session, KV head, row tile) of a program."""
    return pid // (M_TILES * HKV), (pid // M_TILES) % HKV, pid % M_TILES


@triton.jit
def _split_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, kpos_ptr, qpos_ptr, out_ptr, acc_ptr, m_ptr, l_ptr,
    sq_b, sq_l, sq_h, sk_h, sk_r, sv_h, sv_r, st_b, skp_b, sqp_b, so_b, so_l, so_h,
    S, KEYS_PER_SPLIT, HKV, M_TILES, L, G, window, sinks, window_ptr, sinks_ptr, scale, softcap,
    HAS_WINDOW: tl.constexpr, PER_SESSION: tl.constexpr, SCALED: tl.constexpr, SOFTCAP: tl.constexpr,
    SPLITS: tl.constexpr, D: tl.constexpr, DTYPE: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b, kvh, m_tile = _tile(pid, M_TILES, HKV)
    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < G * L
    l_idx = rows % L
    head = kvh * G + rows // L
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    k_ptr += kvh.to(tl.int64) * sk_h  # this KV head's rows of the pools (64-bit: a shared pool may be large)
    v_ptr += kvh.to(tl.int64) * sv_h

    q = tl.load(
        q_ptr + b * sq_b + l_idx[:, None] * sq_l + head[:, None] * sq_h + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    if SCALED:
        q = rounded(q * scale, DTYPE)
    q = q.to(DOT)
    qpos = tl.load(qpos_ptr + b * sqp_b + l_idx, mask=row_ok, other=-1)
    if PER_SESSION:  # each session's own ring geometry (a batch of sessions with different policies)
        win = tl.load(window_ptr + b)
        snk = tl.load(sinks_ptr + b)
    else:
        win = window
        snk = sinks

    m_i = tl.full([BLOCK_M], NO_MAX, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo = split * KEYS_PER_SPLIT
    hi = tl.minimum(lo + KEYS_PER_SPLIT, S)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        kpos = tl.load(kpos_ptr + b * skp_b + n, mask=n_ok, other=-1)
        seen = row_ok[:, None] & n_ok[None, :] & (kpos[None, :] >= 0) & (kpos[None, :] <= qpos[:, None])
        if HAS_WINDOW:
            seen = seen & ((kpos[None, :] > qpos[:, None] - win) | (kpos[None, :] < snk))
        col_seen = tl.max(seen.to(tl.int32), axis=0) > 0  # keys some row sees: the only K/V rows read
        if tl.max(col_seen.to(tl.int32)) > 0:
            slot = tl.load(table_ptr + b * st_b + n, mask=col_seen, other=0).to(tl.int64)
            kv_ok = col_seen[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + slot[:, None] * sk_r + d[None, :], mask=kv_ok, other=0.0)
            s = rounded(tl.dot(q, tl.trans(k.to(DOT)), input_precision=PRECISION), DTYPE)
            if SOFTCAP:
                s = rounded(rounded(tanh(rounded(s / softcap, DTYPE)), DTYPE) * softcap, DTYPE)
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + slot[:, None] * sv_r + d[None, :], mask=kv_ok, other=0.0)
            pv = tl.dot(round_to(p, DTYPE).to(DOT), v.to(DOT), input_precision=PRECISION)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
    if SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a row that sees no key gets zeros
        tl.store(
            out_ptr + b * so_b + l_idx[:, None] * so_l + head[:, None] * so_h + d[None, :],
            round_to(out, DTYPE),
            mask=row_ok[:, None] & d_ok[None, :],
        )
    else:
        part = (pid * SPLITS + split) * BLOCK_M + tl.arange(0, BLOCK_M)
        tl.store(m_ptr + part, m_i)
        tl.store(l_ptr + part, l_i)
        tl.store(acc_ptr + part[:, None] * BLOCK_D + d[None, :], acc)


@triton.jit
def _combine_kernel(
    acc_ptr, m_ptr, l_ptr, out_ptr, so_b, so_l, so_h, HKV, M_TILES, L, G,
    SPLITS: tl.constexpr, D: tl.constexpr, DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    b, kvh, m_tile = _tile(pid, M_TILES, HKV)
    r = tl.arange(0, BLOCK_M)
    rows = m_tile * BLOCK_M + r
    row_ok = rows < G * L
    d = tl.arange(0, BLOCK_D)
    m_max = tl.full([BLOCK_M], NO_MAX, tl.float32)
    for s in range(SPLITS):
        m_max = tl.maximum(m_max, tl.load(m_ptr + (pid * SPLITS + s) * BLOCK_M + r))
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for s in range(SPLITS):
        part = (pid * SPLITS + s) * BLOCK_M + r
        w = tl.exp(tl.load(m_ptr + part) - m_max)
        total += w * tl.load(l_ptr + part)
        acc += w[:, None] * tl.load(acc_ptr + part[:, None] * BLOCK_D + d[None, :])
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    l_idx = rows % L
    head = kvh * G + rows // L
    tl.store(
        out_ptr + b * so_b + l_idx[:, None] * so_l + head[:, None] * so_h + d[None, :],
        round_to(out, DTYPE),
        mask=row_ok[:, None] & (d < D)[None, :],
    )


def _blocks(rows: int, head_dim: int) -> tuple[int, int, int]:
    """(rows per program, keys per block, warps): the row tile and the K/V tile fit in registers at
    head_dim 512 too. Untuned: the first GPU run (benchmarks/kernels.py) is where they get measured."""
    block_m = max(16, min(triton.next_power_of_2(rows), 64 if head_dim <= 128 else 32 if head_dim <= 256 else 16))
    block_n = 64 if head_dim <= 256 else 32
    return block_m, block_n, 4 if head_dim <= 256 else 8


STAGES = 2  # software-pipelined K/V loads in flight: two 32 x 512 bf16 K and V tiles stay well inside shared memory


def decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    table: torch.Tensor,
    key_pos: torch.Tensor,
    query_pos: torch.Tensor,
    *,
    window: int | torch.Tensor = 0,
    sinks: int | torch.Tensor = 0,
    scale: float = 1.0,
    softcap: float | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """Attention output ``[B, L, Hq, D]`` of queries ``q`` ``[B, L, Hq, D]`` over the pool rows
    ``k_pool``/``v_pool`` ``[Hkv, rows, D]`` that ``table`` ``[B, S]`` names, masked by ``key_pos``
    ``[B, S]`` and ``query_pos`` ``[B, L]`` (see the module doc). ``window`` and ``sinks``: one for
    every session, or integer tensors ``[B]``, each session's own (every window > 0). ``splits``: key
    ranges per (session, KV head) run in parallel (default: enough programs for the device)."""
    common.check_device(q, k_pool, v_pool, table, key_pos, query_pos)
    per_session = isinstance(window, torch.Tensor)
    if per_session != isinstance(sinks, torch.Tensor):
        raise ValueError("window and sinks are both per-session tensors or both integers")
    if per_session:
        common.check_device(q, window, sinks)
        if window.shape != (q.shape[0],) or sinks.shape != (q.shape[0],):
            raise ValueError(
                f"per-session window and sinks must be [{q.shape[0]}], got {tuple(window.shape)}, {tuple(sinks.shape)}"
            )
        if window.dtype.is_floating_point or sinks.dtype.is_floating_point:
            raise ValueError("per-session window and sinks must be integer tensors")
    dtype = tl_dtype(q)
    if q.dim() != 4 or k_pool.dim() != 3 or v_pool.shape != k_pool.shape:
        raise ValueError(
            f"q must be [B, L, Hq, D] and k/v pools alike [Hkv, rows, D], got {tuple(q.shape)}, "
            f"{tuple(k_pool.shape)}, {tuple(v_pool.shape)}"
        )
    B, L, Hq, D = q.shape
    Hkv = k_pool.shape[0]
    if k_pool.shape[2] != D or Hq % Hkv or k_pool.dtype != q.dtype or v_pool.dtype != q.dtype:
        raise ValueError(
            f"{Hq} query heads over {Hkv} KV heads of dim {k_pool.shape[2]} ({k_pool.dtype}) for "
            f"queries of dim {D} ({q.dtype})"
        )
    if q.stride(3) != 1 or k_pool.stride(2) != 1 or v_pool.stride(2) != 1:
        raise ValueError("q, k_pool and v_pool need unit stride along the head dim")
    S = table.shape[-1]
    if table.shape != (B, S) or key_pos.shape != (B, S) or query_pos.shape != (B, L):
        raise ValueError(
            f"table and key_pos must be [{B}, S], query_pos [{B}, {L}]; got {tuple(table.shape)}, "
            f"{tuple(key_pos.shape)}, {tuple(query_pos.shape)}"
        )
    if any(t.dtype.is_floating_point for t in (table, key_pos, query_pos)):
        raise ValueError("table and positions must be integer tensors")
    if any(t.stride(-1) != 1 for t in (table, key_pos, query_pos)):
        raise ValueError("table and positions need unit stride along their last axis")
    G = Hq // Hkv
    block_m, block_n, warps = _blocks(G * L, D)
    m_tiles = triton.cdiv(G * L, block_m)
    programs = B * Hkv * m_tiles
    if splits is None:
        splits = max(1, min(triton.cdiv(common.programs_wanted(q.device), programs), triton.cdiv(S, block_n)))
    keys_per_split = triton.cdiv(triton.cdiv(S, splits), block_n) * block_n
    splits = max(1, triton.cdiv(S, keys_per_split))  # no empty trailing split
    block_d = triton.next_power_of_2(D)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    f32 = {"dtype": torch.float32, "device": q.device}
    part_m = part_l = part_acc = None
    if splits > 1:
        part_m = torch.empty((programs, splits, block_m), **f32)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((programs, splits, block_m, block_d), **f32)
    shared = dict(SPLITS=splits, D=D, DTYPE=dtype, BLOCK_M=block_m, BLOCK_D=block_d, num_warps=warps)
    _split_kernel[(programs, splits)](
        q, k_pool, v_pool, table, key_pos, query_pos, out, part_acc, part_m, part_l,
        *q.stride()[:3], *k_pool.stride()[:2], *v_pool.stride()[:2], table.stride(0), key_pos.stride(0),
        query_pos.stride(0), *out.stride()[:3],
        S, keys_per_split, Hkv, m_tiles, L, G,
        0 if per_session else window, 0 if per_session else sinks,
        window if per_session else table, sinks if per_session else table,  # pointers read only with PER_SESSION
        scale, softcap or 1.0,
        HAS_WINDOW=per_session or window > 0, PER_SESSION=per_session, SCALED=scale != 1.0,
        SOFTCAP=softcap is not None, DOT=common.dot_dtype(q), PRECISION=common.dot_precision(q), BLOCK_N=block_n,
        num_stages=STAGES, **shared,
    )  # fmt: skip
    if splits > 1:
        _combine_kernel[(programs,)](part_acc, part_m, part_l, out, *out.stride()[:3], Hkv, m_tiles, L, G, **shared)
    return out


def visible(key_pos: torch.Tensor, query_pos: torch.Tensor, window=0, sinks=0) -> torch.Tensor:
    """Bool ``[..., L, S]``: which slots each query row sees (the kernel's mask, spelled in torch);
    ``window``/``sinks``: integers, or tensors of the leading shape (each session's own)."""
    k, q = key_pos[..., None, :], query_pos[..., :, None]
    seen = (k >= 0) & (k <= q)
    if isinstance(window, torch.Tensor):
        window, sinks = window[..., None, None], sinks[..., None, None]
        return seen & ((k > q - window) | (k < sinks))
    return seen & ((k > q - window) | (k < sinks)) if window else seen
