"""The Gemma-4 target on MLX: mlx-lm's model code, one forward that also returns aux hidden states.

We drive mlx-lm's own decoder layers. The only thing re-spelled here is the
short layer loop of ``Gemma4TextModel.__call__``, for two reasons: the outputs
of the ``target_layer_ids`` layers (the drafter's aux) are taken inside the
same forward, and sliding layers attend with the masks of our ring layout
instead of mlx-lm's ``RotatingKVCache`` ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, QuantizedKVCache
from mlx_lm.models.gemma4_text import logit_softcap
from mlx_lm.utils import load_model

from kakeya.backends.mlx import sampling as sampling_mlx
from kakeya.core.contract import FULL, SLIDING, CachePolicy
from kakeya.verifier.layout import RestoreView, RingLayout, ForwardPlan
from kakeya.verifier.mlx_backend.cache import LatentRing, RingKVCache


@dataclass
class Forward:
    hidden: mx.array  # final-norm hidden [1, L, hidden]
    aux: mx.array  # [L, len(aux_layers) * hidden]


class TargetMLX:
    """A loaded Gemma-4 target and the forward the verifier needs."""

    backend = "mlx"
    sampler = sampling_mlx  # p, the acceptance test and the draws when a session samples

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
    def load(cls, path: str | Path) -> "TargetMLX":
        path = Path(path)
        model, _ = load_model(path)
        return cls(model, path)

    # -- what services/verifier/session.py needs from a backend --------------------------

    def make_cache(self, layout: RingLayout, policy: CachePolicy) -> list:
        def full():
            if not policy.full_kv_bits:
                return KVCache()
            group = min(policy.full_kv_group_size, self.args.global_head_dim or self.args.head_dim)
            return QuantizedKVCache(group_size=group, bits=policy.full_kv_bits)

        return [
            RingKVCache(layout) if self.layer_types[i] == SLIDING else full()
            for i in range(self.n_cached)
        ]

    def run(self, ids: Sequence[int], cache: list, aux_layers: Sequence[int], plan: ForwardPlan,
            restore: RestoreView | None = None) -> Forward:
        mask = plan.mask
        for c in cache:
            if isinstance(c, RingKVCache):
                c.plan = plan
        if restore is not None:
            self._set_restored(cache, restore)
            mask = np.concatenate([restore.mask, plan.mask], axis=1)  # restored slots first, then the ring
        try:
            return self.forward(mx.array([list(ids)]), cache, aux_layers, mx.array(mask))
        finally:
            for c in cache:
                if isinstance(c, RingKVCache):
                    c.prefix = None

    def run_batch(self, blocks: Sequence[tuple]) -> list[Forward]:
        """Several sessions' ``run`` in one forward (``verifier/mlx_backend/batch.py``): ``blocks`` of
        ``(ids, cache, aux_layers, plan)``, one ``Forward`` each, every cache written as by ``run``."""
        from kakeya.verifier.mlx_backend.batch import forward_batch

        try:
            return [Forward(h, aux) for h, aux in forward_batch(self, blocks)]
        finally:
            for _, cache, _, _ in blocks:
                for c in cache:
                    if isinstance(c, RingKVCache):
                        c.prefix = None

    @staticmethod
    def batchable(cache: list) -> bool:
        """Quantized full-attention caches run alone (see ``verifier/mlx_backend/batch.py``)."""
        return not any(isinstance(c, QuantizedKVCache) for c in cache)

    def greedy_batch(self, hiddens: Sequence[mx.array]) -> list[int]:
        """:meth:`greedy` of several blocks' hidden states, concatenated: one LM head, one host sync."""
        return self.greedy(hiddens[0] if len(hiddens) == 1 else mx.concatenate(list(hiddens), axis=1))

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
        return LatentRing(layout, restorer.latent_dim)

    def encode_latents(self, restorer, aux: mx.array, aux_layers: Sequence[int]) -> mx.array:
        """Latent codes of a forward's aux rows (compiled once per restorer, aux layout and length)."""
        key = ("encode", restorer, tuple(aux_layers))
        if key not in self._compiled:
            self._compiled[key] = mx.compile(lambda rows: restorer.encode(rows, aux_layers))
        return self._compiled[key](aux)

    def restored_kv(self, restorer, layer: int, latents: mx.array, offsets: mx.array):
        """Layer ``layer``'s restored K/V ``[1, kv_heads, slots, head_dim]``, RoPE at each slot's position.

        Slots stay in ring order (a position's index never depends on how the
        sequence was split into forwards); each row is rotated at its own
        absolute position (``offsets`` [slots]) through the layer's own RoPE
        module, one batch offset per slot.
        """
        attn = self.inner.layers[layer].self_attn
        k, v = restorer.layer_kv(latents, layer, attn)  # [slots, kv_heads, head_dim], pre-RoPE
        k = attn.rope(k[:, :, None, :], offset=offsets)[:, :, 0, :]
        return k.transpose(1, 0, 2)[None], v.transpose(1, 0, 2)[None]

    def _set_restored(self, cache: list, restore: RestoreView) -> None:
        layers = [i for i, c in enumerate(cache) if isinstance(c, RingKVCache)]
        key = ("restore", restore.restorer)
        if key not in self._compiled:
            restorer = restore.restorer

            def all_layers(latents, offsets):
                return [a for i in layers for a in self.restored_kv(restorer, i, latents, offsets)]

            self._compiled[key] = mx.compile(all_layers)
        kv = self._compiled[key](restore.latents, mx.array(np.maximum(restore.positions, 0)))
        for j, i in enumerate(layers):
            cache[i].prefix = (kv[2 * j], kv[2 * j + 1])

    def greedy(self, hidden: mx.array) -> list[int]:
        """The target's argmax at every position of ``hidden`` [1, L, H]: the one host sync of a verify."""
        return mx.argmax(self.logits(hidden)[0], axis=-1).tolist()

    @staticmethod
    def materialize(out: Forward, cache: list) -> None:
        mx.eval(out.aux, [c.keys for c in cache])

    @staticmethod
    def cat(chunks: list) -> mx.array:
        return chunks[0] if len(chunks) == 1 else mx.concatenate(chunks, axis=0)

    @staticmethod
    def trim_full(cache: list, n: int) -> None:
        for c in cache:
            if not isinstance(c, RingKVCache):
                c.trim(n)

    @staticmethod
    def kv_bytes(cache: list) -> dict:
        return {
            "sliding": sum(c.nbytes for c in cache if isinstance(c, RingKVCache)),
            "full": sum(c.nbytes for c in cache if not isinstance(c, RingKVCache)),
        }

    # -- the model itself ---------------------------------------------------------------

    def forward(self, ids: mx.array, cache: list, aux_layers: Sequence[int], sliding_mask) -> Forward:
        """Run ``ids`` [1, L] through the body, appending to ``cache``; no LM head."""
        inner = self.inner
        h = inner.embed_tokens(ids) * inner.embed_scale
        per_layer = [None] * len(inner.layers)
        if inner.hidden_size_per_layer_input:
            pli = inner._get_per_layer_inputs(ids)
            pli = inner._project_per_layer_inputs(h, pli)
            per_layer = [pli[:, :, i, :] for i in range(len(inner.layers))]

        full_cache = next((c for c in cache if not isinstance(c, RingKVCache)), None)
        masks = {
            FULL: create_attention_mask(h, full_cache),
            SLIDING: sliding_mask,
        }
        cache = cache + [None] * (len(inner.layers) - len(cache))
        wanted = {layer_id: i for i, layer_id in enumerate(aux_layers)}
        aux = [None] * len(aux_layers)
        intermediates = [(None, None)] * len(inner.layers)
        for idx, layer in enumerate(inner.layers):
            kvs, offset = intermediates[inner.previous_kvs[idx]]
            h, kvs, offset = layer(
                h,
                masks[layer.layer_type],
                cache[idx],
                per_layer_input=per_layer[idx],
                shared_kv=kvs,
                offset=offset,
            )
            intermediates[idx] = (kvs, offset)
            if idx in wanted:
                aux[wanted[idx]] = h
        return Forward(inner.norm(h), mx.concatenate(aux, axis=-1)[0] if aux else None)

    def logits(self, hidden: mx.array) -> mx.array:
        lm = self.lm
        out = lm.lm_head(hidden) if not lm.tie_word_embeddings else self.inner.embed_tokens.as_linear(hidden)
        cap = lm.final_logit_softcapping
        return logit_softcap(cap, out) if cap is not None else out
