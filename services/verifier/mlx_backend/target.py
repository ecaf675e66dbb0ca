"""The Gemma-4 target on MLX (``backend.Target``): mlx-lm's model code, one forward that also returns aux.

We drive mlx-lm's own decoder layers. The only thing re-spelled here is the
short layer loop of ``Gemma4TextModel.__call__`` (:meth:`TargetMLX.body`), for
two reasons: the outputs of the aux layers (the drafter's ``target_layer_ids``)
are taken inside the same forward, and sliding layers attend with the masks of
our ring layout instead of mlx-lm's ``RotatingKVCache`` ones. Every forward --
one session's, or several sessions' on the batch axis -- is that loop over
per-forward views of the sessions' caches (``mlx_backend/forward.py``).
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
from kakeya.core.contract import SLIDING
from kakeya.core.request import CachePolicy
from kakeya.verifier.backend import Forward, Segment, SessionCaches
from kakeya.verifier.layout import RestoreView, RingLayout
from kakeya.verifier.mlx_backend.cache import FullKVCache, LatentRing, QuantizedFullKVCache, RingKVCache
from kakeya.verifier.mlx_backend.forward import attention_masks, layer_views


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
        raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
        model, _ = load_model(path, model_config=mlx_model_config(raw, load_target_config(path)))
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

    # -- the model itself ---------------------------------------------------------------

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
