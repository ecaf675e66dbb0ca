"""What the backend-neutral drafter asks of a loaded DFlash model: the ``DraftModel`` protocol.

``session.py`` drives a drafter through exactly these members; the torch and MLX ``DFlashDraftModel`` implement all of
them, and nothing is probed for: backends differ in data (``min_batch``, the fewest queued sessions ``draft_batch`` runs
as one forward; ``static_step``, torch's static-shape steps). A draft call is ``draft_step``: extend every session's
context by its new aux rows, one block forward over every session's block, then the tokens (greedy: one host sync). MLX
runs :func:`extend_and_draft`; torch one batched step over pooled K/V.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from kakeya.checkpoints.config import load_target_config
from kakeya.core.request import SamplingParams
from kakeya.drafter.config import DFlashConfig
from kakeya.drafter.context import DEFAULT_STEP, ContextKVCache

Array = Any  # torch.Tensor or mx.array
KV = tuple[Array, Array]  # one layer's (keys, values), each [1, n_kv, rows, head_dim]


class TargetTensors(Protocol):
    """The target's embedding table and LM head, which the drafter borrows."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def hidden_size(self) -> int: ...


class DraftSampler(Protocol):
    """The backend's sampling module (``backends/{torch,mlx}/sampling.py``)."""

    def coupled_rows(
        self, logits: Array, params: SamplingParams, keys: tuple[int, int], first_position: int
    ) -> list[int]:
        """The coupled rule's noisy argmax of each logits row (row i at position ``first_position + i``)."""

    def proposal(self, logits: Array, params: SamplingParams, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` ids and probabilities [rows, k] of the processed distribution of each logits row."""


class StaticStep(Protocol):
    """The steps with static shapes a model drafts through (torch: ``batch_step.DraftSteps``)."""

    options: Any  # how they run (torch: a ``GraphOptions``: capture, buckets)


class DraftModel(Protocol):
    backend: str  # "torch" | "mlx"
    config: DFlashConfig
    target: TargetTensors | None  # set by ``bind`` (``LocalDrafter`` refuses an unbound model)
    sampler: DraftSampler
    min_batch: int
    static_step: StaticStep | None

    @property
    def dtype(self) -> Any: ...

    @property
    def device_name(self) -> str: ...

    def make_cache(self, step: int = DEFAULT_STEP) -> ContextKVCache:
        """A new session's (empty) context cache."""

    def release_cache(self, cache: ContextKVCache) -> None:
        """A closed session's cache, handed back once."""

    def read_aux(self, new_aux: Any) -> Array:
        """A draft call's ``new_aux`` ([n, width] or [1, n, width]) as ``[n, width]`` rows of this model;
        ValueError naming ``new_aux`` when it is not."""

    def zeros_aux(self, n: int) -> Array: ...

    def context_kv(self, auxs: Sequence[Array], offsets: Sequence[int]) -> list[list[KV]]:
        """Every layer's context K/V of each ``auxs[i]`` ([n_i, width]) at positions ``offsets[i]..``:
        one list of per-layer pairs per aux, the projections run once over all rows."""

    def block_logits(self, blocks: Sequence[tuple[ContextKVCache, Sequence[int]]]) -> Array:
        """Logits ``[sum (B_i - 1), vocab]`` of positions ``1..B_i-1`` of every ``(cache, block ids)``,
        in order, from ONE forward (each block attends to its own cache) and one LM head call."""

    def draft_step(
        self,
        extensions: Sequence[tuple[ContextKVCache, Array]],
        blocks: Sequence[tuple[ContextKVCache, Sequence[int]]],
        greedy: bool,
        keep_logits: bool,
    ) -> tuple[list[int] | None, Array | None]:
        """Extend each ``(cache, aux)``, then draft every ``(cache, block ids)`` in one forward: the greedy
        tokens of the drafted rows (``block_logits``' rows) when ``greedy`` (the one host sync), their
        logits when ``keep_logits``; (None, None) without blocks."""

    def argmax(self, logits: Array, caches: Sequence[ContextKVCache]) -> list[int]:
        """Greedy tokens of ``logits`` rows: the host sync of a draft (the caches' new K/V settle with it)."""

    def ranked(self, logits: Array, k: int) -> tuple[list[list[int]], list[list[float]]]:
        """The ``k`` likeliest ids of each ``logits`` row, likeliest first, and their log-probabilities
        (after ``argmax``: a pre-draft's alternatives and how likely each is, see ``session.py``)."""

    def materialize(self, caches: Sequence[ContextKVCache]) -> None:
        """Finish writing the caches' new K/V now (a call that synced no ``argmax``: MLX builds arrays lazily)."""

    def synchronize(self) -> None: ...


def check_target_head(head: TargetTensors, target_dir) -> TargetTensors:
    """A target's embedding / LM head as read, checked against its config.json (either level of a multimodal config)."""
    text = load_target_config(target_dir)
    for name, have in (("vocab_size", head.vocab_size), ("hidden_size", head.hidden_size)):
        want = text.get(name)
        if want is not None and int(want) != have:
            raise ValueError(f"target embedding / LM head: {name} {have}, config.json says {want}")
    return head


def bind(model: DraftModel, target: TargetTensors) -> DraftModel:
    """Hand a drafter its target's embedding table and LM head (it has neither of its own)."""
    if target.hidden_size != model.config.hidden_size:
        raise ValueError(f"target hidden_size {target.hidden_size} != draft hidden_size {model.config.hidden_size}")
    model.target = target
    return model


def extend(model: DraftModel, caches: Sequence[ContextKVCache], auxs: Sequence[Array]) -> None:
    """Append each ``auxs[i]`` (``[n_i, width]``, the next positions) to ``caches[i]``: the context
    projections run once over every session's new rows, each cache takes its own."""
    work = [(cache, aux) for cache, aux in zip(caches, auxs) if aux.shape[0]]
    if not work:
        return
    kv = model.context_kv([aux for _, aux in work], [cache.length for cache, _ in work])
    for (cache, _), layers in zip(work, kv):
        cache.append(layers)


def extend_and_draft(model: DraftModel, extensions, blocks, greedy: bool) -> tuple[list[int] | None, Array | None]:
    """``DraftModel.draft_step`` from the model's parts: :func:`extend`, one ``block_logits`` forward,
    ``argmax`` (its sync settles the caches too); the logits are returned either way."""
    caches = [cache for cache, _ in extensions]
    extend(model, caches, [aux for _, aux in extensions])
    if not blocks:
        return None, None
    logits = model.block_logits(blocks)
    return (model.argmax(logits, caches) if greedy else None), logits


def scale_embedding(config: DFlashConfig, rows: Array) -> Array:
    """The block rows a drafter embeds, "Gap-B": the target's RAW embedding rows times
    ``input_embedding_scale`` -- never Gemma's own sqrt(hidden) input scale."""
    return rows * config.input_embedding_scale if config.input_embedding_scale != 1.0 else rows


def scale_logits(config: DFlashConfig, logits: Array, tanh) -> Array:
    """The target LM head's logits times ``output_multiplier``, then soft-capped (``tanh(l / cap) * cap``)."""
    if config.output_multiplier != 1.0:
        logits = logits * config.output_multiplier
    cap = config.final_logit_softcapping
    if cap is not None and cap > 0:
        logits = tanh(logits / cap) * cap
    return logits


def aux_rows(shape: tuple, width: int) -> bool:
    """Check an aux array's shape ([n, width] or [1, n, width]); True when it has the batch axis."""
    if len(shape) == 3 and shape[0] != 1:
        raise ValueError(f"new_aux batch must be 1, got shape {tuple(shape)}")
    if len(shape) not in (2, 3):
        raise ValueError(f"new_aux must be [n, {width}], got shape {tuple(shape)}")
    if shape[-1] != width:
        raise ValueError(f"new_aux width {shape[-1]} != len(target_layer_ids) * hidden_size = {width}")
    return len(shape) == 3


def conv_layer(layer, x: Array, lanes: Array, attention) -> Array:
    """Block rows ``x`` [1, rows, hidden] through a DFlash2 decoder layer (either backend's): a grouped causal
    convolution before and after its attention and its MLP (``lanes``: each row's index in its block);
    ``attention(rows)`` [rows, hidden] -> [rows, hidden] is the layer's attention with its output projection."""
    a = layer.input_layernorm(x[0])
    d = layer.attention_conv.deltas(a)
    h = x[0] + layer.attention_conv.apply(attention(layer.attention_conv.apply(a, d, 0, lanes)), d, 1, lanes)
    m = layer.post_attention_layernorm(h)
    d = layer.mlp_conv.deltas(m)
    return (h + layer.mlp_conv.apply(layer.mlp(layer.mlp_conv.apply(m, d, 0, lanes)), d, 1, lanes))[None]
