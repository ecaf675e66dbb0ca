"""DFlash block-diffusion drafter in MLX.

The drafter is a stack of Qwen3-style decoder layers whose attention sees two
kinds of keys/values:

* the *context*: ``hidden_norm(fc(aux))`` where ``aux`` is the concatenation of
  the target's hidden states at ``target_layer_ids``; every layer projects it
  with its own ``k_proj``/``v_proj`` (``k_norm`` on keys, RoPE at the context
  positions). Context K/V only ever grows, so it is cached (``ContextKVCache``)
  and extended with the newly committed positions;
* the *block*: ``[last committed token, mask, mask, ...]`` embedded with the
  target's embedding table, queried at positions ``ctx_len .. ctx_len+B-1``.

It owns no embedding or LM head: both are borrowed from the target (only those
two tensors are read from the target checkpoint, see ``load_dflash_mlx``).

Embedding convention ("Gap-B"): the block embedding is the target's RAW
embedding row times ``input_embedding_scale`` -- never Gemma's sqrt(hidden)
input scale. (The ``dflash`` reference's MLX ``bind()`` multiplies by the
target's ``embed_scale``; its torch code and training use the raw lookup.)

Parameter names follow the reference checkpoint layout so that the published
safetensors load with ``load_weights(strict=True)``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import initialize_rope

from kakeya.backends.mlx import sampling as sampling_mlx
from kakeya.checkpoints.layout import find_text_tensors, shard_files
from kakeya.core.contract import FULL, SLIDING  # noqa: F401  (FULL re-exported)
from kakeya.drafter import context
from kakeya.drafter.config import DFlashConfig, aux_rows  # noqa: F401  (DFlashConfig re-exported)
from kakeya.drafter.context import DEFAULT_STEP, Append, BlockView, ContextLayout, block_mask
from kakeya.drafter.mlx_backend import batch as batch_mlx

# --------------------------------------------------------------------------- layers


class MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        dim = config.hidden_size
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        sliding = config.layer_types[layer_idx] == SLIDING
        # Context positions a query can see: p_query - p_key < window.
        self.window: Optional[int] = int(config.sliding_window) if sliding else None
        self.is_causal = sliding if config.is_causal is None else bool(config.is_causal)

        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def project_kv(self, h: mx.array) -> tuple[mx.array, mx.array]:
        """K (normed, before RoPE) and V ``[B, n_kv, L, head_dim]`` of rows ``h``."""
        B, L, _ = h.shape
        k = self.k_norm(self.k_proj(h).reshape(B, L, self.n_kv_heads, -1))
        v = self.v_proj(h).reshape(B, L, self.n_kv_heads, -1)
        return k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

    def project_q(self, x: mx.array) -> mx.array:
        """Queries (normed, before RoPE) ``[B, n_heads, L, head_dim]`` of rows ``x``."""
        B, L, _ = x.shape
        return self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)

    def _kv(self, h: mx.array, rope: nn.Module, offset: int) -> tuple[mx.array, mx.array]:
        k, v = self.project_kv(h)
        return rope(k, offset=offset), v

    def context_kv(self, h_ctx: mx.array, rope: nn.Module, offset: int):
        """K/V ``[1, n_kv, S, head_dim]`` of context rows at positions ``offset..offset+S-1``."""
        return self._kv(h_ctx, rope, offset)

    def __call__(self, x: mx.array, ctx: "LayerKV", view: BlockView, rope: nn.Module, pos: int, mask) -> mx.array:
        B, L, _ = x.shape
        q = rope(self.project_q(x), offset=pos)
        k, v = ctx.with_block(view, *self._kv(x, rope, pos))
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class DecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def __call__(self, x, ctx, view, rope, pos, mask):
        h = x + self.self_attn(self.input_layernorm(x), ctx, view, rope, pos, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


# --------------------------------------------------------------------------- context cache


class LayerKV:
    """One layer's context K/V: ``[1, n_kv, capacity, hd]`` buffers, rows planned by its layout.

    A block attends over ``visible context ++ block`` (a concatenation: MLX
    arrays are values, so writing the block into the buffer buys nothing).
    """

    def __init__(self, layout: ContextLayout):
        self.layout = layout
        self.keys: Optional[mx.array] = None
        self.values: Optional[mx.array] = None

    def append(self, plan: Append, k: mx.array, v: mx.array) -> None:
        r = plan.resize
        if r is not None:
            B, H, _, D = k.shape
            nk = mx.zeros((B, H, r.capacity, D), dtype=k.dtype)
            nv = mx.zeros((B, H, r.capacity, v.shape[3]), dtype=v.dtype)
            if r.count:
                nk[..., : r.count, :] = self.keys[..., r.src : r.src + r.count, :]
                nv[..., : r.count, :] = self.values[..., r.src : r.src + r.count, :]
            self.keys, self.values = nk, nv
        if plan.n:
            self.keys[..., plan.dst : plan.dst + plan.n, :] = k[..., plan.skip :, :]
            self.values[..., plan.dst : plan.dst + plan.n, :] = v[..., plan.skip :, :]

    def visible(self) -> tuple[Optional[mx.array], Optional[mx.array]]:
        start, stop = self.layout.start, self.layout.stop
        if self.keys is None or stop == start:
            return None, None
        return self.keys[..., start:stop, :], self.values[..., start:stop, :]

    def with_block(self, view: BlockView, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        if view.n_ctx == 0:
            return k, v
        ck, cv = self.keys[..., view.start : view.stop, :], self.values[..., view.start : view.stop, :]
        return mx.concatenate([ck, k], axis=2), mx.concatenate([cv, v], axis=2)

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


class ContextKVCache(context.ContextKVCache):
    """The context K/V of one generation, in this backend's arrays (plan: ``context.py``)."""

    layer_kv = LayerKV

    @property
    def state(self) -> list[mx.array]:
        return [a for l in self.layers if l.keys is not None for a in (l.keys, l.values)]


