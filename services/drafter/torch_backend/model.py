"""DFlash block-diffusion drafter in PyTorch (same semantics as ``drafter/mlx_backend/model.py``).

A stack of Qwen3-style decoder layers whose attention keys/values are

* the *context*: ``hidden_norm(fc(aux))`` (``aux`` = the target's hidden states
  at ``target_layer_ids``, concatenated) projected by each layer's
  ``k_proj``/``v_proj`` (``k_norm`` + RoPE at the context positions on keys).
  Context K/V only ever grows, so it is cached (:class:`ContextKVCache`) and
  extended with the newly committed positions -- O(new) per block;
* the *block*: ``[last committed token, mask, mask, ...]`` embedded with the
  target's embedding table, queried at positions ``ctx_len .. ctx_len+B-1``.

No embedding or LM head of its own: :class:`TargetHead` holds the target's two
tensors (only those are read from the target checkpoint) and uses them with raw
weight ops.

Embedding convention ("Gap-B"): the block embedding is the target's RAW
embedding row times ``input_embedding_scale`` -- never Gemma's sqrt(hidden).
Logits: target LM head x ``output_multiplier``, then soft-capped.

Parameter names follow the reference checkpoint layout (``fc``, ``hidden_norm``,
``layers.N.self_attn.q_proj`` ..., ``norm``), so published drafters load as is.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from kakeya.backends.torch import sampling as sampling_torch
from kakeya.backends.torch.graphs import GRAPHED_MIN_BATCH, GraphOptions
from kakeya.backends.torch.ops import (
    apply_rope,
    compiled,
    default_inv_freq,
    qwen3_rms_norm,
    rope_cos_sin,
    sdpa,
    sdpa_backends,
)
from kakeya.core.contract import FULL, SLIDING  # noqa: F401  (FULL re-exported)
from kakeya.drafter.config import DFlashConfig, aux_rows  # noqa: F401  (DFlashConfig re-exported)
from kakeya.drafter.context import DEFAULT_STEP, BlockView, block_mask
from kakeya.drafter.torch_backend import batch as batch_torch
from kakeya.drafter.torch_backend.context import ContextKVCache, GivenContext, LayerKV  # noqa: F401  (re-exported)
from kakeya.drafter.torch_backend.step import propose_static


def rope_inv_freq(config: DFlashConfig) -> tuple[torch.Tensor, float]:
    """float32 inverse frequencies and the cos/sin scale (Qwen3 rotary embedding)."""
    rope = dict(config.rope_scaling or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    hd = config.head_dim
    base = float(rope.get("rope_theta", config.rope_theta))
    if rope_type in ("default", "linear"):
        inv = default_inv_freq(base, hd)
        if rope_type == "linear":
            inv = inv / float(rope["factor"])
        return inv, 1.0
    # Other scalings: transformers' own init functions (computed once, off the hot path).
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    raw = {k: v for k, v in config.raw.items() if k not in ("dflash_config", "architectures", "model_type")}
    qcfg = Qwen3Config(**raw)
    inv, scale = ROPE_INIT_FUNCTIONS[rope_type](qcfg, torch.device("cpu"))
    return inv.float(), float(scale)


STATIC_CONTEXT = 4096  # full-layer context rows preallocated when graphs are on (as the verifier's)
MAX_FREE_CACHES = 4  # closed sessions' caches (with their graphs) kept for reuse


# --------------------------------------------------------------------------- layers


class Attention(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        h = config.hidden_size
        self.n_heads = config.num_attention_heads
        self.n_kv = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.eps = config.rms_norm_eps
        sliding = config.layer_types[layer_idx] == SLIDING
        self.window: Optional[int] = int(config.sliding_window) if sliding else None
        self.is_causal = sliding if config.is_causal is None else bool(config.is_causal)
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=False)
        self.q_norm = nn.Module()
        self.q_norm.weight = nn.Parameter(torch.ones(self.head_dim))
        self.k_norm = nn.Module()
        self.k_norm.weight = nn.Parameter(torch.ones(self.head_dim))

    wqkv: Optional[torch.Tensor] = None  # set by fuse(): q, k, v rows of one weight (inference)

    def fuse(self) -> None:
        """For inference: q, k and v as one weight, so a block's projections are one GEMM (a
        few-row GEMM costs its launch, not its FLOPs). The Linear weights become views of it:
        no second copy, the same names and values."""
        if self.wqkv is not None:
            return
        w = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]).detach()
        nq, nkv = self.q_proj.out_features, self.k_proj.out_features
        self.wqkv = w
        for proj, rows in ((self.q_proj, w[:nq]), (self.k_proj, w[nq : nq + nkv]), (self.v_proj, w[nq + nkv :])):
            proj.weight = nn.Parameter(rows, requires_grad=False)

    def kv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """K/V ``[1, n_kv, S, hd]`` of rows ``h`` [1, S, hidden] at the positions of ``cos``/``sin`` [S, hd]."""
        B, S, _ = h.shape
        k = qwen3_rms_norm(self.k_proj(h).view(B, S, self.n_kv, self.head_dim), self.k_norm.weight, self.eps)
        k = apply_rope(k.transpose(1, 2), cos, sin)
        v = self.v_proj(h).view(B, S, self.n_kv, self.head_dim).transpose(1, 2)
        return k, v

    def query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Queries ``[B, n_heads, L, hd]`` of rows ``x`` [B, L, hidden] at the positions of ``cos``/``sin``."""
        B, L, _ = x.shape
        q = qwen3_rms_norm(self.q_proj(x).view(B, L, self.n_heads, self.head_dim), self.q_norm.weight, self.eps)
        return apply_rope(q.transpose(1, 2), cos, sin)

    def qkv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """``query`` and ``kv`` of the same rows; once fused, one GEMM and one RoPE for q and k."""
        if self.wqkv is None:
            return self.query(h, cos, sin), *self.kv(h, cos, sin)
        B, L, _ = h.shape
        q, k, v = F.linear(h, self.wqkv).split([self.q_proj.out_features] + [self.k_proj.out_features] * 2, dim=-1)
        q = qwen3_rms_norm(q.view(B, L, self.n_heads, self.head_dim), self.q_norm.weight, self.eps)
        k = qwen3_rms_norm(k.view(B, L, self.n_kv, self.head_dim), self.k_norm.weight, self.eps)
        q, k = apply_rope(torch.cat([q, k], dim=2).transpose(1, 2), cos, sin).split([self.n_heads, self.n_kv], dim=1)
        return q, k, v.view(B, L, self.n_kv, self.head_dim).transpose(1, 2)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, act: str = "silu"):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)
        if act != "silu":
            raise ValueError(f"unsupported drafter hidden_act {act!r}")

    w_gate_up: Optional[torch.Tensor] = None  # set by fuse() (inference)

    def fuse(self) -> None:
        """For inference: gate and up as one weight (one GEMM); the Linear weights become views."""
        if self.w_gate_up is not None:
            return
        w = torch.cat([self.gate_proj.weight, self.up_proj.weight]).detach()
        n = self.gate_proj.out_features
        self.w_gate_up = w
        self.gate_proj.weight = nn.Parameter(w[:n], requires_grad=False)
        self.up_proj.weight = nn.Parameter(w[n:], requires_grad=False)

    def forward(self, x):
        if self.w_gate_up is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = F.linear(x, self.w_gate_up).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class _Norm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return qwen3_rms_norm(x, self.weight, self.eps)


class DecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.input_layernorm = _Norm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = _Norm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, ctx: "LayerKV | GivenContext", view: Optional[BlockView], cos, sin, mask):
        q, k, v = self.project(x, cos, sin)
        k, v = ctx.with_block(view, k, v)
        return self.finish(x, sdpa(q, k, v, mask, self.self_attn.scale))

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """The input norm, then the rows' q, k, v (normed and rotated): row-wise, so batches
        flatten and ``compile_layers`` fuses it."""
        return self.self_attn.qkv(self.input_layernorm(x), cos, sin)

    def finish(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Everything after attention (``out`` [B, heads, L, hd]): o_proj, the residuals, the MLP."""
        B, _, L, _ = out.shape
        h = x + self.self_attn.o_proj(out.transpose(1, 2).reshape(B, L, -1))
        return h + self.mlp(self.post_attention_layernorm(h))


# --------------------------------------------------------------------------- target tensors


class TargetHead:
    """The target's embedding table and LM head (tied when ``head`` is None), raw tensors."""

    def __init__(self, embed: torch.Tensor, head: Optional[torch.Tensor] = None):
        self.embed = embed
        self.head = embed if head is None else head
        self.tied = head is None

    @property
    def vocab_size(self) -> int:
        return self.embed.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.embed.shape[1]

    def embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embed)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.head)

    @property
    def nbytes(self) -> int:
        n = self.embed.numel() * self.embed.element_size()
        return n if self.tied else n + self.head.numel() * self.head.element_size()


# --------------------------------------------------------------------------- model


