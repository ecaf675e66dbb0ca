"""DFlash block-diffusion drafter in MLX.

Qwen3-style decoder layers whose attention sees the *context* (``hidden_norm(fc(aux))`` of the target's hidden states
at ``target_layer_ids``, projected by each layer's ``k_proj``/``v_proj``; cached in ``ContextKVCache``, only extended)
and the *block* ``[last committed token, mask, ...]``. Embedding and LM head are the target's (the only two tensors read
from it). "Gap-B": the block embedding is the target's RAW embedding row x ``input_embedding_scale``, never Gemma's
sqrt(hidden) (the ``dflash`` reference's MLX ``bind()`` differs; its torch code and training do not). Parameter names
follow the reference layout, so published safetensors load with ``load_weights(strict=True)``.

A DFlash2 config (``DFlash2DraftModel``) adds the parts at the end, with the torch module's semantics
(``drafter/torch_backend/dflash2.py``, which says what DFlash2 adds): each layer's two block convolutions
(:func:`backend.conv_layer` runs such a layer) and the model's candidate selector (:func:`realized_rows`); its block
forward and context caches are the DFlash ones.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx import nn
from mlx_lm.models.rope_utils import initialize_rope

from kakeya.backends.mlx import sampling as sampling_mlx
from kakeya.checkpoints.config import load_target_config
from kakeya.checkpoints.layout import find_text_tensors, loading, shard_files
from kakeya.drafter import backend, context
from kakeya.drafter.backend import KV, aux_rows, bind, extend_and_draft, scale_embedding, scale_logits
from kakeya.drafter.config import DFlashConfig
from kakeya.drafter.context import DEFAULT_STEP, block_segments, draft_rows, split_rows


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
        self.spec = a = config.layer_attention(layer_idx)
        dim = config.hidden_size
        self.q_proj = nn.Linear(dim, a.n_heads * a.head_dim, bias=False)
        self.k_proj = nn.Linear(dim, a.n_kv * a.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, a.n_kv * a.head_dim, bias=False)
        self.o_proj = nn.Linear(a.n_heads * a.head_dim, dim, bias=False)
        self.q_norm = nn.RMSNorm(a.head_dim, eps=config.rms_norm_eps)
        self.k_norm = nn.RMSNorm(a.head_dim, eps=config.rms_norm_eps)

    def project_kv(self, h: mx.array) -> tuple[mx.array, mx.array]:
        """K (normed, before RoPE) and V ``[B, n_kv, L, head_dim]`` of rows ``h``."""
        B, L, _ = h.shape
        k = self.k_norm(self.k_proj(h).reshape(B, L, self.spec.n_kv, -1))
        v = self.v_proj(h).reshape(B, L, self.spec.n_kv, -1)
        return k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

    def project_q(self, x: mx.array) -> mx.array:
        """Queries (normed, before RoPE) ``[B, n_heads, L, head_dim]`` of rows ``x``."""
        B, L, _ = x.shape
        return self.q_norm(self.q_proj(x).reshape(B, L, self.spec.n_heads, -1)).transpose(0, 2, 1, 3)

    def __call__(self, x: mx.array, segments: Sequence[context.Segment], rope: nn.Module) -> mx.array:
        """Block rows ``x`` [1, L, dim], several sessions' blocks in a row: each segment's rows are
        rotated at its own positions and attend to its own ``visible context ++ block``."""
        B, L, _ = x.shape
        q, (k, v) = self.project_q(x), self.project_kv(x)
        outs, at = [], 0
        for s in segments:
            rows = slice(at, at + s.rows)
            keys, values = s.context.with_block(s.view, rope(k[:, :, rows], offset=s.position), v[:, :, rows])
            queries = rope(q[:, :, rows], offset=s.position)
            outs.append(mx.fast.scaled_dot_product_attention(queries, keys, values, scale=self.spec.scale, mask=s.mask))
            at += s.rows
        out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class DecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.dflash2 is not None:  # DFlash2: a block convolution around attention and MLP
            f, hidden = config.dflash2, config.hidden_size
            self.attention_conv = GroupedConv(hidden, f.conv_kernel_size, f.conv_group_size)
            self.mlp_conv = GroupedConv(hidden, f.conv_kernel_size, f.conv_group_size)

    def __call__(self, x: mx.array, segments: Sequence[context.Segment], rope: nn.Module, lanes=None) -> mx.array:
        if lanes is not None:  # DFlash2
            return backend.conv_layer(self, x, lanes, lambda rows: self.self_attn(rows[None], segments, rope)[0])
        h = x + self.self_attn(self.input_layernorm(x), segments, rope)
        return h + self.mlp(self.post_attention_layernorm(h))


class LayerKV:
    """One layer's context K/V: ``[1, n_kv, capacity, hd]`` buffers, rows planned by its layout. A block
    attends over ``visible context ++ block`` (MLX arrays are values: writing the block in buys nothing)."""

    def __init__(self, layout: context.ContextLayout):
        self.layout = layout
        self.keys: mx.array | None = None
        self.values: mx.array | None = None

    def append(self, plan: context.Append, k: mx.array, v: mx.array) -> None:
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

    def visible(self) -> tuple[mx.array | None, mx.array | None]:
        start, stop = self.layout.start, self.layout.stop
        if self.keys is None or stop == start:
            return None, None
        return self.keys[..., start:stop, :], self.values[..., start:stop, :]

    def copy_visible(self) -> tuple[mx.array | None, mx.array | None]:
        """The visible rows as arrays of their own (a slice would keep the whole buffer alive)."""
        k, v = self.visible()
        if k is None:
            return None, None
        k, v = mx.array(k), mx.array(v)
        mx.eval(k, v)
        return k, v

    def with_block(self, view: context.BlockView, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
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


class TargetHead:
    """The target's embedding table and LM head, used with raw weight ops: a plain object, out of the
    drafter's parameter tree; quantized tables (mlx-lm ``scales``/``biases``) are never dequantized whole."""

    def __init__(
        self,
        embed: dict[str, mx.array],
        head: dict[str, mx.array] | None = None,
        embed_quant: dict | None = None,
        head_quant: dict | None = None,
    ):
        self.embed, self.embed_quant, self.tied = embed, embed_quant, head is None
        self.head, self.head_quant = (embed, embed_quant) if self.tied else (head, head_quant)

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
        return sum(a.nbytes for t in ([self.embed] if self.tied else [self.embed, self.head]) for a in t.values())


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
        self.target: TargetHead | None = None
        f = config.dflash2
        if f is not None:  # DFlash2: its drafts are a walk over each row's top candidates
            self.candidate_selector = CandidateSelector(
                config.hidden_size, config.vocab_size, f.selector_rank, f.selector_top_k
            )

    @property
    def dtype(self) -> mx.Dtype:
        return self.fc.weight.dtype

    # capabilities (``drafter/backend.py``): every draft is a ``block_logits`` forward
    min_batch = 2
    static_step = None

    def make_cache(self, step: int = DEFAULT_STEP) -> ContextKVCache:
        return ContextKVCache(self.config, step=step)

    def release_cache(self, cache: ContextKVCache) -> None:
        """Nothing to keep: the arrays go with the cache."""

    def embed_block(self, ids: mx.array) -> mx.array:
        """Block rows [1, L, hidden] of token ids [L] (Gap-B: the target's RAW embedding row times
        ``input_embedding_scale``, never Gemma's sqrt(hidden))."""
        if self.target is None:
            raise RuntimeError("drafter is not bound to a target embedding/LM head")
        return scale_embedding(self.config, self.target.embed_rows(ids).astype(self.dtype))[None]

    def compute_logits(self, h: mx.array) -> mx.array:
        """Logits of final-norm hidden rows ``h`` through the target's LM head (lazy)."""
        return scale_logits(self.config, self.target.logits(h), mx.tanh)

    # -- the ``DraftModel`` protocol (``drafter/backend.py``) ---------------------------------------

    backend = "mlx"
    sampler = sampling_mlx  # a sampling session's candidates: its noisy argmax, or its top-K proposal

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

    def context_kv(self, auxs: Sequence[mx.array], offsets: Sequence[int]) -> list[list[KV]]:
        """``DraftModel.context_kv``: ``fc``, ``hidden_norm`` and the projections once over all rows, then RoPE
        per aux (lazy)."""
        rows = auxs[0] if len(auxs) == 1 else mx.concatenate(list(auxs))
        h = self.hidden_norm(self.fc(rows.astype(self.dtype)[None]))
        kv = [layer.self_attn.project_kv(h) for layer in self.layers]
        parts = split_rows(kv, [a.shape[0] for a in auxs])
        return [[(self.rope(k, offset=o), v) for k, v in part] for o, part in zip(offsets, parts)]

    def block_logits(self, blocks: Sequence[tuple[ContextKVCache, Sequence[int]]]) -> mx.array:
        """``DraftModel.block_logits`` (lazy): each block attends to ``its visible context ++ itself``, its own mask."""
        ids = mx.array([t for _, block in blocks for t in block], dtype=mx.int32)
        sized = [(cache, len(block)) for cache, block in blocks]
        specs = [layer.self_attn.spec for layer in self.layers]
        x = self.embed_block(ids)
        lanes = np.concatenate([np.arange(n) for _, n in sized]) if self.config.dflash2 is not None else None
        lanes_mx = None if lanes is None else mx.array(lanes)  # each row's index in its block (DFlash2's conv)
        for layer, segments in zip(self.layers, block_segments(sized, specs, mx.array)):
            x = layer(x, segments, self.rope, lanes_mx)
        h = self.norm(x[0])
        rows = h[1:] if len(blocks) == 1 else h[mx.array(draft_rows(n for _, n in sized), dtype=mx.int32)]
        if lanes is not None:  # DFlash2: the walk's realized rows
            flat = [t for _, block in blocks for t in block]
            return realized_rows(self, rows, flat, lanes, np.asarray(draft_rows(n for _, n in sized)))
        return self.compute_logits(rows)

    def draft_step(self, extensions, blocks, greedy: bool, keep_logits: bool):
        """``backend.extend_and_draft``: the context extension, then one lazy block forward."""
        return extend_and_draft(self, extensions, blocks, greedy)

    def argmax(self, logits: mx.array, caches: Sequence[ContextKVCache]) -> list[int]:
        """Greedy tokens of logits rows, evaluated together with the caches' K/V (one sync)."""
        tokens = mx.argmax(logits, axis=-1)
        mx.eval(tokens, *[c.state for c in caches])
        return tokens.tolist()

    def ranked(self, logits: mx.array, k: int) -> tuple[list[list[int]], list[list[float]]]:
        logits = logits.astype(mx.float32)
        top = mx.argpartition(-logits, k - 1, axis=-1)[:, :k]  # the k likeliest, unordered: no sort of the vocabulary
        values = mx.take_along_axis(logits, top, axis=-1)
        order = mx.argsort(-values, axis=-1)
        logp = mx.take_along_axis(values, order, axis=-1) - mx.logsumexp(logits, axis=-1, keepdims=True)
        return mx.take_along_axis(top, order, axis=-1).tolist(), logp.tolist()

    def materialize(self, caches: Sequence[ContextKVCache]) -> None:
        """Evaluate the context K/V now (a call that drafted nothing must not pile up a graph)."""
        mx.eval(*[c.state for c in caches])

    def synchronize(self) -> None:
        mx.synchronize()


