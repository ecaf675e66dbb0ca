"""DFlash block-diffusion drafter in PyTorch: the semantics of ``drafter/mlx_backend/model.py`` (its docstring
describes the context and block K/V, the "Gap-B" embedding convention and the reference parameter names).

Here the context K/V are pages of one pool per model (``batch_step.py``), extended with the newly committed positions
only; :class:`TargetHead` holds the target's embedding and LM head (the only tensors read from the target checkpoint).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kakeya.backends.torch import sampling as sampling_torch
from kakeya.backends.torch.graphs import GraphOptions
from kakeya.backends.torch.ops import (
    apply_rope,
    attention_kernel_wanted,
    compiled,
    default_inv_freq,
    qwen3_rms_norm,
    rope_cos_sin,
    sdpa,
)
from kakeya.drafter.backend import KV, aux_rows, scale_embedding, scale_logits
from kakeya.drafter.config import DFlashConfig
from kakeya.drafter.context import DEFAULT_STEP, Segment, split_rows
from kakeya.drafter.torch_backend import batch_step
from kakeya.drafter.torch_backend.batch_step import DraftPool, PooledContext


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


MAX_FREE_CACHES = 4  # closed sessions' caches (with their ring pages) kept for reuse


class Attention(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.spec = a = config.layer_attention(layer_idx)
        self.eps = config.rms_norm_eps
        h = config.hidden_size
        self.q_proj = nn.Linear(h, a.n_heads * a.head_dim, bias=False)
        self.k_proj = nn.Linear(h, a.n_kv * a.head_dim, bias=False)
        self.v_proj = nn.Linear(h, a.n_kv * a.head_dim, bias=False)
        self.o_proj = nn.Linear(a.n_heads * a.head_dim, h, bias=False)
        self.q_norm = nn.Module()
        self.q_norm.weight = nn.Parameter(torch.ones(a.head_dim))
        self.k_norm = nn.Module()
        self.k_norm.weight = nn.Parameter(torch.ones(a.head_dim))

    wqkv: torch.Tensor | None = None  # set by fuse(): q, k, v rows of one weight (inference)
    qk_scale: torch.Tensor | None = None  # set by fuse() in float32: q_norm's and k_norm's weight per head

    def fuse(self) -> None:
        """For inference: q, k and v as one weight, one GEMM (a few-row GEMM costs its launch, not its
        FLOPs); the Linear weights become views of it (no second copy, the same names and values)."""
        if self.wqkv is not None:
            return
        w = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]).detach()
        nq, nkv = self.q_proj.out_features, self.k_proj.out_features
        self.wqkv = w
        a = self.spec
        if w.dtype == torch.float32:  # one norm for q and k, then their weights: bit for bit in float32 only
            self.qk_scale = torch.cat(
                [self.q_norm.weight.detach().expand(a.n_heads, -1), self.k_norm.weight.detach().expand(a.n_kv, -1)]
            ).contiguous()
        for proj, rows in ((self.q_proj, w[:nq]), (self.k_proj, w[nq : nq + nkv]), (self.v_proj, w[nq + nkv :])):
            proj.weight = nn.Parameter(rows, requires_grad=False)

    def kv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """K/V ``[1, n_kv, S, hd]`` of rows ``h`` [1, S, hidden] at the positions of ``cos``/``sin`` [S, hd]."""
        B, S, _ = h.shape
        a = self.spec
        k = qwen3_rms_norm(self.k_proj(h).view(B, S, a.n_kv, a.head_dim), self.k_norm.weight, self.eps)
        k = apply_rope(k.transpose(1, 2), cos, sin)
        v = self.v_proj(h).view(B, S, a.n_kv, a.head_dim).transpose(1, 2)
        return k, v

    def query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Queries ``[B, n_heads, L, hd]`` of rows ``x`` [B, L, hidden] at the positions of ``cos``/``sin``."""
        B, L, _ = x.shape
        a = self.spec
        q = qwen3_rms_norm(self.q_proj(x).view(B, L, a.n_heads, a.head_dim), self.q_norm.weight, self.eps)
        return apply_rope(q.transpose(1, 2), cos, sin)

    def qkv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """``query`` and ``kv`` of the same rows; once fused, one GEMM and one RoPE for q and k."""
        if self.wqkv is None:
            return self.query(h, cos, sin), *self.kv(h, cos, sin)
        B, L, _ = h.shape
        a = self.spec
        if self.qk_scale is not None and h.dtype == torch.float32:
            # q and k heads side by side: one norm, one scale, one RoPE (a CPU draft is mostly op dispatch)
            heads = F.linear(h, self.wqkv).view(B, L, a.n_heads + 2 * a.n_kv, a.head_dim)
            qk = F.rms_norm(heads[:, :, : a.n_heads + a.n_kv], (a.head_dim,), None, self.eps) * self.qk_scale
            q, k = apply_rope(qk.transpose(1, 2), cos, sin).split([a.n_heads, a.n_kv], dim=1)
            return q, k, heads[:, :, a.n_heads + a.n_kv :].transpose(1, 2)
        q, k, v = F.linear(h, self.wqkv).split([self.q_proj.out_features] + [self.k_proj.out_features] * 2, dim=-1)
        q = qwen3_rms_norm(q.view(B, L, a.n_heads, a.head_dim), self.q_norm.weight, self.eps)
        k = qwen3_rms_norm(k.view(B, L, a.n_kv, a.head_dim), self.k_norm.weight, self.eps)
        q, k = apply_rope(torch.cat([q, k], dim=2).transpose(1, 2), cos, sin).split([a.n_heads, a.n_kv], dim=1)
        return q, k, v.view(B, L, a.n_kv, a.head_dim).transpose(1, 2)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, act: str = "silu"):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)
        if act != "silu":
            raise ValueError(f"unsupported drafter hidden_act {act!r}")

    w_gate_up: torch.Tensor | None = None  # set by fuse() (inference)

    def fuse(self) -> None:
        """For inference: gate and up as one weight (one GEMM); the Linear weights become views."""
        if self.w_gate_up is None:
            self.w_gate_up = w = torch.cat([self.gate_proj.weight, self.up_proj.weight]).detach()
            n = self.gate_proj.out_features
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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Sequence[Segment]):
        """Block rows ``x`` [N, L, hidden] at the positions of ``cos``/``sin``: several sessions' blocks in
        a row, each attending to its own context (its ``Segment``)."""
        q, k, v = self.project(x, cos, sin)
        return self.finish(x, attend(q, k, v, segments, self.self_attn.spec.scale))

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """The input norm, then the rows' q, k, v (normed and rotated): row-wise (``compile_layers`` fuses it)."""
        return self.self_attn.qkv(self.input_layernorm(x), cos, sin)

    def finish(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Everything after attention (``out`` [B, heads, L, hd]): o_proj, the residuals, the MLP."""
        B, _, L, _ = out.shape
        h = x + self.self_attn.o_proj(out.transpose(1, 2).reshape(B, L, -1))
        return h + self.mlp(self.post_attention_layernorm(h))


class GivenContext:
    """Context K/V ``[N, n_kv, T, hd]`` handed in as tensors (the block trainer's: many blocks over one
    precomputed context): the ``Segment.context`` a block attends to before its own keys."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys, self.values = keys, values

    def with_block(self, view, k: torch.Tensor, v: torch.Tensor):
        return torch.cat([self.keys, k], dim=2), torch.cat([self.values, v], dim=2)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Sequence[Segment], scale: float):
    """Attention over rows that are several blocks in a row (dim 2): each segment's queries see its
    own context and its own block's keys, so a block attends in a batch as it does alone."""
    if len(segments) == 1:  # one block: no slicing (the CPU path is launch-bound)
        s = segments[0]
        return sdpa(q, *s.context.with_block(s.view, k, v), s.mask, scale)
    outs, at = [], 0
    for s in segments:
        rows = slice(at, at + s.rows)
        keys, values = s.context.with_block(s.view, k[:, :, rows], v[:, :, rows])
        outs.append(sdpa(q[:, :, rows], keys, values, s.mask, scale))
        at += s.rows
    return torch.cat(outs, dim=2)


