"""The Gemma-4 text model in plain PyTorch: config and layers (weights: ``verifier/torch_backend/load.py``).

The torch counterpart of mlx-lm's ``gemma4_text.py``, gpt-fast style: modules hold raw weight tensors under their
Hugging Face names (one directory opens here, in mlx-lm and in transformers), the forward is explicit tensor ops.

Covered (semantics of mlx-lm ``gemma4_text`` / transformers ``gemma4``): sliding / full layers; ``global_head_dim`` and
``num_global_key_value_heads``; ``attention_k_eq_v``; q/k norms; attention scale 1; default RoPE on sliding layers,
proportional partial RoPE on full ones; embedding scale; ``layer_scalar``; GeGLU MLP (double width with
``use_double_wide_mlp``); MoE beside the dense MLP; per-layer inputs; KV sharing; ``final_logit_softcapping``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kakeya.backends.torch.ops import (
    CompiledAttention,
    apply_rope,
    compiled,
    default_inv_freq,
    geglu,
    gemma4_rms_norm,
    rope_from_positions,
    sdpa,
    sdpa_backends,
)
from kakeya.checkpoints.config import GEMMA4_ROPE_DEFAULTS
from kakeya.core.contract import FULL, SLIDING, check_layer_types


@dataclass
class Gemma4Args:
    """The text model's hyper-parameters (transformers' ``Gemma4TextConfig`` defaults)."""

    vocab_size: int = 262_144
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 30
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 256
    global_head_dim: int = 512
    num_global_key_value_heads: int | None = None
    attention_k_eq_v: bool = False
    hidden_activation: str = "gelu_pytorch_tanh"
    rms_norm_eps: float = 1e-6
    sliding_window: int = 512
    layer_types: list[str] = field(default_factory=list)
    rope_parameters: dict = field(default_factory=dict)  # over transformers' defaults (__post_init__)
    final_logit_softcapping: float | None = None
    tie_word_embeddings: bool = True
    vocab_size_per_layer_input: int = 262_144
    hidden_size_per_layer_input: int = 256
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = False
    enable_moe_block: bool = False
    num_experts: int | None = None
    top_k_experts: int | None = None
    moe_intermediate_size: int | None = None
    max_position_embeddings: int = 131_072

    def __post_init__(self):
        if not self.layer_types:
            self.layer_types = [SLIDING if (i + 1) % 6 else FULL for i in range(self.num_hidden_layers)]
        self.layer_types = list(self.layer_types)
        check_layer_types(self.layer_types, self.num_hidden_layers)
        if FULL in self.layer_types and self.layer_types[-1] != FULL:  # transformers forces this (a hybrid's) too
            self.layer_types[-1] = FULL
        rope = {k: dict(v) for k, v in GEMMA4_ROPE_DEFAULTS.items()}
        for k, v in (self.rope_parameters or {}).items():
            if isinstance(v, dict):
                rope[k] = dict(v)
        self.rope_parameters = rope
        if self.enable_moe_block and not (self.num_experts and self.top_k_experts and self.moe_intermediate_size):
            raise ValueError("enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size")
        if self.num_kv_shared_layers:
            first = self.num_hidden_layers - self.num_kv_shared_layers
            if set(self.layer_types[first:]) - set(self.layer_types[:first]):
                raise ValueError("every KV-shared layer type needs an earlier layer of that type producing K/V")

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> Gemma4Args:
        """The args of a ``checkpoints.config.target_config`` reading (transformers >= 5.2's
        ``per_layer_config`` already read back into ``global_head_dim`` / ``num_global_key_value_heads``)."""
        if "text_config" in cfg or "per_layer_config" in cfg:
            from kakeya.checkpoints.config import target_config

            cfg = target_config(cfg)
        names = {f for f in cls.__dataclass_fields__}
        kwargs = {k: v for k, v in cfg.items() if k in names and v is not None}
        return cls(**kwargs)

    @property
    def n_cached(self) -> int:
        """Layers that own K/V (the rest reuse an earlier layer's)."""
        return self.num_hidden_layers - self.num_kv_shared_layers

    def head_dim_of(self, i: int) -> int:
        return self.global_head_dim if self.layer_types[i] == FULL and self.global_head_dim else self.head_dim

    def k_eq_v(self, i: int) -> bool:
        return bool(self.attention_k_eq_v) and self.layer_types[i] == FULL

    def kv_heads_of(self, i: int) -> int:
        if self.k_eq_v(i) and self.num_global_key_value_heads is not None:
            return self.num_global_key_value_heads
        return self.num_key_value_heads

    def previous_kvs(self) -> list[int]:
        """For each layer, the layer whose K/V it attends with (itself unless KV-shared)."""
        out = list(range(self.num_hidden_layers))
        last_of_type = {t: i for i, t in enumerate(self.layer_types[: self.n_cached])}
        for j in range(self.n_cached, self.num_hidden_layers):
            out[j] = last_of_type[self.layer_types[j]]
        return out


def _act(name: str):
    if name in ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new", "gelu_fast"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    if name == "silu":
        return F.silu
    raise ValueError(f"unsupported hidden_activation {name!r}")


def rope_inv_freq(params: dict, head_dim: int) -> torch.Tensor:
    """float32 inverse frequencies, ``head_dim // 2`` of them (non-traditional, half-split pairs)."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    base = float(params.get("rope_theta", 10_000.0))
    if rope_type == "default":
        return default_inv_freq(base, head_dim)
    if rope_type == "linear":
        return default_inv_freq(base, head_dim) / float(params["factor"])
    if rope_type == "proportional":
        factor = float(params.get("factor", 1.0))
        angles = int(float(params.get("partial_rotary_factor", 1.0)) * head_dim // 2)
        rotated = default_inv_freq(base, head_dim, n_pairs=angles)
        inv = torch.cat([rotated, torch.zeros(head_dim // 2 - angles, dtype=torch.float32, device="cpu")])
        return inv / factor
    raise ValueError(f"unsupported rope_type {rope_type!r} for Gemma-4")


# One forward's attention: ``(layer index, layer, q, k, v, shared) -> (output, kv)``. It writes the
# layer's new ``k``/``v`` (None on a KV-shared layer, which gets ``shared``: the ``kv`` its source
# layer returned) where that forward says and attends ``q`` over what it says.
Attend = Callable[[int, "DecoderLayer", torch.Tensor, Any, Any, Any], tuple[torch.Tensor, Any]]


class Attention(nn.Module):
    def __init__(self, args: Gemma4Args, i: int):
        super().__init__()
        self.layer_type = args.layer_types[i]
        self.head_dim = args.head_dim_of(i)
        self.n_heads = args.num_attention_heads
        self.n_kv = args.kv_heads_of(i)
        self.k_eq_v = args.k_eq_v(i)
        self.has_kv = i < args.n_cached
        self.eps = args.rms_norm_eps
        q = self.n_heads * self.head_dim
        kv = self.n_kv * self.head_dim if self.has_kv else 0
        # q, k(, v) projections fused into one matmul
        self.split = [q] + ([kv] if self.has_kv else []) + ([kv] if self.has_kv and not self.k_eq_v else [])
        self.attend = sdpa  # the attention arithmetic over the fetched K/V (compile_layers fuses it)
        self.register_buffer("wqkv", torch.empty(sum(self.split), args.hidden_size), persistent=False)
        self.register_buffer("wo", torch.empty(args.hidden_size, q), persistent=False)
        self.register_buffer("q_norm", torch.empty(self.head_dim), persistent=False)
        if self.has_kv:
            self.register_buffer("k_norm", torch.empty(self.head_dim), persistent=False)
        self.qk_scale: torch.Tensor | None = None  # q_norm and k_norm per head, one tensor (:meth:`fuse_norms`)

    def fuse_norms(self) -> None:
        """In float32, q, k and v in ONE scale-free norm, q and k then scaled by one ``[heads + kv_heads,
        head_dim]`` tensor: bit for bit the three norms, a third of their kernels. In a half dtype this would
        round twice where the weighted norm rounds once: there the three stay."""
        if self.has_kv and self.q_norm.dtype == torch.float32:
            self.qk_scale = torch.cat(
                [self.q_norm.expand(self.n_heads, -1), self.k_norm.expand(self.n_kv, -1)]
            ).contiguous()

    def project(self, x, cos, sin, new_kv: bool = True):
        """``q`` [B, heads, L, D] and (``new_kv``) this block's own ``k``, ``v`` [B, kv_heads, L, D]."""
        B, L, _ = x.shape
        if new_kv and self.qk_scale is not None and x.dtype == torch.float32:
            return self._project_fused(F.linear(x, self.wqkv).view(B, L, -1, self.head_dim), cos, sin)
        parts = F.linear(x, self.wqkv).split(self.split, dim=-1)
        q = gemma4_rms_norm(parts[0].view(B, L, self.n_heads, self.head_dim), self.q_norm, self.eps)
        if not new_kv:
            return apply_rope(q, cos, sin).transpose(1, 2), None, None
        k = parts[1].view(B, L, self.n_kv, self.head_dim)
        v = k if self.k_eq_v else parts[2].view(B, L, self.n_kv, self.head_dim)
        # q and k rotate as one tensor: one set of RoPE's elementwise kernels instead of two
        qk = apply_rope(torch.cat([q, gemma4_rms_norm(k, self.k_norm, self.eps)], dim=2), cos, sin)
        q, k = qk.split([self.n_heads, self.n_kv], dim=2)
        return q.transpose(1, 2), k.transpose(1, 2), gemma4_rms_norm(v, None, self.eps).transpose(1, 2)

    def _project_fused(self, heads: torch.Tensor, cos, sin):
        """:meth:`project` over ``heads`` [B, L, q + k (+ v) heads, D] with :meth:`fuse_norms`' one norm."""
        n = gemma4_rms_norm(heads, None, self.eps)  # Gemma-4's V norm is this scale-free norm
        qk = apply_rope(n[:, :, : self.n_heads + self.n_kv] * self.qk_scale, cos, sin)
        v = n[:, :, self.n_heads :] if self.k_eq_v else n[:, :, self.n_heads + self.n_kv :]
        q, k = qk.split([self.n_heads, self.n_kv], dim=2)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def output(self, out: torch.Tensor) -> torch.Tensor:
        B, _, L, _ = out.shape
        return F.linear(out.transpose(1, 2).reshape(B, L, self.n_heads * self.head_dim), self.wo)


@functools.cache
def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` (one kernel for every expert) runs here: bf16 on Hopper and
    on CPUs, not float32. Else the experts run as a batched GEMV per (token, expert)."""
    try:
        a = torch.zeros(4, 16, device=device, dtype=dtype)
        b = torch.zeros(2, 16, 16, device=device, dtype=dtype)
        torch._grouped_mm(a, b.transpose(-2, -1), offs=torch.tensor([1, 4], dtype=torch.int32, device=device))
        return True
    except (RuntimeError, NotImplementedError, AttributeError):
        return False


class MoE(nn.Module):
    """Router + experts: the second feed-forward branch of a Gemma-4 MoE layer."""

    def __init__(self, args: Gemma4Args):
        super().__init__()
        E, h, mi = args.num_experts, args.hidden_size, args.moe_intermediate_size
        self.E, self.top_k, self.mi, self.eps = E, args.top_k_experts, mi, args.rms_norm_eps
        self.root = h**-0.5
        self.act = _act(args.hidden_activation)
        self.register_buffer("router_proj", torch.empty(E, h), persistent=False)
        self.register_buffer("router_scale", torch.empty(h), persistent=False)
        self.register_buffer("per_expert_scale", torch.empty(E), persistent=False)
        self.register_buffer("gate_up", torch.empty(E, 2 * mi, h), persistent=False)  # gate rows, then up rows
        self.register_buffer("down", torch.empty(E, h, mi), persistent=False)
        self.grouped_mm: bool | None = None  # torch._grouped_mm for this device/dtype: decided on first use
        self.expert_ids: torch.Tensor | None = None  # 0..E-1 on the device: made once, not per call in the graph

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r = gemma4_rms_norm(x, None, self.eps) * (self.router_scale * self.root).to(x.dtype)
        probs = torch.softmax(F.linear(r, self.router_proj), dim=-1, dtype=torch.float32)  # upcast inside
        w, idx = torch.topk(probs, self.top_k, dim=-1)
        w = w / w.sum(dim=-1, keepdim=True)
        return idx, w * self.per_expert_scale[idx]  # float32 result: the scale is upcast inside the mul

    def experts(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``x`` [T, h]: every token through its top-k experts, weighted; no host sync."""
        _T, k = idx.shape
        e, order = torch.sort(idx.reshape(-1), stable=True)  # (token, expert) pairs grouped by expert
        tok = order // k
        xs = x[tok]
        if self.grouped_mm is None:
            self.grouped_mm = grouped_mm_supported(x.device, x.dtype)
        if self.grouped_mm:
            # each expert's end offset in the sorted pairs, on the device: no host sync (bincount
            # would sync on CUDA), one kernel (not zeros + scatter_add_ + cumsum)
            if self.expert_ids is None or self.expert_ids.device != e.device:
                self.expert_ids = torch.arange(self.E, dtype=e.dtype, device=e.device)
            offs = torch.searchsorted(e, self.expert_ids, right=True, out_int32=True)
            gu = torch._grouped_mm(xs, self.gate_up.transpose(-2, -1), offs=offs)
            gate, up = gu.split(self.mi, dim=-1)
            y = torch._grouped_mm(self.act(gate) * up, self.down.transpose(-2, -1), offs=offs)
        else:
            gu = torch.bmm(self.gate_up[e], xs.unsqueeze(-1)).squeeze(-1)
            gate, up = gu.split(self.mi, dim=-1)
            y = torch.bmm(self.down[e], (self.act(gate) * up).unsqueeze(-1)).squeeze(-1)
        y = y * w.reshape(-1)[order].unsqueeze(-1).to(y.dtype)
        return torch.zeros_like(x).index_add_(0, tok, y)


class DecoderLayer(nn.Module):
    def __init__(self, args: Gemma4Args, i: int):
        super().__init__()
        h = args.hidden_size
        self.eps = args.rms_norm_eps
        self.layer_type = args.layer_types[i]
        self.attn = Attention(args, i)
        wide = args.use_double_wide_mlp and args.num_kv_shared_layers > 0 and i >= args.n_cached
        self.inter = args.intermediate_size * (2 if wide else 1)
        self.act = _act(args.hidden_activation)
        self.tanh_gelu = args.hidden_activation in ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new", "gelu_fast")
        self.register_buffer("w_gate_up", torch.empty(2 * self.inter, h), persistent=False)
        self.register_buffer("w_down", torch.empty(h, self.inter), persistent=False)
        for n in ("input_ln", "post_attn_ln", "pre_ffn_ln", "post_ffn_ln"):
            self.register_buffer(n, torch.empty(h), persistent=False)
        self.register_buffer("layer_scalar", torch.ones(1), persistent=False)
        self.moe = MoE(args) if args.enable_moe_block else None
        if self.moe is not None:
            for n in ("post_ffn_ln_1", "post_ffn_ln_2", "pre_ffn_ln_2"):
                self.register_buffer(n, torch.empty(h), persistent=False)
        self.ple = args.hidden_size_per_layer_input
        if self.ple:
            self.register_buffer("ple_gate", torch.empty(self.ple, h), persistent=False)
            self.register_buffer("ple_proj", torch.empty(h, self.ple), persistent=False)
            self.register_buffer("ple_norm", torch.empty(h), persistent=False)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.w_gate_up).split(self.inter, dim=-1)
        return F.linear(geglu(gate, up) if self.tanh_gelu else self.act(gate) * up, self.w_down)

    def qkv(self, x, cos, sin, new_kv: bool = True):
        """The input norm and ``Attention.project``: row-wise, so batches flatten and ``--compile`` fuses it."""
        return self.attn.project(gemma4_rms_norm(x, self.input_ln, self.eps), cos, sin, new_kv)

    def after_attention(self, x, a, per_layer_input):
        """The rest of the layer given the attention output ``a``: row-wise, so batches flatten."""
        eps = self.eps
        h = x + gemma4_rms_norm(a, self.post_attn_ln, eps)
        f = self.mlp(gemma4_rms_norm(h, self.pre_ffn_ln, eps))
        if self.moe is not None:
            f = gemma4_rms_norm(f, self.post_ffn_ln_1, eps)
            flat = h.reshape(-1, h.shape[-1])
            idx, w = self.moe.route(flat)
            f2 = self.moe.experts(gemma4_rms_norm(flat, self.pre_ffn_ln_2, eps), idx, w)
            f = f + gemma4_rms_norm(f2.view_as(h), self.post_ffn_ln_2, eps)
        h = h + gemma4_rms_norm(f, self.post_ffn_ln, eps)
        if self.ple and per_layer_input is not None:
            g = self.act(F.linear(h, self.ple_gate)) * per_layer_input
            h = h + gemma4_rms_norm(F.linear(g, self.ple_proj), self.ple_norm, eps)
        return h * self.layer_scalar.to(h.dtype)


class Gemma4Text(nn.Module):
    """The decoder stack plus embedding / final norm / LM head as raw tensors."""

    def __init__(self, args: Gemma4Args):
        super().__init__()
        self.args = args
        h = args.hidden_size
        self.register_buffer("embed", torch.empty(args.vocab_size, h), persistent=False)
        self.register_buffer("norm", torch.empty(h), persistent=False)
        self.lm_head: torch.Tensor | None = None  # None: tied to embed
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_hidden_layers))
        self.previous_kvs = args.previous_kvs()
        self.embed_scale = h**0.5
        self.ple = args.hidden_size_per_layer_input
        if self.ple:
            n = args.num_hidden_layers
            self.register_buffer(
                "embed_per_layer", torch.empty(args.vocab_size_per_layer_input, n * self.ple), persistent=False
            )
            self.register_buffer("ple_model_proj", torch.empty(n * self.ple, h), persistent=False)
            self.register_buffer("ple_proj_norm", torch.empty(self.ple), persistent=False)
        self.inv_freq = {
            t: rope_inv_freq(args.rope_parameters[t], args.head_dim_of(args.layer_types.index(t)))
            for t in set(args.layer_types)
        }
        self._scalars: dict = {}

    def rope(self, pos: torch.Tensor, dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per layer type, ``cos``/``sin`` ``[L, 1, D]`` at the positions ``pos`` [L] (a device tensor)."""
        return {
            t: tuple(c[:, None, :] for c in rope_from_positions(inv, pos, dtype)) for t, inv in self.inv_freq.items()
        }

    def scalars(self, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The embedding scales as 0-d tensors in ``dtype`` (rounded there, as in transformers), made once."""
        key = (dtype, torch.device(device))
        if key not in self._scalars:
            scales = (self.embed_scale, float(self.ple) ** 0.5)
            self._scalars[key] = tuple(torch.tensor(v, dtype=dtype, device=device) for v in scales)
        return self._scalars[key]

    def per_layer_inputs(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        a, n = self.args, self.args.num_hidden_layers
        tok = F.embedding(ids, self.embed_per_layer) * self.scalars(x.dtype, x.device)[1]
        tok = tok.view(*ids.shape, n, self.ple)
        proj = F.linear(x, self.ple_model_proj) * (a.hidden_size**-0.5)
        proj = gemma4_rms_norm(proj.view(*ids.shape, n, self.ple), self.ple_proj_norm, a.rms_norm_eps)
        return (proj + tok) * (2.0**-0.5)

    def fuse_norms(self) -> None:
        """Once the weights are in: each layer's q/k/v norms as one (:meth:`Attention.fuse_norms`)."""
        for layer in self.layers:
            layer.attn.fuse_norms()

    def forward(
        self, ids: torch.Tensor, pos: torch.Tensor, attention: Attend, aux_layers: Iterable[int]
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Run ``ids`` [1, T] at positions ``pos`` [T] (a device tensor) through the body; no LM head: the
        final-norm hidden states [1, T, H] and each aux layer's output [1, T, H]. The one layer loop of every
        forward: where each layer's K/V go and what its queries attend over is ``attention``'s."""
        x = F.embedding(ids, self.embed)
        x = x * self.scalars(x.dtype, x.device)[0]
        pli = self.per_layer_inputs(ids, x) if self.ple else None
        rope = self.rope(pos, x.dtype)
        saved = dict.fromkeys(aux_layers)
        kvs: list = [None] * len(self.layers)
        with sdpa_backends():
            for i, layer in enumerate(self.layers):
                cos, sin = rope[layer.layer_type]
                shared = kvs[self.previous_kvs[i]] if i >= self.args.n_cached else None
                q, k, v = layer.qkv(x, cos, sin, shared is None)
                a, kvs[i] = attention(i, layer, q, k, v, shared)
                x = layer.after_attention(x, layer.attn.output(a), None if pli is None else pli[:, :, i])
                if i in saved:
                    saved[i] = x
        return gemma4_rms_norm(x, self.norm, self.args.rms_norm_eps), saved

    def compile_layers(self) -> None:
        """``--compile``: ``torch.compile`` every layer's row-wise halves (``DecoderLayer.qkv`` and
        ``after_attention``: a few fused kernels around the GEMMs instead of ~70 eager ops) and the attention
        arithmetic over the fetched K/V (``ops.CompiledAttention``); the cache writes stay eager. One graph
        serves every layer of a kind and every length; CUDA graphs then capture the compiled kernels."""
        attend = CompiledAttention()
        for layer in self.layers:
            if layer.moe is not None and layer.moe.grouped_mm is None:
                # the traced grouped GEMM is bf16-only (its meta kernel says so, though eager float32 runs)
                dtype = self.embed.dtype
                layer.moe.grouped_mm = dtype == torch.bfloat16 and grouped_mm_supported(self.embed.device, dtype)
            layer.qkv = compiled(layer.qkv)
            layer.attn.attend = attend
            layer.after_attention = compiled(layer.after_attention)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.embed if self.lm_head is None else self.lm_head
        out = F.linear(hidden, w).float()
        cap = self.args.final_logit_softcapping
        return torch.tanh(out / cap) * cap if cap else out