def _index_tensors(directory: Path) -> dict[str, mx.array]:
    """Lazy name -> array map over a checkpoint's safetensors (nothing is read yet)."""
    out: dict[str, mx.array] = {}
    for f in shard_files(directory):
        out.update(mx.load(str(f)))  # lazy: only tensors that are used get read
    return out


def _quant_for(cfg: dict, module: str) -> dict | None:
    q = cfg.get("quantization") or cfg.get("quantization_config")
    if not q:
        return None
    spec = q.get(module, q)
    if spec is False:
        return None
    if not isinstance(spec, dict):
        spec = q
    return {
        "group_size": spec.get("group_size"),  # None (mixed recipes): the mode's default, as MLX and mlx-lm read it
        "bits": int(spec.get("bits", 4)),
        "mode": spec.get("mode", "affine"),
    }


def load_target_head(target_dir: str | Path, dtype: mx.Dtype | None = None) -> TargetHead:
    """Read ONLY the target's embedding table and LM head (tied when absent)."""
    target_dir = Path(target_dir)
    cfg = json.loads((target_dir / "config.json").read_text())
    tensors = _index_tensors(target_dir)
    where = find_text_tensors(tensors, target_dir, load_target_config(target_dir)["tie_word_embeddings"])

    def take(prefix: str) -> tuple[dict[str, mx.array], dict | None]:
        d = {p: tensors[f"{prefix}.{p}"] for p in ("weight", "scales", "biases") if f"{prefix}.{p}" in tensors}
        quant = _quant_for(cfg, prefix) if "scales" in d else None
        if quant is None and "scales" in d:
            raise ValueError(f"{prefix} is quantized but config.json has no quantization")
        if quant is None and dtype is not None:
            d["weight"] = d["weight"].astype(dtype)
        return d, quant

    embed, eq = take(where.embed)
    head_d, hq = take(where.head) if where.head is not None else (None, None)
    tensors.clear()  # the lazy map of the target's other tensors: none of them is read
    th = backend.check_target_head(TargetHead(embed, head_d, eq, hq), target_dir)
    mx.eval(list(th.embed.values()) + ([] if th.tied else list(th.head.values())))
    return th