# --------------------------------------------------------------------------- target tensors


class TargetHead:
    """The target's embedding table and LM head, used with raw weight ops.

    A plain object (not an ``nn.Module``) so it stays out of the drafter's
    parameter tree. Quantized tables (mlx-lm ``scales``/``biases``) are
    supported without dequantizing the whole table.
    """

    def __init__(
        self,
        embed: dict[str, mx.array],
        head: Optional[dict[str, mx.array]] = None,
        embed_quant: Optional[dict] = None,
        head_quant: Optional[dict] = None,
    ):
        self.embed = embed
        self.embed_quant = embed_quant
        if head is None:  # tied
            self.head, self.head_quant = embed, embed_quant
        else:
            self.head, self.head_quant = head, head_quant
        self.tied = head is None

    @property
    def vocab_size(self) -> int:
        return self.embed["weight"].shape[0]

    @property
    def hidden_size(self) -> int:
        w, q = self.embed["weight"], self.embed_quant
        return w.shape[1] if q is None else w.shape[1] * 32 // q["bits"]

    def embed_rows(self, ids: mx.array) -> mx.array:
        w = self.embed["weight"]
        if self.embed_quant is None:
            return w[ids]
        q = self.embed_quant
        biases = self.embed.get("biases")
        return mx.dequantize(
            w[ids],
            self.embed["scales"][ids],
            None if biases is None else biases[ids],
            group_size=q["group_size"],
            bits=q["bits"],
            mode=q.get("mode", "affine"),
        )

    def logits(self, h: mx.array) -> mx.array:
        w = self.head["weight"]
        if self.head_quant is None:
            return h @ w.T
        q = self.head_quant
        return mx.quantized_matmul(
            h,
            w,
            self.head["scales"],
            self.head.get("biases"),
            transpose=True,
            group_size=q["group_size"],
            bits=q["bits"],
            mode=q.get("mode", "affine"),
        )

    @property
    def nbytes(self) -> int:
        n = sum(a.nbytes for a in self.embed.values())
        return n if self.tied else n + sum(a.nbytes for a in self.head.values())


# --------------------------------------------------------------------------- model