class DFlashDraftModel(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(config.aux_width, config.hidden_size, bias=False)
        self.hidden_norm = _Norm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = _Norm(config.hidden_size, config.rms_norm_eps)
        inv, scale = rope_inv_freq(config)
        self.register_buffer("inv_freq", inv, persistent=False)
        self.rope_scale = scale
        self.target: Optional[TargetHead] = None

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def bind(self, target: TargetHead) -> "DFlashDraftModel":
        if target.hidden_size != self.config.hidden_size:
            raise ValueError(
                f"target hidden_size {target.hidden_size} != draft hidden_size {self.config.hidden_size}"
            )
        self.target = target
        return self

    graph_options = GraphOptions()  # eager, dynamic shapes (the CPU default); see use_graphs
    graph_pool = None

    @property
    def min_batch(self) -> int:
        """Fewest queued sessions ``draft_batch`` runs as one forward (graphs: see GRAPHED_MIN_BATCH)."""
        return GRAPHED_MIN_BATCH if self.graph_options.capture else 2

    def use_graphs(self, options: GraphOptions) -> "DFlashDraftModel":
        """Draft greedy blocks through the static step (``drafter/torch_backend/step.py``): captured in CUDA graphs
        with ``options.capture``; eagerly with ``static_extent`` alone (how a CPU tests it)."""
        if options.capture and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.graph_options = options
        self.graph_pool = torch.cuda.graph_pool_handle() if options.capture else None
        self._free: list[ContextKVCache] = []
        return self

    def fuse_projections(self) -> "DFlashDraftModel":
        """For inference (``TorchDrafter`` does it): each layer's q/k/v and gate/up weights as one
        GEMM each, the way the target stores them (views: no memory added), and one GEMM for all
        layers' context K/V. Training keeps the separate Linear layers."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        if self.w_context_kv is None:
            # Every layer projects the SAME context rows: one GEMM, norm and RoPE for all of them.
            # A copy of the layers' K/V rows (a few % of the drafter), since they sit in wqkv too.
            self.w_context_kv = torch.cat([l.self_attn.wqkv[l.self_attn.q_proj.out_features :] for l in self.layers])
            self.context_k_norm = torch.stack([layer.self_attn.k_norm.weight.detach() for layer in self.layers])
        return self

    w_context_kv: Optional[torch.Tensor] = None  # set by fuse_projections

    def layers_kv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's context ``(k, v)`` ``[B, n_kv, S, hd]`` of the context rows ``h`` [B, S, hidden]."""
        if self.w_context_kv is None:
            return [layer.self_attn.kv(h, cos, sin) for layer in self.layers]
        B, S, _ = h.shape
        a = self.layers[0].self_attn
        kv = F.linear(h, self.w_context_kv).view(B, S, len(self.layers), 2, a.n_kv, a.head_dim)
        # Qwen3's k norm per layer: normalise (rounded to the activation dtype), then that layer's weight
        k = F.rms_norm(kv[:, :, :, 0], (a.head_dim,), None, a.eps) * self.context_k_norm[:, None, :]
        k = apply_rope(k.permute(0, 2, 3, 1, 4), cos, sin)  # [B, layers, n_kv, S, hd]
        v = kv[:, :, :, 1].permute(0, 2, 3, 1, 4)
        return [(k[:, i], v[:, i]) for i in range(len(self.layers))]

    def compile_layers(self) -> None:
        """``--compile``: ``torch.compile`` each layer's row-wise halves (``DecoderLayer.project``,
        ``finish``) and the context K/V projection, as the target's ``compile_layers`` does."""
        for layer in self.layers:
            layer.project = compiled(layer.project)
            layer.finish = compiled(layer.finish)
        self.layers_kv = compiled(self.layers_kv)  # every layer's context K/V (fused or one by one)

    def make_cache(self, step: int = DEFAULT_STEP) -> ContextKVCache:
        if self.graph_options.static_extent:
            if self._free:  # a closed session's buffers and graphs: recapturing would cost more than a block
                return self._free.pop()
            return ContextKVCache(self.config, step=step, full_step=STATIC_CONTEXT)
        return ContextKVCache(self.config, step=step)

    def release_cache(self, cache: ContextKVCache) -> None:
        """A closed session's cache: kept for the next session when graphs are on, else dropped."""
        if self.graph_options.static_extent and cache.static is not None and len(self._free) < MAX_FREE_CACHES:
            cache.plan.reset()
            self._free.append(cache)

    def _cos_sin(self, start: int, n: int):
        return rope_cos_sin(self.inv_freq, start, n, self.device, self.dtype, self.rope_scale)

    @torch.inference_mode()
    def context_kv(self, aux: torch.Tensor, offset: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer ``(k, v)`` ``[1, n_kv, n, hd]`` for aux rows ``[n, aux_width]`` at ``offset..``."""
        if aux.ndim == 2:
            aux = aux[None]
        h = self.hidden_norm(self.fc(aux.to(device=self.device, dtype=self.dtype)))
        return self.layers_kv(h, *self._cos_sin(offset, h.shape[1]))

    @torch.inference_mode()
    def extend(self, cache: ContextKVCache, aux: torch.Tensor) -> None:
        """Append the context K/V of ``aux`` (the next positions) to ``cache``."""
        if aux.shape[-2] == 0:
            return
        cache.append(self.context_kv(aux, cache.length))

    @torch.inference_mode()
    def draft_hidden(self, block_ids: torch.Tensor, cache: ContextKVCache, span: str = "valid") -> torch.Tensor:
        """Final-norm hidden ``[B, hidden]`` of the block in ONE forward.

        ``span`` (see ``context.py``): "valid" attends over exactly the visible
        rows and the block; "capacity" over every buffer row with a mask.
        """
        if self.target is None:
            raise RuntimeError("drafter is not bound to a target embedding/LM head")
        ids = block_ids.reshape(-1).to(self.device)
        B = ids.shape[0]
        x = self.target.embed_rows(ids).to(self.dtype)
        if self.config.input_embedding_scale != 1.0:
            x = x * self.config.input_embedding_scale
        x = x[None]
        cos, sin = self._cos_sin(cache.length, B)
        views = cache.plan.block(B, scratch=True, span=span)
        masks: dict = {}
        with sdpa_backends():
            for layer, ctx in zip(self.layers, cache.layers):
                attn, view = layer.self_attn, views[ctx.layout]
                key = (ctx.layout, attn.is_causal)
                if key not in masks:
                    m = block_mask(view, B, is_causal=attn.is_causal, window=attn.window, span=span)
                    masks[key] = None if m is None else torch.from_numpy(m).to(self.device, non_blocking=True)
                x = layer(x, ctx, view, cos, sin, masks[key])
        return self.norm(x[0])

    @torch.inference_mode()
    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.target.logits(h).float()
        if self.config.output_multiplier != 1.0:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap is not None and cap > 0:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def draft_logits(self, block_ids: torch.Tensor, cache: ContextKVCache, span: str = "valid") -> torch.Tensor:
        """Logits ``[B-1, vocab]`` for block positions ``1..B-1``."""
        return self.compute_logits(self.draft_hidden(block_ids, cache, span)[1:])

    def draft_tokens(self, block_ids: torch.Tensor, cache: ContextKVCache, span: str = "valid") -> torch.Tensor:
        """Greedy draft tokens ``[B-1]`` (on the device; no host sync)."""
        return torch.argmax(self.draft_logits(block_ids, cache, span), dim=-1)

    # -- what a backend-neutral ``DrafterSession`` asks of its model ------------------------

    backend = "torch"
    sampler = sampling_torch  # the processed q and its top-K proposal when a session samples
    batched = batch_torch  # several sessions' extend + block forward as one (``batch.py``)

    @property
    def device_name(self) -> str:
        return str(self.device)

    def read_aux(self, new_aux) -> torch.Tensor:
        """``new_aux`` ([n, width] or [1, n, width], any float array) as ``[n, width]`` on the device."""
        aux = as_torch(new_aux, self.device, self.dtype)
        return aux[0] if aux_rows(tuple(aux.shape), self.config.aux_width) else aux

    def zeros_aux(self, n: int) -> torch.Tensor:
        return torch.zeros((n, self.config.aux_width), device=self.device, dtype=self.dtype)

    def propose(self, cache: ContextKVCache, new_aux: torch.Tensor, last_token: int, block_size: int) -> list[int]:
        """Extend ``cache`` by ``new_aux``, then draft the block ``[last_token, mask * (B-1)]``
        greedily; one host sync (with graphs on, both in one static step: ``drafter/torch_backend/step.py``)."""
        if self.graph_options.static_extent:
            return propose_static(self, cache, new_aux, last_token, block_size)
        self.extend(cache, new_aux)
        return self.draft_tokens(self._block(last_token, block_size), cache).tolist()

    @torch.inference_mode()
    def propose_logits(self, last_token: int, block_size: int, cache: ContextKVCache) -> torch.Tensor:
        """The same block's logits ``[B-1, vocab]`` (on the device), for a sampling session."""
        return self.draft_logits(self._block(last_token, block_size), cache)

    def _block(self, last_token: int, block_size: int) -> torch.Tensor:
        block = torch.tensor([last_token] + [self.config.mask_token_id] * (block_size - 1), dtype=torch.long)
        return block.to(self.device, non_blocking=True)

    def settle(self, cache: ContextKVCache) -> None:
        """Nothing to do: torch runs eagerly."""

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def as_torch(aux, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``aux`` as a floating tensor on ``device`` (numpy round trip for foreign arrays, e.g. ``mx.array``)."""
    if isinstance(aux, torch.Tensor):
        t = aux
    else:
        import numpy as np

        a = np.asarray(aux)
        if a.dtype.kind != "f":
            raise ValueError(f"new_aux must be floating point, got {a.dtype}")
        t = torch.from_numpy(np.ascontiguousarray(a))
    if not t.is_floating_point():
        raise ValueError(f"new_aux must be floating point, got {t.dtype}")
    return t.to(device=device, dtype=dtype, non_blocking=True)
