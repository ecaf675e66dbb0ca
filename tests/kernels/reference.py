"""The eager math each Triton kernel of ``kakeya.backends.torch.kernels`` must equal: the models' own spelling of
what the kernel fuses. Only the kernel tests and ``benchmarks/kernels.py`` (the eager side of its timings) run them,
so they live here, not in ``services/``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kakeya.backends.torch import ops
from kakeya.backends.torch.kernels.attention import visible


def qkv_norm_rope_reference(
    qkv, n_heads, n_kv, head_dim, q_weight, k_weight, cos, sin, eps, *, k_eq_v=False, v_norm=True, qwen3=False
):
    """The models' own spelling (``Attention.project`` of the target, ``Attention.qkv`` of the drafter)."""
    T, D = qkv.shape[0], head_dim
    norm = ops.qwen3_rms_norm if qwen3 else ops.gemma4_rms_norm
    cos, sin = cos.reshape(T, 1, D), sin.reshape(T, 1, D)
    parts = qkv.split([n_heads * D, n_kv * D, 0 if k_eq_v else n_kv * D], dim=-1)
    q = norm(parts[0].view(T, n_heads, D), q_weight, eps)
    if n_kv == 0:
        return ops.apply_rope(q, cos, sin), None, None
    k = parts[1].view(T, n_kv, D)
    v = k if k_eq_v else parts[2].view(T, n_kv, D)
    q, k = ops.apply_rope(torch.cat([q, norm(k, k_weight, eps)], dim=1), cos, sin).split([n_heads, n_kv], dim=1)
    return q, k, ops.gemma4_rms_norm(v, None, eps) if v_norm else v


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float, *, qwen3: bool = False):
    """The model's own norms (``backends/torch/ops.py``)."""
    if qwen3:
        return ops.qwen3_rms_norm(x, weight, eps) if weight is not None else ops.gemma4_rms_norm(x, None, eps)
    return ops.gemma4_rms_norm(x, weight, eps)


def add_rms_norm_reference(residual, branch, weight, eps, *, branch_weight=None, scale=None, qwen3=False):
    """:func:`add_rms_norm` as the eager layer spells it (``DecoderLayer.after_attention``)."""
    if branch_weight is not None:
        branch = rms_norm_reference(branch, branch_weight, eps, qwen3=qwen3)
    h = residual + branch
    if scale is not None:
        h = h * scale.to(h.dtype)
    return h, rms_norm_reference(h, weight, eps, qwen3=qwen3)


def route_reference(logits: torch.Tensor, top_k: int, per_expert_scale: torch.Tensor):
    """``MoE.route`` after its router GEMM."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    w, idx = torch.topk(probs, top_k, dim=-1)
    w = w / w.sum(dim=-1, keepdim=True)
    return idx, w * per_expert_scale[idx]


def experts_reference(x, idx, weights, gate_up, down):
    """Expert by expert, ascending: its rows through GeGLU, weighted, added into their output rows in
    float32 (what ``MoE.experts``' one ``index_add_`` in bf16 does on a CPU)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # the sum in float32, rounded once
    mi = down.shape[-1]
    for e in idx.unique().tolist():
        rows, choice = (idx == e).nonzero(as_tuple=True)
        gate, up = F.linear(x[rows], gate_up[e]).split(mi, dim=-1)
        y = F.linear(F.gelu(gate, approximate="tanh") * up, down[e])
        out.index_add_(0, rows, (y * weights[rows, choice, None].to(y.dtype)).float())
    return out.to(x.dtype)


def softcap_argmax_reference(logits: torch.Tensor, cap: float | None):
    """``Gemma4Text.logits`` after its GEMM, and the static step's ``argmax``."""
    out = logits.float()
    out = torch.tanh(out / cap) * cap if cap else out
    return torch.argmax(out, dim=-1), out


def decode_attention_reference(
    q, k_pool, v_pool, table, key_pos, query_pos, *, window=0, sinks=0, scale=1.0, softcap=None
):
    """Per session: gather K/V through the table, build the mask from positions, fold each KV head's
    query heads into its rows (as ``ops.sdpa_folded``) and attend with ``ops.decode_attention``, the
    eager math CUDA runs for a verify; with a soft-cap, the same math spelled out."""
    B, L, Hq, D = q.shape
    out = []
    for b in range(B):
        k, v = k_pool[None, :, table[b]], v_pool[None, :, table[b]]
        G = Hq // k.shape[1]
        qg = q[b].transpose(0, 1).reshape(1, k.shape[1], G * L, D)  # head j*G + g, query l -> row g*L + l of KV head j
        w, s = (window[b], sinks[b]) if isinstance(window, torch.Tensor) else (window, sinks)
        mask = visible(key_pos[b], query_pos[b], w, s).repeat(G, 1)
        if softcap is None:
            o = ops.decode_attention(qg, k, v, mask, scale)
        else:
            s = torch.matmul(qg * scale if scale != 1.0 else qg, k.transpose(-1, -2))
            s = (torch.tanh(s / softcap) * softcap).masked_fill(~mask, float("-inf"))
            o = torch.matmul(torch.softmax(s, dim=-1, dtype=torch.float32).to(v.dtype), v)
        out.append(o.reshape(Hq, L, D).transpose(0, 1))
    return torch.stack(out)
