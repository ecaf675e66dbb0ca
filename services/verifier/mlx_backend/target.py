"""The Gemma-4 target on MLX (``backend.Target``): mlx-lm's model code, one forward that also returns aux.

We drive mlx-lm's decoder layers and re-spell only the layer loop of ``Gemma4TextModel.__call__``
(:meth:`TargetMLX.body`) so the aux layers' outputs come from the same forward and sliding layers attend with our ring
layout's masks. Each forward binds the sessions' array-only caches to its plans through per-forward views
(:class:`LayerView`), since mlx-lm's attention reads ``cache.offset`` and calls ``cache.update_and_fetch``. Sessions go
on the batch axis, short blocks padded at the end (a padded row sees key 0 only and is dropped); attention stays per
row. f_theta and quantized full-attention caches never batch (``session.batchable``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.gemma4_text import logit_softcap
from mlx_lm.utils import load_model

from kakeya.backends.mlx import sampling as sampling_mlx
from kakeya.checkpoints.config import load_target_config, mlx_model_config
from kakeya.checkpoints.layout import loading, shard_files
from kakeya.core.contract import FULL, SLIDING
from kakeya.core.request import CachePolicy
from kakeya.verifier.backend import Forward, Segment, SessionCaches
from kakeya.verifier.layout import ForwardPlan, RestoreView, RingLayout
from kakeya.verifier.mlx_backend.cache import FullKVCache, LatentRing, QuantizedFullKVCache, RingKVCache


class LayerView:
    """One layer's caches of a forward's segments behind the single cache mlx-lm's attention uses."""

    def __init__(self, caches: list, plans: list[ForwardPlan], lengths: list[int], prefixes: list):
        self.caches, self.plans, self.lengths = caches, plans, lengths
        self.prefixes = prefixes  # per segment: restored (K, V) placed before the cache's own, or None

    @property
    def offset(self) -> int | list[int]:
        starts = [p.start for p in self.plans]
        return starts[0] if len(starts) == 1 else starts

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if len(self.caches) == 1:
            return self._fetch(0, keys, values)
        rows = [self._fetch(b, keys[b : b + 1, :, :n], values[b : b + 1, :, :n]) for b, n in enumerate(self.lengths)]
        width = max(k.shape[2] for k, _ in rows)  # = the padded masks' key length
        pad = lambda x: mx.pad(x, [(0, 0), (0, 0), (0, width - x.shape[2]), (0, 0)])
        return tuple(mx.concatenate([pad(kv[j]) for kv in rows], axis=0) for j in (0, 1))

    def _fetch(self, b: int, keys: mx.array, values: mx.array):
        k, v = self.caches[b].fetch(keys, values, self.plans[b])
        if self.prefixes[b] is None:
            return k, v
        pk, pv = self.prefixes[b]
        return mx.concatenate([pk.astype(k.dtype), k], axis=2), mx.concatenate([pv.astype(v.dtype), v], axis=2)


class QuantizedLayerView(LayerView):
    """A quantized full-attention layer's view: mlx-lm's attention sees ``bits`` and takes its quantized path."""

    def __init__(self, caches: list[QuantizedFullKVCache], *args):
        super().__init__(caches, *args)
        self.bits, self.group_size = caches[0].bits, caches[0].group_size


def layer_views(segments: Sequence[Segment], kinds: Sequence[str], restored: list) -> list[LayerView]:
    """One view per cached layer; ``restored``: per segment, each sliding layer's restored (K, V) or None."""
    plans, lengths = [s.plan for s in segments], [len(s.ids) for s in segments]
    views, sliding = [], 0
    for i, kind in enumerate(kinds):
        caches = [s.caches.layers[i] for s in segments]
        prefixes = [None] * len(segments)
        if kind == SLIDING:
            prefixes = [None if r is None else r[sliding] for r in restored]
            sliding += 1
        view = QuantizedLayerView if isinstance(caches[0], QuantizedFullKVCache) else LayerView
        views.append(view(caches, plans, lengths, prefixes))
    return views


def attention_masks(segments: Sequence[Segment], rows: int) -> dict:
    """Per layer type, what the forward's queries attend to."""
    if len(segments) == 1:
        plan = segments[0].plan
        sliding = plan.mask if plan.restore is None else np.concatenate([plan.restore.mask, plan.mask], axis=1)
        return {FULL: None if plan.n_new == 1 else "causal", SLIDING: mx.array(sliding)}
    full = [
        np.arange(p.start + p.n_new)[None, :] <= np.arange(p.start, p.start + p.n_new)[:, None]
        for p in (s.plan for s in segments)
    ]
    return {FULL: mx.array(_padded(full, rows)), SLIDING: mx.array(_padded([s.plan.mask for s in segments], rows))}