class TargetHead:
    """The target's embedding table and LM head (tied when ``head`` is None), raw tensors."""

    def __init__(self, embed: torch.Tensor, head: torch.Tensor | None = None):
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
        return sum(t.numel() * t.element_size() for t in ([self.embed] if self.tied else [self.embed, self.head]))


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
        self.target: TargetHead | None = None
        self._free: list[PooledContext] = []  # closed sessions' caches kept for the next (graphs on)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    convolves = False  # DFlash2's conv layers and selector (``dflash2.py``) run their own draft step

    # capabilities (``drafter/backend.py``): eager, exact shapes until use_graphs
    min_batch = 2
    graph_options = GraphOptions()
    attention_kernel = False  # the Triton decode-attention kernel in the step (``use_attention_kernel``)

    def use_attention_kernel(self, wanted: bool | None = None) -> DFlashDraftModel:
        """Attend through the Triton decode-attention kernel (default: on CUDA where triton imports; asked
        for, also on the CPU under Triton's interpreter, how tests run it)."""
        self.attention_kernel = attention_kernel_wanted(self.device, wanted)
        return self

    @property
    def static_step(self) -> batch_step.DraftSteps | None:
        """The steps with static shapes (CUDA graphs, or eagerly with ``static_extent`` alone), or None."""
        return self.steps if self.graph_options.static_extent else None

    def use_graphs(self, options: GraphOptions) -> DFlashDraftModel:
        """Run every draft step with static shapes (``batch_step.py``): captured in CUDA graphs with
        ``options.capture``; eagerly with ``static_extent`` alone (how a CPU tests it)."""
        self.graph_options = options
        self.min_batch = options.batch_from  # backends/torch/graphs.py: GRAPHED_MIN_BATCH
        self._steps = None
        return self

    _pool: DraftPool | None = None
    _steps: batch_step.DraftSteps | None = None

    @property
    def pool(self) -> DraftPool:
        """Every session's context K/V (made on first use, on the model's device and dtype by then)."""
        if self._pool is None:
            self._pool = DraftPool(self.config, self.device, self.dtype)
        return self._pool

    @property
    def steps(self) -> batch_step.DraftSteps:
        if self._steps is None:
            opts = self.graph_options
            self._steps = batch_step.DraftSteps(self, opts, torch.cuda.graph_pool_handle() if opts.capture else None)
        return self._steps

    def fuse_projections(self) -> DFlashDraftModel:
        """For inference (``TorchDrafter``): each layer's q/k/v and gate/up weights as one GEMM each (views:
        no memory added), and one GEMM for all layers' context K/V. Training keeps the separate Linears."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        if self.w_context_kv is None:
            # Every layer projects the SAME context rows: one GEMM, norm and RoPE for all of them.
            # A copy of the layers' K/V rows (a few % of the drafter), since they sit in wqkv too.
            self.w_context_kv = torch.cat([l.self_attn.wqkv[l.self_attn.q_proj.out_features :] for l in self.layers])
            self.context_k_norm = torch.stack([layer.self_attn.k_norm.weight.detach() for layer in self.layers])
        return self

    w_context_kv: torch.Tensor | None = None  # set by fuse_projections

    def layers_kv(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's context ``(k, v)`` ``[B, n_kv, S, hd]`` of the context rows ``h`` [B, S, hidden]."""
        if self.w_context_kv is None:
            return [layer.self_attn.kv(h, cos, sin) for layer in self.layers]
        B, S, _ = h.shape
        a = self.layers[0].self_attn.spec  # every layer's K/V rows have the same shape
        kv = F.linear(h, self.w_context_kv).view(B, S, len(self.layers), 2, a.n_kv, a.head_dim)
        # Qwen3's k norm per layer: normalise (rounded to the activation dtype), then that layer's weight
        k = F.rms_norm(kv[:, :, :, 0], (a.head_dim,), None, self.config.rms_norm_eps) * self.context_k_norm[:, None, :]
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

    def make_cache(self, step: int = DEFAULT_STEP) -> PooledContext:
        """A new session's context: pages of the model's pool (``step``: MLX's buffer growth), or a closed
        session's cache, kept with its ring pages when graphs are on (:meth:`release_cache`)."""
        return self._free.pop() if self._free else PooledContext(self.pool)

    def release_cache(self, cache: PooledContext) -> None:
        if self.static_step is not None and len(self._free) < MAX_FREE_CACHES:
            cache.reset()
            self._free.append(cache)
        else:
            cache.release()

    # -- the pieces of a forward (the batched step and the block trainer share them) ----------

    def rope(self, spans: Sequence[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows of each ``(start, n)`` span of positions, the spans in a row."""
        tables = [rope_cos_sin(self.inv_freq, start, n, self.device, self.dtype, self.rope_scale) for start, n in spans]
        if len(tables) == 1:
            return tables[0]
        return torch.cat([c for c, _ in tables]), torch.cat([s for _, s in tables])

    def context_rows(self, aux: torch.Tensor) -> torch.Tensor:
        """The rows every layer projects its context K/V from: ``hidden_norm(fc(aux))`` [1, n, hidden]."""
        return self.hidden_norm(self.fc(aux.to(device=self.device, dtype=self.dtype)))[None]

    def embed_block(self, ids: torch.Tensor) -> torch.Tensor:
        """Block rows [1, L, hidden] of token ids [L] (Gap-B: ``backend.scale_embedding``)."""
        if self.target is None:
            raise RuntimeError("drafter is not bound to a target embedding/LM head")
        return scale_embedding(self.config, self.target.embed_rows(ids).to(self.dtype))[None]

    @torch.inference_mode()
    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """float32 logits of final-norm hidden rows ``h`` through the target's LM head."""
        return scale_logits(self.config, self.target.logits(h).float(), torch.tanh)

    # -- the ``DraftModel`` protocol (``drafter/backend.py``) ---------------------------------------

    backend = "torch"
    sampler = sampling_torch  # a sampling session's candidates: its noisy argmax, or its top-K proposal

    @property
    def device_name(self) -> str:
        return str(self.device)

    def read_aux(self, new_aux) -> torch.Tensor:
        """``new_aux`` ([n, width] or [1, n, width], any float array) as ``[n, width]`` on the device."""
        aux = as_torch(new_aux, self.device, self.dtype)
        return aux[0] if aux_rows(tuple(aux.shape), self.config.aux_width) else aux

    def zeros_aux(self, n: int) -> torch.Tensor:
        return torch.zeros((n, self.config.aux_width), device=self.device, dtype=self.dtype)

    @torch.inference_mode()
    def context_kv(self, auxs: Sequence[torch.Tensor], offsets: Sequence[int]) -> list[list[KV]]:
        """``DraftModel.context_kv``: ``fc``, ``hidden_norm`` and the K/V projection once over all rows."""
        rows = auxs[0] if len(auxs) == 1 else torch.cat(list(auxs))
        kv = self.layers_kv(self.context_rows(rows), *self.rope([(o, a.shape[0]) for o, a in zip(offsets, auxs)]))
        return split_rows(kv, [a.shape[0] for a in auxs])

    def block_logits(self, blocks: Sequence[tuple[PooledContext, Sequence[int]]]) -> torch.Tensor:
        """``DraftModel.block_logits``: one batched step (``batch_step.py``) with no extension."""
        return batch_step.run(self, [], blocks, greedy=False, keep_logits=True)[1]

    def draft_step(self, extensions, blocks, greedy: bool, keep_logits: bool):
        """``DraftModel.draft_step`` as ONE batched step (``batch_step.py``): extensions and blocks, one host sync."""
        return batch_step.run(self, extensions, blocks, greedy, keep_logits)

    def argmax(self, logits: torch.Tensor, caches: Sequence[PooledContext]) -> list[int]:
        return torch.argmax(logits, dim=-1).tolist()

    def ranked(self, logits: torch.Tensor, k: int) -> tuple[list[list[int]], list[list[float]]]:
        top = torch.topk(logits.float(), k, dim=-1)
        logp = top.values - torch.logsumexp(logits.float(), dim=-1, keepdim=True)
        return top.indices.tolist(), logp.tolist()

    def materialize(self, caches: Sequence[PooledContext]) -> None:
        """Nothing to do: torch runs eagerly (so does ``argmax``: the caches are written)."""

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