def load_draft_model(draft_dir: str | Path, dtype: mx.Dtype | None = None) -> DFlashDraftModel:
    draft_dir = Path(draft_dir)
    config = DFlashConfig.from_dir(draft_dir)
    weights = _index_tensors(draft_dir)
    if dtype is not None:
        weights = {k: v.astype(dtype) for k, v in weights.items()}
    model = DFlashDraftModel(config)
    with loading(draft_dir, "draft"):
        model.load_weights(list(weights.items()), strict=True)
    model.eval()
    mx.eval(model.parameters())
    return model


def load_dflash_mlx(draft_dir: str | Path, target_dir: str | Path, dtype: mx.Dtype | None = None) -> DFlashDraftModel:
    """Load the DFlash draft and bind the target's embedding/LM head, cast to the draft's dtype (or ``dtype``)."""
    model = load_draft_model(draft_dir, dtype)
    return bind(model, load_target_head(target_dir, dtype=model.dtype))


# -- DFlash2 ---------------------------------------------------------------------------------------------


class GroupedConv(nn.Module):
    """``base_kernel`` [2 sides, taps, hidden] plus per-row deltas from ``kernel_projection``."""

    def __init__(self, hidden: int, taps: int, group: int):
        super().__init__()
        self.taps, self.group = taps, group
        self.base_kernel = mx.zeros((2, taps, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * taps * (hidden // group), bias=False)

    def deltas(self, a: mx.array) -> mx.array:
        """Per-row coefficient deltas [rows, 2, taps, hidden] of normed rows ``a`` [rows, hidden]."""
        d = self.kernel_projection(a).reshape(a.shape[0], 2, self.taps, -1)
        return mx.repeat(d, self.group, axis=-1)

    def apply(self, x: mx.array, deltas: mx.array, side: int, lanes: mx.array) -> mx.array:
        """Rows ``x`` [rows, hidden] convolved causally within their blocks (``lanes``: each row's index
        in its block; a tap reaching before the block's first row contributes nothing)."""
        coeff = self.base_kernel[side] + deltas[:, side]
        out = coeff[:, 0] * x
        for tap in range(1, self.taps):
            shifted = mx.pad(x[:-tap], [(tap, 0), (0, 0)])
            out = out + coeff[:, tap] * shifted * (lanes >= tap).astype(x.dtype)[:, None]
        return out


class CandidateSelector(nn.Module):
    def __init__(self, hidden: int, vocab: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = mx.zeros((vocab, rank))
        self.successor_codebook = mx.zeros((vocab, rank))
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)

    def scores(self, h: mx.array, cand: mx.array, unary: mx.array, pred_ids: mx.array) -> mx.array:
        """Edge scores [rows, k predecessors, k candidates] (float32)."""
        g = self.hidden_projection(h).astype(mx.float32)
        pred = self.predecessor_codebook[pred_ids].astype(mx.float32) * g[:, None]
        succ = self.successor_codebook[cand].astype(mx.float32)
        return unary[:, None, :] + pred @ succ.transpose(0, 2, 1)


def realized_rows(model, h: mx.array, flat: list[int], lanes: np.ndarray, rows: np.ndarray) -> mx.array:
    """The walk's realized rows [drafted rows, vocab] (lazy) of final-norm hidden rows ``h`` [rows, hidden]
    at block rows ``rows`` (block tokens ``flat``, each row's index in its block ``lanes``)."""
    before = rows - 1
    ids = np.asarray(flat)[before]
    # the token before each drafted row is known (the block's first, or a pre-draft's pending one)
    known_np = (lanes[before] == 0) | (ids != model.config.mask_token_id)
    logits = model.compute_logits(h).astype(mx.float32)
    k = model.candidate_selector.top_k
    part = mx.argpartition(-logits, k - 1, axis=-1)[:, :k]
    vals = mx.take_along_axis(logits, part, axis=-1)
    order = mx.argsort(-vals, axis=-1)  # likeliest first, as a top-k hands them over
    cand, unary = mx.take_along_axis(part, order, axis=-1), mx.take_along_axis(vals, order, axis=-1)
    known = mx.array(known_np)
    prev_cand = mx.concatenate([cand[:1], cand[:-1]])
    pred_ids = mx.where(known[:, None], mx.broadcast_to(mx.array(ids)[:, None], cand.shape), prev_cand)
    scores = model.candidate_selector.scores(h, cand, unary, pred_ids)
    at = mx.arange(scores.shape[0])
    choice = mx.zeros(scores.shape[0], dtype=mx.int32)
    prev = choice
    runs = np.diff(np.flatnonzero(np.append(known_np, True)))  # drafted rows from each known token on
    for _ in range(int(runs.max(initial=1))):  # each pass settles one more row of every run
        prev = mx.where(known, 0, mx.concatenate([choice[:1], choice[:-1]]))
        choice = mx.argmax(scores[at, prev], axis=-1).astype(mx.int32)
    realized = mx.full(logits.shape, -mx.inf, dtype=mx.float32)
    return mx.put_along_axis(realized, cand, scores[at, prev], axis=-1)
