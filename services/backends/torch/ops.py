"""Tensor helpers shared by the PyTorch target (``verifier/torch_backend/gemma4.py``) and drafter
(``drafter/torch_backend/model.py``): device/dtype resolution, the two RMSNorm conventions, RoPE, the one SDPA call.

Both RMSNorms normalise in float32 and differ in *when* the result goes back to the activation dtype, which matters in
bf16/fp16 only: Gemma-4 (:func:`gemma4_rms_norm`, transformers' ``Gemma4RMSNorm``) multiplies by the weight -- ``w``
itself, not Gemma 1-3's ``1 + w``; some norms have none -- in float32 and casts once; Qwen3 (:func:`qwen3_rms_norm`, the
DFlash drafter's layers) casts the normalised rows back first and multiplies in the weight's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPES |= {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # the short names


def cuda_available() -> bool:
    return bool(torch.cuda.is_available())


def set_threads(n: int) -> None:
    """Pin torch's CPU intra-op threads."""
    torch.set_num_threads(n)


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    """A torch dtype from its name (``"bf16"``, ``"float32"`` ...); None means float32."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r} (expected one of {sorted(DTYPES)})") from None


def resolve_device(device: str | torch.device | None) -> torch.device:
    """A torch device that exists on this machine; None means the CPU."""
    if device is None:
        return torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but torch.cuda.is_available() is False")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError("device 'mps' requested but torch.backends.mps.is_available() is False")
    return device


def _normalized_f32(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def gemma4_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Gemma-4 RMSNorm: ``x * rsqrt(mean(x^2) + eps) * weight`` all in float32, then cast to x's
    dtype; ``weight=None`` is the scale-free norm (Gemma-4's V norm, router input)."""
    if weight is None or weight.dtype == x.dtype:
        # One fused kernel instead of ~9: it computes in float32 and rounds once, this formula bit for
        # bit against transformers in float32, bf16 and fp16 (tests/torch_backend/test_torch_ops.py).
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    out = _normalized_f32(x, eps)
    if weight is not None:
        out = out * weight.float()
    return out.to(x.dtype)


def qwen3_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3 RMSNorm: normalise in float32, cast back to x's dtype, then times ``weight``
    (the weight-free fused norm does the first two in one kernel, rounding once). In float32
    the cast back rounds nothing, so the weight joins the fused kernel: the same numbers."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x, (x.shape[-1],), None, eps)


# --------------------------------------------------------------------------- RoPE (half-split pairs)


def default_inv_freq(base: float, dim: int, n_pairs: int | None = None) -> torch.Tensor:
    """float32 ``1 / base^(2i/dim)`` for the first ``n_pairs`` (default ``dim // 2``) pairs, on the CPU."""
    stop = dim if n_pairs is None else 2 * n_pairs
    return 1.0 / (base ** (torch.arange(0, stop, 2, dtype=torch.float32, device="cpu") / dim))