def _padded(masks: list[np.ndarray], rows: int) -> np.ndarray:
    keys = max(m.shape[1] for m in masks)
    out = np.zeros((len(masks), 1, rows, keys), dtype=bool)
    out[:, 0, :, 0] = True  # padded query rows: one visible key keeps their softmax finite
    for b, m in enumerate(masks):
        out[b, 0, : m.shape[0]] = False
        out[b, 0, : m.shape[0], : m.shape[1]] = m
    return out


def _float32_experts_on_a_cpu(model) -> None:
    """A bfloat16 MoE on MLX's CPU is served in float32 (an exact upcast of the file's weights): MLX's CPU
    expert product computes float32 only ("[GatherMM::eval] Currently only supports float32"), so such a
    checkpoint could not run there at all. Metal computes it in bfloat16 and keeps it so."""
    args = getattr(getattr(model, "language_model", model), "args", None)
    if mx.default_device().type != mx.cpu or not getattr(args, "enable_moe_block", False):
        return
    params = tree_flatten(model.parameters())
    if any(name.endswith(".scales") for name, _ in params):
        return  # mlx_lm.convert's packed experts: the quantized product serves them as they are
    if any(v.dtype == mx.bfloat16 for _, v in params):
        model.set_dtype(mx.float32, lambda dtype: dtype == mx.bfloat16)


