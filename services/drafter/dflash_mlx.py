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

from services.checkpoints.layout import find_text_tensors, shard_files
from services.drafter.config import FULL, SLIDING, DFlashConfig  # noqa: F401  (FULL, DFlashConfig re-exported)


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

    def _kv(self, h: mx.array, rope: nn.Module, offset: int) -> tuple[mx.array, mx.array]:
        B, L, _ = h.shape
        k = self.k_norm(self.k_proj(h).reshape(B, L, self.n_kv_heads, -1))
        v = self.v_proj(h).reshape(B, L, self.n_kv_heads, -1)
        k = rope(k.transpose(0, 2, 1, 3), offset=offset)
        return k, v.transpose(0, 2, 1, 3)

    def context_kv(self, h_ctx: mx.array, rope: nn.Module, offset: int):
        """K/V ``[1, n_kv, S, head_dim]`` of context rows at positions ``offset..offset+S-1``."""
        return self._kv(h_ctx, rope, offset)

    def __call__(
        self,
        x: mx.array,
        ctx_k: Optional[mx.array],
        ctx_v: Optional[mx.array],
        pos: int,
        rope: nn.Module,
        mask: Optional[mx.array],
    ) -> mx.array:
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1))
        q = rope(q.transpose(0, 2, 1, 3), offset=pos)
        k, v = self._kv(x, rope, pos)
        if ctx_k is not None and ctx_k.shape[2] > 0:
            k = mx.concatenate([ctx_k, k], axis=2)
            v = mx.concatenate([ctx_v, v], axis=2)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class DecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def __call__(self, x, ctx_k, ctx_v, pos, rope, mask):
        h = x + self.self_attn(self.input_layernorm(x), ctx_k, ctx_v, pos, rope, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


def block_mask(
    n_ctx: int, n_block: int, *, is_causal: bool, window: Optional[int]
) -> Optional[mx.array]:
    """Boolean ``[n_block, n_ctx + n_block]`` visibility, or None when all visible.

    Query ``i`` sits at position ``C + i`` (``C`` = total context length) and the
    ``n_ctx`` visible context keys at ``C - n_ctx .. C - 1``. Context keys obey
    ``p_q - p_k < window``; block keys obey causality (if ``is_causal``) and,
    for sliding layers, ``|p_q - p_k| < window`` (the torch reference's training
    mask; it only bites when ``block_size > window``).
    """
    need_ctx = window is not None and n_ctx + n_block - 1 >= window
    need_block = is_causal or (window is not None and n_block > window)
    if not (need_ctx or need_block):
        return None
    qi = mx.arange(n_block)[:, None]
    parts = []
    if n_ctx > 0:
        kj = mx.arange(n_ctx)[None]
        if window is not None:
            parts.append((qi + n_ctx - kj) < window)
        else:
            parts.append(mx.ones((n_block, n_ctx), dtype=mx.bool_))
    kb = mx.arange(n_block)[None]
    vis = mx.ones((n_block, n_block), dtype=mx.bool_)
    if is_causal:
        vis = vis & (kb <= qi)
    if window is not None:
        vis = vis & (mx.abs(qi - kb) < window)
    parts.append(vis)
    return mx.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]


# --------------------------------------------------------------------------- context cache


class _LayerKV:
    """Growing K/V buffer of one layer; a sliding layer keeps only ``keep`` rows."""

    def __init__(self, keep: Optional[int], step: int):
        self.keep = keep
        self.step = step
        self.keys: Optional[mx.array] = None
        self.values: Optional[mx.array] = None
        self.n = 0  # valid rows at the front of the buffers

    def append(self, k: mx.array, v: mx.array) -> None:
        S = k.shape[2]
        if S == 0:
            return
        if self.keep is not None and S >= self.keep:
            k, v = k[..., S - self.keep :, :], v[..., S - self.keep :, :]
            S, self.n = self.keep, 0
        cap = 0 if self.keys is None else self.keys.shape[2]
        if self.n + S > cap:
            if self.keep is not None:
                carry = min(self.n, self.keep - S)
                new_cap = self.keep + self.step
            else:
                carry = self.n
                new_cap = ((self.n + S + self.step - 1) // self.step) * self.step
            B, H, _, D = k.shape
            nk = mx.zeros((B, H, new_cap, D), dtype=k.dtype)
            nv = mx.zeros((B, H, new_cap, v.shape[3]), dtype=v.dtype)
            if carry:
                nk[..., :carry, :] = self.keys[..., self.n - carry : self.n, :]
                nv[..., :carry, :] = self.values[..., self.n - carry : self.n, :]
            self.keys, self.values, self.n = nk, nv, carry
        self.keys[..., self.n : self.n + S, :] = k
        self.values[..., self.n : self.n + S, :] = v
        self.n += S

    def view(self) -> tuple[Optional[mx.array], Optional[mx.array]]:
        if self.keys is None or self.n == 0:
            return None, None
        start = 0 if self.keep is None else max(0, self.n - self.keep)
        return self.keys[..., start : self.n, :], self.values[..., start : self.n, :]

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


class ContextKVCache:
    """Per-layer context K/V of one generation; only ever extended.

    Full-attention layers keep every position (buffers grow by ``step`` rows);
    sliding layers keep the last ``sliding_window - 1`` positions, which is all
    a block query can see.
    """

    def __init__(self, config: DFlashConfig, step: int = 256):
        self.length = 0  # context positions seen so far (absolute)
        self.layers = [
            _LayerKV(int(config.sliding_window) - 1 if t == SLIDING else None, step)
            for t in config.layer_types
        ]

    def append(self, kv: list[tuple[mx.array, mx.array]]) -> None:
        if len(kv) != len(self.layers):
            raise ValueError(f"expected K/V for {len(self.layers)} layers, got {len(kv)}")
        n = kv[0][0].shape[2]
        for layer, (k, v) in zip(self.layers, kv):
            layer.append(k, v)
        self.length += n

    def view(self, i: int):
        return self.layers[i].view()

    @property
    def state(self) -> list[mx.array]:
        return [a for l in self.layers if l.keys is not None for a in (l.keys, l.values)]

    @property
    def nbytes(self) -> int:
        return sum(l.nbytes for l in self.layers)


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

    def make_cache(self, step: int = 256) -> ContextKVCache:
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
        masks: dict[Any, Optional[mx.array]] = {}
        for i, layer in enumerate(self.layers):
            ck, cv = cache.view(i)
            n_ctx = 0 if ck is None else ck.shape[2]
            attn = layer.self_attn
            key = (n_ctx, attn.is_causal, attn.window)
            if key not in masks:
                masks[key] = block_mask(n_ctx, B, is_causal=attn.is_causal, window=attn.window)
            x = layer(x, ck, cv, pos, self.rope, masks[key])
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
