"""The LM head's epilogue on the device: Gemma's final soft-cap ``tanh(x / cap) * cap`` of the
logits (in float32, as ``Gemma4Text.logits`` spells it) and the greedy choice, its argmax.

The LM head's GEMM stays cuBLAS's; what follows it -- the cast to float32, three elementwise ops, the
argmax -- becomes one pass over the logits in chunks (every SM busy at one row) and a tiny kernel reducing
the chunks' maxima. The choice is the first argmax of the capped logits the kernel writes (``torch.argmax``'s
rule), so a sampler reading them sees the same numbers. ``write_logits=False`` skips writing them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kakeya.backends.torch.kernels import common
from kakeya.backends.torch.kernels.common import tanh

BLOCK = 1024  # logits per step of a chunk's loop


@triton.jit
def _chunk_kernel(
    logits_ptr, capped_ptr, best_ptr, where_ptr, V, row, out_row, cap, CHUNK, N_CHUNKS,
    HAS_CAP: tl.constexpr, WRITE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    c = tl.program_id(1)
    best = float("-inf")
    where = 0
    for start in range(c * CHUNK, tl.minimum(c * CHUNK + CHUNK, V), BLOCK):
        v = start + tl.arange(0, BLOCK)
        ok = v < V
        x = tl.load(logits_ptr + t * row + v, mask=ok, other=0.0).to(tl.float32)
        if HAS_CAP:
            x = tanh(tl.div_rn(x, cap)) * cap
        if WRITE:
            tl.store(capped_ptr + t * out_row + v, x, mask=ok)
        x = tl.where(ok, x, float("-inf"))
        m = tl.max(x, axis=0)
        i = start + tl.argmax(x, axis=0)  # the first of equals
        where = tl.where(m > best, i, where)  # a later block only wins outright
        best = tl.maximum(best, m)
    tl.store(best_ptr + t * N_CHUNKS + c, best)
    tl.store(where_ptr + t * N_CHUNKS + c, where)


@triton.jit
def _choose_kernel(best_ptr, where_ptr, choice_ptr, N_CHUNKS, BLOCK_C: tl.constexpr):
    t = tl.program_id(0)
    c = tl.arange(0, BLOCK_C)
    ok = c < N_CHUNKS
    best = tl.load(best_ptr + t * N_CHUNKS + c, mask=ok, other=float("-inf"))
    where = tl.load(where_ptr + t * N_CHUNKS + c, mask=ok, other=0)
    first = tl.argmax(best, axis=0)  # chunks in index order: the first chunk holding the max
    tl.store(choice_ptr + t, tl.sum(tl.where(c == first, where, 0), axis=0).to(tl.int64))


def softcap_argmax(
    logits: torch.Tensor, cap: float | None, *, write_logits: bool = True, chunks: int | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(choices [T] int64, capped logits [T, V] float32 or None)`` from the LM head's output
    ``logits`` ``[T, V]`` (any float dtype); ``cap=None``: no soft-cap. ``chunks``: programs per row."""
    common.check_device(logits)
    if logits.dim() != 2 or logits.stride(1) != 1 or not logits.dtype.is_floating_point:
        raise ValueError(f"logits must be float [T, V], unit column stride; got {tuple(logits.shape)} {logits.dtype}")
    T, V = logits.shape
    if chunks is None:
        chunks = max(1, min(triton.cdiv(common.programs_wanted(logits.device), T), triton.cdiv(V, BLOCK)))
    chunk = triton.cdiv(triton.cdiv(V, chunks), BLOCK) * BLOCK
    chunks = triton.cdiv(V, chunk)
    capped = torch.empty((T, V), dtype=torch.float32, device=logits.device) if write_logits else None
    best = torch.empty((T, chunks), dtype=torch.float32, device=logits.device)
    where = torch.empty((T, chunks), dtype=torch.int32, device=logits.device)
    _chunk_kernel[(T, chunks)](
        logits, capped, best, where, V, logits.stride(0), V, cap or 1.0, chunk, chunks,
        HAS_CAP=cap is not None, WRITE=write_logits, BLOCK=BLOCK,
    )  # fmt: skip
    choices = torch.empty(T, dtype=torch.int64, device=logits.device)
    _choose_kernel[(T,)](best, where, choices, chunks, BLOCK_C=triton.next_power_of_2(chunks))
    return choices, capped