class TargetMLX:
    """A loaded Gemma-4 target and the forward the verifier needs."""

    backend = "mlx"
    sampler = sampling_mlx
    static_verify = False
    restores = True  # backend.Restores
    min_batch = 2

    def __init__(self, model, path: Path):
        self.path = path
        self.model = model
        # Multimodal gemma4 checkpoints wrap the text model as `language_model`.
        self.lm = getattr(model, "language_model", model)
        self.inner = self.lm.model
        self.args = self.lm.args
        self.layer_types = list(self.args.layer_types)
        self.n_cached = self.args.num_hidden_layers - self.args.num_kv_shared_layers
        self._restorers: dict = {}  # f_theta directory -> Restorer
        self._compiled: dict = {}  # compiled f_theta graphs, per restorer

    @classmethod
    def load(cls, path: str | Path) -> TargetMLX:
        """mlx-lm's model of the checkpoint at ``path``, built from our one reading of its config.json
        (``checkpoints.config``), never from the raw file: mlx-lm's args read neither transformers >= 5.2's
        ``per_layer_config`` nor a multimodal ``text_config.vocab_size``, and default absent fields unlike
        transformers, which wrote them."""
        path = Path(path)
        shard_files(path)  # each shard the index names is there (mlx-lm lists missing parameters, not files)
        raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
        config = mlx_model_config(raw, load_target_config(path))
        with loading(path, "target"):
            model, _ = load_model(path, model_config=config)
        _float32_experts_on_a_cpu(model)
        return cls(model, path)

    # -- the backend protocol (verifier/backend.py) ----------------------------------------

    @property
    def device_name(self) -> str:
        return str(mx.default_device())

    @property
    def dtype_name(self) -> str:
        return str(self.inner.embed_tokens.weight.dtype).rsplit(".", 1)[-1]

    def make_cache(self, layout: RingLayout, policy: CachePolicy) -> SessionCaches:
        """Rings on sliding layers, exact or quantized full-attention caches; a quantized set runs alone."""

        def full():
            if not policy.full_kv_bits:
                return FullKVCache()
            group = min(policy.full_kv_group_size, self.args.global_head_dim or self.args.head_dim)
            return QuantizedFullKVCache(group, policy.full_kv_bits)

        kinds = self.layer_types[: self.n_cached]
        layers = [RingKVCache(layout.capacity) if kind == SLIDING else full() for kind in kinds]
        return SessionCaches(layers, kinds, batchable=not policy.full_kv_bits)

    def release_cache(self, caches: SessionCaches) -> None:
        """Nothing kept for the next session: MLX frees the arrays when the caches are dropped."""

    def forward(self, segments: Sequence[Segment]) -> list[Forward]:
        lengths = [len(s.ids) for s in segments]
        rows = max(lengths)
        ids = mx.array([list(s.ids) + [0] * (rows - len(s.ids)) for s in segments])
        restored = [None if s.plan.restore is None else self._restored(s.plan.restore) for s in segments]
        views = layer_views(segments, self.layer_types[: self.n_cached], restored)
        aux_layers = {i for s in segments for i in s.aux_layers}
        hidden, saved = self.body(ids, views, attention_masks(segments, rows), aux_layers)
        out = []
        for b, (s, n) in enumerate(zip(segments, lengths)):
            aux = mx.concatenate([saved[i][b, :n] for i in s.aux_layers], axis=-1) if s.aux_layers else None
            out.append(Forward(hidden[b : b + 1, :n], aux))
        return out

    def greedy(self, hidden: mx.array) -> list[int]:
        return mx.argmax(self.logits(hidden)[0], axis=-1).tolist()

    def logits(self, hidden: mx.array) -> mx.array:
        lm = self.lm
        out = lm.lm_head(hidden) if not lm.tie_word_embeddings else self.inner.embed_tokens.as_linear(hidden)
        cap = lm.final_logit_softcapping
        return logit_softcap(cap, out) if cap is not None else out

    @staticmethod
    def concat(arrays: Sequence[mx.array], axis: int) -> mx.array:
        return mx.concatenate(list(arrays), axis=axis)

    @staticmethod
    def materialize(out: Forward, caches: SessionCaches) -> None:
        mx.eval(out.aux, caches.arrays())

    @staticmethod
    def copy_caches(caches: SessionCaches, positions: int) -> list[list]:
        saved = caches.copy(positions, mx.array)
        mx.eval(saved)
        return saved

    @staticmethod
    def load_caches(caches: SessionCaches, saved: list[list], positions: int) -> None:
        for layer, arrays in zip(caches.layers, saved):
            layer.load(arrays)

    # -- f_theta restoration (services/verifier/mlx_backend/ftheta.py) ------------------------------

    def restorer(self, path):
        """The f_theta at ``path``, loaded once per target and checked against it."""
        from kakeya.verifier.mlx_backend.ftheta import load_ftheta

        key = str(Path(str(path).removeprefix("ftheta:")).resolve())
        if key not in self._restorers:
            r = load_ftheta(key)
            r.check_target(self)
            self._restorers[key] = r
        return self._restorers[key]

    @staticmethod
    def make_latent_ring(layout: RingLayout, restorer) -> LatentRing:
        return LatentRing(layout.capacity, restorer.latent_dim)

    def encode_latents(self, restorer, aux: mx.array, aux_layers: Sequence[int]) -> mx.array:
        """Latent codes of a forward's aux rows (compiled once per restorer, aux layout and length)."""
        key = ("encode", restorer, tuple(aux_layers))
        if key not in self._compiled:
            self._compiled[key] = mx.compile(lambda rows: restorer.encode(rows, aux_layers))
        return self._compiled[key](aux)

    def restored_kv(self, restorer, layer: int, latents: mx.array, offsets: mx.array):
        """Layer ``layer``'s restored K/V ``[1, kv_heads, slots, head_dim]`` in ring order, each slot rotated at
        its own absolute position (``offsets`` [slots]) through the layer's own RoPE, one batch offset per slot."""
        attn = self.inner.layers[layer].self_attn
        k, v = restorer.layer_kv(latents, layer, attn)  # [slots, kv_heads, head_dim], pre-RoPE
        k = attn.rope(k[:, :, None, :], offset=offsets)[:, :, 0, :]
        return k.transpose(1, 0, 2)[None], v.transpose(1, 0, 2)[None]

    def _restored(self, restore: RestoreView) -> list[tuple[mx.array, mx.array]]:
        """Every sliding layer's restored K/V for one forward (one compiled graph per restorer)."""
        layers = [i for i in range(self.n_cached) if self.layer_types[i] == SLIDING]
        key = ("restore", restore.restorer)
        if key not in self._compiled:
            restorer = restore.restorer

            def all_layers(latents, offsets):
                return [a for i in layers for a in self.restored_kv(restorer, i, latents, offsets)]

            self._compiled[key] = mx.compile(all_layers)
        kv = self._compiled[key](restore.latents, mx.array(np.maximum(restore.positions, 0)))
        return [(kv[2 * j], kv[2 * j + 1]) for j in range(len(layers))]

    def body(self, ids: mx.array, caches: Sequence, masks: dict, aux_layers) -> tuple[mx.array, dict]:
        """Run ``ids`` [B, L] through the decoder layers, each cached layer with its cache (anything with
        mlx-lm's ``offset`` and ``update_and_fetch``) and its type's mask; no LM head. Returns the
        final-norm hidden states [B, L, H] and each aux layer's output [B, L, H]."""
        inner = self.inner
        h = inner.embed_tokens(ids) * inner.embed_scale
        per_layer = [None] * len(inner.layers)
        if inner.hidden_size_per_layer_input:
            pli = inner._project_per_layer_inputs(h, inner._get_per_layer_inputs(ids))
            per_layer = [pli[:, :, i, :] for i in range(len(inner.layers))]
        caches = list(caches) + [None] * (len(inner.layers) - len(caches))
        saved = dict.fromkeys(aux_layers)
        intermediates = [(None, None)] * len(inner.layers)
        for idx, layer in enumerate(inner.layers):
            kvs, offset = intermediates[inner.previous_kvs[idx]]
            h, kvs, offset = layer(
                h, masks[layer.layer_type], caches[idx], per_layer_input=per_layer[idx], shared_kv=kvs, offset=offset
            )
            intermediates[idx] = (kvs, offset)
            if idx in saved:
                saved[idx] = h
        return inner.norm(h), saved