class DFlashDraftModel(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(config.aux_width, config.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = [DecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rope = initialize_rope(
            config.head_dim,
            base=config.rope_theta,
            traditional=False,
            scaling_config=config.rope_scaling,
            max_position_embeddings=config.max_position_embeddings,
        )
        self.target: Optional[TargetHead] = None

    @property
    def dtype(self) -> mx.Dtype:
        return self.fc.weight.dtype

    def bind(self, target: TargetHead) -> "DFlashDraftModel":
        if target.hidden_size != self.config.hidden_size:
            raise ValueError(
                f"target hidden_size {target.hidden_size} != draft hidden_size "
                f"{self.config.hidden_size}"
            )
        self.target = target
        return self

    def make_cache(self, step: int = DEFAULT_STEP) -> ContextKVCache:
        return ContextKVCache(self.config, step=step)

    def context_kv(self, aux: mx.array, offset: int) -> list[tuple[mx.array, mx.array]]:
        """Per-layer ``(k, v)`` ``[1, n_kv, n, head_dim]`` for aux rows at ``offset..``.

        ``aux`` is ``[n, aux_width]`` (or ``[1, n, aux_width]``).
        """
        if aux.ndim == 2:
            aux = aux[None]
        h = self.hidden_norm(self.fc(aux.astype(self.dtype)))
        return [l.self_attn.context_kv(h, self.rope, offset) for l in self.layers]

    def extend(self, cache: ContextKVCache, aux: mx.array) -> None:
        """Append the context K/V of ``aux`` (the next positions) to ``cache``."""
        if aux.shape[-2] == 0:
            return
        cache.append(self.context_kv(aux, cache.length))

    def draft_hidden(self, block_ids: mx.array, cache: ContextKVCache) -> mx.array:
        """Final-norm hidden ``[B, hidden]`` of the block in ONE forward."""
        if self.target is None:
            raise RuntimeError("drafter is not bound to a target embedding/LM head")
        ids = block_ids.reshape(-1)
        B = ids.shape[0]
        pos = cache.length
        x = self.target.embed_rows(ids).astype(self.dtype)
        if self.config.input_embedding_scale != 1.0:
            x = x * self.config.input_embedding_scale
        x = x[None]
        views = cache.plan.block(B)
        masks: dict[Any, Optional[mx.array]] = {}
        for layer, ctx in zip(self.layers, cache.layers):
            attn, view = layer.self_attn, views[ctx.layout]
            key = (ctx.layout, attn.is_causal)
            if key not in masks:
                m = block_mask(view, B, is_causal=attn.is_causal, window=attn.window)
                masks[key] = None if m is None else mx.array(m)
            x = layer(x, ctx, view, self.rope, pos, masks[key])
        return self.norm(x[0])

    def compute_logits(self, h: mx.array) -> mx.array:
        logits = self.target.logits(h)
        if self.config.output_multiplier != 1.0:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap is not None and cap > 0:
            logits = mx.tanh(logits / cap) * cap
        return logits

    def draft_logits(self, block_ids: mx.array, cache: ContextKVCache) -> mx.array:
        """Logits ``[B-1, vocab]`` for block positions ``1..B-1``."""
        return self.compute_logits(self.draft_hidden(block_ids, cache)[1:])

    def draft_tokens(self, block_ids: mx.array, cache: ContextKVCache) -> mx.array:
        """Greedy draft tokens ``[B-1]`` (lazy)."""
        return mx.argmax(self.draft_logits(block_ids, cache), axis=-1)


    # -- what a backend-neutral ``DrafterSession`` asks of its model ------------------------

    backend = "mlx"
    sampler = sampling_mlx  # the processed q and its top-K proposal when a session samples
    batched = batch_mlx  # several sessions' extend + block forward as one (``batch.py``)

    @property
    def device_name(self) -> str:
        return str(mx.default_device())

    def read_aux(self, new_aux) -> mx.array:
        """``new_aux`` (an ``mx.array``, [n, width] or [1, n, width], floating) as ``[n, width]``."""
        if not isinstance(new_aux, mx.array):
            raise ValueError(f"new_aux must be an mx.array, got {type(new_aux).__name__}")
        if aux_rows(new_aux.shape, self.config.aux_width):
            new_aux = new_aux[0]
        if not mx.issubdtype(new_aux.dtype, mx.floating):
            raise ValueError(f"new_aux must be floating point, got {new_aux.dtype}")
        return new_aux

    def zeros_aux(self, n: int) -> mx.array:
        return mx.zeros((n, self.config.aux_width), dtype=self.dtype)

    def propose(self, cache: ContextKVCache, new_aux: mx.array, last_token: int, block_size: int) -> list[int]:
        """Extend ``cache`` by ``new_aux``, then draft the block ``[last_token, mask * (B-1)]``
        greedily; one host sync."""
        self.extend(cache, new_aux)
        tokens = self.draft_tokens(self._block(last_token, block_size), cache)
        mx.eval(tokens, cache.state)
        return tokens.tolist()

    def propose_logits(self, last_token: int, block_size: int, cache: ContextKVCache) -> mx.array:
        """The same block's logits ``[B-1, vocab]`` (lazy), for a sampling session."""
        return self.draft_logits(self._block(last_token, block_size), cache)

    def _block(self, last_token: int, block_size: int) -> mx.array:
        return mx.array([last_token] + [self.config.mask_token_id] * (block_size - 1), dtype=mx.int32)

    def settle(self, cache: ContextKVCache) -> None:
        """Evaluate the context K/V now (a block-size-1 call drafts nothing but must not pile up a graph)."""
        mx.eval(cache.state)

    def synchronize(self) -> None:
        mx.synchronize()


# --------------------------------------------------------------------------- loading


def _index_tensors(target_dir: Path) -> dict[str, mx.array]:
    """Lazy name -> array map over the target's safetensors (nothing is read yet)."""
    out: dict[str, mx.array] = {}
    for f in shard_files(target_dir):
        out.update(mx.load(str(f)))  # lazy: only tensors that are used get read
    return out


def _quant_for(cfg: dict, module: str) -> Optional[dict]:
    q = cfg.get("quantization") or cfg.get("quantization_config")
    if not q:
        return None
    spec = q.get(module, q)
    if spec is False:
        return None
    if not isinstance(spec, dict):
        spec = q
    return {
        "group_size": int(spec.get("group_size", 64)),
        "bits": int(spec.get("bits", 4)),
        "mode": spec.get("mode", "affine"),
    }


def load_target_head(target_dir: str | Path, dtype: Optional[mx.Dtype] = None) -> TargetHead:
    """Read ONLY the target's embedding table and LM head (tied when absent)."""
    target_dir = Path(target_dir)
    cfg = json.loads((target_dir / "config.json").read_text())
    tensors = _index_tensors(target_dir)
    where = find_text_tensors(tensors, target_dir)

    def take(prefix: str) -> tuple[dict[str, mx.array], Optional[dict]]:
        d = {
            p: tensors[f"{prefix}.{p}"]
            for p in ("weight", "scales", "biases")
            if f"{prefix}.{p}" in tensors
        }
        quant = _quant_for(cfg, prefix) if "scales" in d else None
        if quant is None and "scales" in d:
            raise ValueError(f"{prefix} is quantized but config.json has no quantization")
        if quant is None and dtype is not None:
            d["weight"] = d["weight"].astype(dtype)
        return d, quant

    embed, eq = take(where.embed)
    head_d, hq = take(where.head) if where.head is not None else (None, None)
    del tensors
    th = TargetHead(embed, head_d, eq, hq)
    text = cfg.get("text_config") or cfg
    vocab = text.get("vocab_size")
    if vocab is not None and int(vocab) != th.vocab_size:
        raise ValueError(f"target embed has {th.vocab_size} rows, config vocab_size is {vocab}")
    hidden = text.get("hidden_size")
    if hidden is not None and int(hidden) != th.hidden_size:
        raise ValueError(f"target embed width {th.hidden_size} != config hidden_size {hidden}")
    mx.eval(list(th.embed.values()) + ([] if th.tied else list(th.head.values())))
    return th


def load_draft_model(draft_dir: str | Path, dtype: Optional[mx.Dtype] = None) -> DFlashDraftModel:
    draft_dir = Path(draft_dir)
    config = DFlashConfig.from_dir(draft_dir)
    weights: dict[str, mx.array] = {}
    for f in shard_files(draft_dir):
        weights.update(mx.load(str(f)))
    if dtype is not None:
        weights = {k: v.astype(dtype) for k, v in weights.items()}
    model = DFlashDraftModel(config)
    model.load_weights(list(weights.items()), strict=True)
    model.eval()
    mx.eval(model.parameters())
    return model


def load_dflash_mlx(
    draft_dir: str | Path, target_dir: str | Path, dtype: Optional[mx.Dtype] = None
) -> DFlashDraftModel:
    """Load the DFlash draft and bind the target's embedding/LM head.

    Compute dtype follows the draft weights unless ``dtype`` is given; the
    target's (unquantized) tensors are cast to it.
    """
    model = load_draft_model(draft_dir, dtype)
    target = load_target_head(target_dir, dtype=model.dtype)
    return model.bind(target)
