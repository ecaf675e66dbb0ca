"""DFlash block-diffusion drafter in PyTorch (same semantics as ``dflash_mlx.py``).

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

import json
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from services.checkpoints.layout import find_text_tensors, is_quantized, shard_files, tensor_files
from services.drafter.config import FULL, SLIDING, DFlashConfig  # noqa: F401  (FULL, DFlashConfig re-exported)
from services.torch_ops import (
    apply_rope, default_inv_freq, qwen3_rms_norm, resolve_device, resolve_dtype, rope_cos_sin, sdpa, sdpa_backends,
)


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

    def kv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """K/V ``[1, n_kv, S, hd]`` of rows ``h`` [1, S, hidden] at the positions of ``cos``/``sin`` [S, hd]."""
        B, S, _ = h.shape
        k = qwen3_rms_norm(self.k_proj(h).view(B, S, self.n_kv, self.head_dim), self.k_norm.weight, self.eps)
        k = k.transpose(1, 2)
        k = apply_rope(k, cos, sin)
        v = self.v_proj(h).view(B, S, self.n_kv, self.head_dim).transpose(1, 2)
        return k, v

    def forward(self, x, ctx_k, ctx_v, cos, sin, mask):
        B, L, _ = x.shape
        q = qwen3_rms_norm(self.q_proj(x).view(B, L, self.n_heads, self.head_dim), self.q_norm.weight, self.eps)
        q = q.transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k, v = self.kv(x, cos, sin)
        if ctx_k is not None and ctx_k.shape[2] > 0:
            k = torch.cat([ctx_k, k], dim=2)
            v = torch.cat([ctx_v, v], dim=2)
        out = sdpa(q, k, v, mask, self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, act: str = "silu"):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)
        if act != "silu":
            raise ValueError(f"unsupported drafter hidden_act {act!r}")

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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

    def forward(self, x, ctx_k, ctx_v, cos, sin, mask):
        h = x + self.self_attn(self.input_layernorm(x), ctx_k, ctx_v, cos, sin, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


def block_mask(n_ctx: int, n_block: int, *, is_causal: bool, window: Optional[int], device) -> Optional[torch.Tensor]:
    """Boolean ``[n_block, n_ctx + n_block]`` visibility (True = attend), or None when all visible.

    Same rule as ``dflash_mlx.block_mask``: query ``i`` sits at ``C + i``, the
    ``n_ctx`` visible context keys at ``C - n_ctx .. C - 1``; context keys obey
    ``p_q - p_k < window``; block keys causality (if ``is_causal``) and
    ``|p_q - p_k| < window`` on sliding layers.
    """
    need_ctx = window is not None and n_ctx + n_block - 1 >= window
    need_block = is_causal or (window is not None and n_block > window)
    if not (need_ctx or need_block):
        return None
    qi = torch.arange(n_block, device=device)[:, None]
    parts = []
    if n_ctx > 0:
        kj = torch.arange(n_ctx, device=device)[None]
        if window is not None:
            parts.append((qi + n_ctx - kj) < window)
        else:
            parts.append(torch.ones((n_block, n_ctx), dtype=torch.bool, device=device))
    kb = torch.arange(n_block, device=device)[None]
    vis = torch.ones((n_block, n_block), dtype=torch.bool, device=device)
    if is_causal:
        vis = vis & (kb <= qi)
    if window is not None:
        vis = vis & ((qi - kb).abs() < window)
    parts.append(vis)
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


# --------------------------------------------------------------------------- context cache


class _LayerKV:
    """Growing K/V buffer of one layer (chunked); a sliding layer keeps only ``keep`` rows."""

    def __init__(self, keep: Optional[int], step: int):
        self.keep = keep
        self.step = step
        self.keys: Optional[torch.Tensor] = None
        self.values: Optional[torch.Tensor] = None
        self.n = 0  # valid rows at the front of the buffers

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        S = k.shape[2]
        if S == 0:
            return
        if self.keep is not None and S >= self.keep:
            k, v = k[:, :, S - self.keep :], v[:, :, S - self.keep :]
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
            nk = k.new_zeros((B, H, new_cap, D))
            nv = v.new_zeros((B, H, new_cap, v.shape[3]))
            if carry:
                nk[:, :, :carry] = self.keys[:, :, self.n - carry : self.n]
                nv[:, :, :carry] = self.values[:, :, self.n - carry : self.n]
            self.keys, self.values, self.n = nk, nv, carry
        self.keys[:, :, self.n : self.n + S] = k
        self.values[:, :, self.n : self.n + S] = v
        self.n += S

    def view(self):
        if self.keys is None or self.n == 0:
            return None, None
        start = 0 if self.keep is None else max(0, self.n - self.keep)
        return self.keys[:, :, start : self.n], self.values[:, :, start : self.n]

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


class ContextKVCache:
    """Per-layer context K/V of one generation; only ever extended.

    Full-attention layers keep every position; sliding layers keep the last
    ``sliding_window - 1`` positions (all a block query can see).
    """

    def __init__(self, config: DFlashConfig, step: int = 256):
        self.length = 0
        self.layers = [
            _LayerKV(int(config.sliding_window) - 1 if t == SLIDING else None, step) for t in config.layer_types
        ]

    def append(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if len(kv) != len(self.layers):
            raise ValueError(f"expected K/V for {len(self.layers)} layers, got {len(kv)}")
        n = kv[0][0].shape[2]
        for layer, (k, v) in zip(self.layers, kv):
            layer.append(k, v)
        self.length += n

    def view(self, i: int):
        return self.layers[i].view()

    @property
    def nbytes(self) -> int:
        return sum(l.nbytes for l in self.layers)


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

    def make_cache(self, step: int = 256) -> ContextKVCache:
        return ContextKVCache(self.config, step=step)

    def _cos_sin(self, start: int, n: int):
        return rope_cos_sin(self.inv_freq, start, n, self.device, self.dtype, self.rope_scale)

    @torch.inference_mode()
    def context_kv(self, aux: torch.Tensor, offset: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer ``(k, v)`` ``[1, n_kv, n, hd]`` for aux rows ``[n, aux_width]`` at ``offset..``."""
        if aux.ndim == 2:
            aux = aux[None]
        h = self.hidden_norm(self.fc(aux.to(device=self.device, dtype=self.dtype)))
        cos, sin = self._cos_sin(offset, h.shape[1])
        return [l.self_attn.kv(h, cos, sin) for l in self.layers]

    @torch.inference_mode()
    def extend(self, cache: ContextKVCache, aux: torch.Tensor) -> None:
        """Append the context K/V of ``aux`` (the next positions) to ``cache``."""
        if aux.shape[-2] == 0:
            return
        cache.append(self.context_kv(aux, cache.length))

    @torch.inference_mode()
    def draft_hidden(self, block_ids: torch.Tensor, cache: ContextKVCache) -> torch.Tensor:
        """Final-norm hidden ``[B, hidden]`` of the block in ONE forward."""
        if self.target is None:
            raise RuntimeError("drafter is not bound to a target embedding/LM head")
        ids = block_ids.reshape(-1).to(self.device)
        B = ids.shape[0]
        x = self.target.embed_rows(ids).to(self.dtype)
        if self.config.input_embedding_scale != 1.0:
            x = x * self.config.input_embedding_scale
        x = x[None]
        cos, sin = self._cos_sin(cache.length, B)
        masks: dict = {}
        with sdpa_backends():
            x = self._layers(x, cos, sin, cache, masks)
        return self.norm(x[0])

    def _layers(self, x, cos, sin, cache: ContextKVCache, masks: dict) -> torch.Tensor:
        B = x.shape[1]
        for i, layer in enumerate(self.layers):
            ck, cv = cache.view(i)
            n_ctx = 0 if ck is None else ck.shape[2]
            attn = layer.self_attn
            key = (n_ctx, attn.is_causal, attn.window)
            if key not in masks:
                masks[key] = block_mask(n_ctx, B, is_causal=attn.is_causal, window=attn.window, device=self.device)
            x = layer(x, ck, cv, cos, sin, masks[key])
        return x

    @torch.inference_mode()
    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.target.logits(h).float()
        if self.config.output_multiplier != 1.0:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap is not None and cap > 0:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def draft_logits(self, block_ids: torch.Tensor, cache: ContextKVCache) -> torch.Tensor:
        """Logits ``[B-1, vocab]`` for block positions ``1..B-1``."""
        return self.compute_logits(self.draft_hidden(block_ids, cache)[1:])

    def draft_tokens(self, block_ids: torch.Tensor, cache: ContextKVCache) -> torch.Tensor:
        """Greedy draft tokens ``[B-1]`` (on the device; no host sync)."""
        return torch.argmax(self.draft_logits(block_ids, cache), dim=-1)