def rope_cos_sin(
    inv_freq: torch.Tensor, start: int, n: int, device, dtype: torch.dtype, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` tables ``[n, 2 * len(inv_freq)]`` for positions ``start .. start+n-1``
    (angles in float32, optionally times ``scale``, cast to ``dtype``)."""
    pos = torch.arange(start, start + n, device=device, dtype=torch.float32)
    return rope_from_positions(inv_freq.to(device), pos, dtype, scale)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (last axis = head dim) by tables that broadcast against it."""
    return x * cos + rotate_half(x) * sin


def rope_from_positions(
    inv_freq: torch.Tensor, pos: torch.Tensor, dtype: torch.dtype, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rope_cos_sin` for a device tensor of positions ``pos`` [n] (same float32 angles,
    so the same numbers): nothing is built on the host, so it runs inside a captured step."""
    freqs = pos.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


# cuDNN's SDPA builds an execution plan per new shape, a host-side build every block as the context grows
# (docs/cuda.md, "Attention backends"); flash and memory-efficient attention take any length at no set-up
# cost; MATH is the fallback (and the CPU's).
SDPA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
_ON = (False, True, True, True)  # cuDNN, flash, memory-efficient, math


def _sdp_flags() -> tuple[bool, bool, bool, bool]:
    b = torch.backends.cuda
    return b.cudnn_sdp_enabled(), b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled()


def _set_sdp_flags(flags: tuple[bool, bool, bool, bool]) -> None:
    b = torch.backends.cuda
    b.enable_cudnn_sdp(flags[0])
    b.enable_flash_sdp(flags[1])
    b.enable_mem_efficient_sdp(flags[2])
    b.enable_math_sdp(flags[3])


class sdpa_backends:
    """The attention backends every torch forward runs under: ``sdpa_kernel(SDPA_BACKENDS)``
    (the same flags, restored on exit), set directly rather than through ``sdpa_kernel``, whose own
    set-up is a visible share of a small model's forward on a CPU -- it is entered once per forward."""

    def __enter__(self):
        self.prev = _sdp_flags()
        if self.prev != _ON:
            _set_sdp_flags(_ON)
        return self

    def __exit__(self, *exc) -> None:
        if self.prev != _ON:
            _set_sdp_flags(self.prev)


def sdpa(
    q, k, v, mask: torch.Tensor | None, scale: float, *, fold: bool | None = None, chunks: int | None = None
) -> torch.Tensor:
    """The one scaled-dot-product attention call of the target and the drafter (GQA when the head counts
    differ), inside :func:`sdpa_backends`. ``fold`` (:func:`folds`) and ``chunks`` (:func:`split_count`):
    None, chosen here; given, :class:`CompiledAttention` chose them outside its graph."""
    Hq, Hkv = q.shape[1], k.shape[1]
    if folds(q, mask) if fold is None else fold:
        return sdpa_folded(q, k, v, mask, scale, chunks)
    # compiled (one graph for every layer kind), the head counts are symbolic and SDPA wants a plain
    # bool: GQA with groups of one is plain attention, so say True
    gqa = True if torch.compiler.is_compiling() else Hq != Hkv
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def folds(q: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether :func:`sdpa` folds the query heads into rows (:func:`sdpa_folded`): on CUDA, with no
    mask or one ``[L, K]`` mask for every head."""
    return q.is_cuda and (mask is None or mask.dim() == 2)


def sdpa_folded(q, k, v, mask: torch.Tensor | None, scale: float, chunks: int | None = None) -> torch.Tensor:
    """Attention with each KV head's query heads folded into its query rows (``mask``: None or ``[L, K]``), so every K/V
    head is read once: what CUDA runs. SDPA's own GQA with a mask falls back to the math kernel, which expands K/V to
    every query head in float32. Few rows per KV head go through :func:`decode_attention` (``chunks``: its split count),
    more (a prefill chunk) through the fused kernels."""
    B, Hq, L, D = q.shape
    G = Hq // k.shape[1]
    qg = q.reshape(B, k.shape[1], G * L, D)  # head j*G + g, query l -> row g*L + l of KV head j
    # a mask may be one row for every query ([1, K]: a non-causal drafter block sees the same keys);
    # widen it to the L rows before the G copies, or the folded rows would not line up with it
    m = None if mask is None else mask.expand(L, mask.shape[-1]).repeat(G, 1)
    if G * L <= DECODE_ROWS:
        out = decode_attention(qg, k, v, m, scale, chunks)
    else:
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=m, scale=scale)
    return out.reshape(B, Hq, L, v.shape[-1])


DECODE_ROWS = 64  # query rows per KV head up to which decode_attention beats the fused kernels


def split_count(n_keys: int) -> int:
    """How many chunks :func:`decode_attention` splits ``n_keys`` keys into for ``p @ v`` (1: none):
    the most of 32, 16, 8, 4, 2 that divides them into chunks of at least 64 keys."""
    return next((c for c in (32, 16, 8, 4, 2) if n_keys % c == 0 and n_keys // c >= 64), 1)


def decode_attention(q, k, v, mask: torch.Tensor | None, scale: float, chunks: int | None = None) -> torch.Tensor:
    """Attention for a few query rows over a long cache: two GEMMs and a float32 softmax.

    The fused kernels parallelise over query blocks and heads, so a handful of rows per KV head runs on a few thread
    blocks that each walk the whole cache; here the key axis is the GEMMs' wide dimension and the cache is read once at
    full bandwidth. Scores in the inputs' dtype, softmax in float32 as eager attention. ``chunks``: the split of ``p @
    v``."""
    s = torch.matmul(q * scale if scale != 1.0 else q, k.transpose(-1, -2))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(v.dtype)
    n_keys = k.shape[-2]
    chunks = split_count(n_keys) if chunks is None else chunks
    if chunks == 1:
        return torch.matmul(p, v)
    # p @ v reduces over every key with a tiny output (rows x head_dim): as one GEMM it runs on a
    # couple of thread blocks walking the whole cache, one after another. Split the keys into
    # chunks, one batched GEMM over them, and sum the partials in float32 (flash-decoding's split-K).
    pc = p.unflatten(-1, (chunks, n_keys // chunks)).transpose(-3, -2)  # [B, H, chunks, rows, keys/chunks]
    vc = v.unflatten(-2, (chunks, n_keys // chunks))  # [B, H, chunks, keys/chunks, D]
    return torch.matmul(pc, vc).sum(dim=-3, dtype=torch.float32).to(v.dtype)


def attention_kernel_wanted(device: torch.device, wanted: bool | None) -> bool:
    """Whether a batched step attends through the Triton decode-attention kernel: by default on CUDA where
    triton imports; asked for, also on the CPU under Triton's interpreter (how tests run it)."""
    if wanted is False:
        return False
    try:
        from kakeya.backends.torch.kernels.common import interpreted
    except ImportError:  # no triton (macOS has no wheels)
        if wanted:
            raise ValueError("attention_kernel: triton is not installed") from None
        return False
    if torch.device(device).type == "cuda":
        return True
    if wanted and not (torch.device(device).type == "cpu" and interpreted()):
        raise ValueError(
            f"attention_kernel: the Triton kernel runs on CUDA (or the CPU under TRITON_INTERPRET=1), not {device}"
        )
    return bool(wanted)


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Gemma's GeGLU (tanh GELU), the MLP's elementwise half."""
    return F.gelu(gate, approximate="tanh") * up


def compiled(fn):
    """``--compile``: ``torch.compile`` one row-wise half of a layer (norms, projections, RoPE, residuals, MLP) into a
    few fused kernels around its GEMMs. ``dynamic``: one graph per layer kind serves every row count and layer of that
    kind; ``fullgraph``: a graph break is an error, not a silent slow path; ``emulate_precision_casts``: Inductor rounds
    intermediates to the activation dtype where eager does, so a compiled bf16 model tracks the eager one."""
    return torch.compile(fn, dynamic=True, fullgraph=True, options={"emulate_precision_casts": True})


def whole_buffer(x: torch.Tensor) -> torch.Tensor:
    """The contiguous ``[B, H, capacity, D]`` buffer whose first ``n`` slots ``x`` ``[B, H, n, D]`` is, as a
    view of the same memory; ``x`` itself when it is laid out otherwise."""
    B, H, n, D = x.shape
    s = x.stride()
    if s[3] != 1 or s[2] != D or s[1] % max(D, 1) or (B > 1 and s[0] != H * s[1]):
        return x
    cap = s[1] // D
    if cap < n or (x.storage_offset() + B * H * cap * D) * x.element_size() > x.untyped_storage().nbytes():
        return x
    return x.as_strided((B, H, cap, D), (H * cap * D, cap * D, D, 1))


def _attend_prefix(q, k, v, n: int, mask, scale: float, fold: bool, chunks: int):
    """:func:`sdpa` over the first ``n`` slots of ``k`` and ``v`` (what :class:`CompiledAttention` compiles)."""
    return sdpa(q, k[:, :, :n], v[:, :, :n], mask, scale, fold=fold, chunks=chunks)


ATTENTION_GRAPHS = 32  # CompiledAttention's recompile budget: five two-way branches (its docstring)


class CompiledAttention:
    """``--compile``'s attention: :func:`sdpa` through :func:`compiled`, one graph set for every layer.

    Dynamo guards a graph on everything the traced code branched on, strides included, so views of buffers sized by
    capacity would take a graph each and hit torch's recompile limit. The graph gets K and V as whole contiguous buffers
    (:func:`whole_buffer`) and the extent as an int; choices made from shapes (:func:`folds`, :func:`split_count`) are
    made here, eagerly. Five two-way branches are left to guard on: ``ATTENTION_GRAPHS`` (2 ** 5) is that budget."""

    def __init__(self):
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, ATTENTION_GRAPHS)
        self.graph = compiled(_attend_prefix)

    def __call__(self, q, k, v, mask, scale: float) -> torch.Tensor:
        n, fold = k.shape[2], folds(q, mask)
        chunks = split_count(n) if fold else 1  # only the folded path splits
        return self.graph(q, whole_buffer(k), whole_buffer(v), n, mask, scale, fold, chunks)