# --------------------------------------------------------------------------- loading

def load_target_head(target_dir: str | Path, device=None, dtype=None) -> TargetHead:
    """Read ONLY the target's embedding table and LM head (tied when the checkpoint has none)."""
    from safetensors import safe_open

    target_dir = Path(target_dir)
    device, dtype = resolve_device(device), resolve_dtype(dtype)
    cfg = json.loads((target_dir / "config.json").read_text(encoding="utf-8"))
    names = tensor_files(target_dir)
    if is_quantized(names):
        raise ValueError(f"quantized target checkpoint {target_dir} is not supported by the torch drafter")
    where = find_text_tensors(names, target_dir)

    def get(name: str) -> torch.Tensor:
        with safe_open(str(names[name]), framework="pt") as sf:
            return sf.get_tensor(name).to(device=device, dtype=dtype)

    th = TargetHead(get(where.embed + ".weight"), get(where.head + ".weight") if where.head is not None else None)
    text = cfg.get("text_config") or cfg
    vocab, hidden = text.get("vocab_size"), text.get("hidden_size")
    if vocab is not None and int(vocab) != th.vocab_size:
        raise ValueError(f"target embed has {th.vocab_size} rows, config vocab_size is {vocab}")
    if hidden is not None and int(hidden) != th.hidden_size:
        raise ValueError(f"target embed width {th.hidden_size} != config hidden_size {hidden}")
    return th


def load_draft_model(draft_dir: str | Path, device=None, dtype=None) -> DFlashDraftModel:
    from safetensors.torch import load_file

    draft_dir = Path(draft_dir)
    device, dtype = resolve_device(device), resolve_dtype(dtype)
    config = DFlashConfig.from_dir(draft_dir)
    weights: dict[str, torch.Tensor] = {}
    for f in shard_files(draft_dir):
        weights.update(load_file(str(f)))
    with torch.device("meta"):
        model = DFlashDraftModel(config)
    model.inv_freq = rope_inv_freq(config)[0]
    model.load_state_dict(weights, strict=True, assign=True)
    model = model.to(device=device, dtype=dtype)
    model.inv_freq = model.inv_freq.float()
    model.eval().requires_grad_(False)
    return model


def load_dflash_torch(draft_dir: str | Path, target_dir: str | Path, device=None, dtype=None) -> DFlashDraftModel:
    """Load the DFlash draft and bind the target's embedding / LM head (same device and dtype)."""
    model = load_draft_model(draft_dir, device, dtype)
    return model.bind(load_target_head(target_dir, model.device, model.dtype))
