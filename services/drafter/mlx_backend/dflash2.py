"""The DFlash2 drafter's parts (``DFlash2DraftModel``) in MLX: the torch module's semantics
(``drafter/torch_backend/dflash2.py``, which says what DFlash2 adds and where that was read). The MLX
``DFlashDraftModel`` (``model.py``) builds them when its config is a DFlash2 one: its layers get the two
convolutions (:func:`conv_layer` runs such a layer), the model the selector (:func:`realized_rows`); its
block forward and context caches are the DFlash ones.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx import nn

from kakeya.drafter import backend
from kakeya.drafter.config import DFlashConfig


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


def add_convs(layer: nn.Module, config: DFlashConfig) -> None:
    f = config.dflash2
    layer.attention_conv = GroupedConv(config.hidden_size, f.conv_kernel_size, f.conv_group_size)
    layer.mlp_conv = GroupedConv(config.hidden_size, f.conv_kernel_size, f.conv_group_size)


def conv_layer(layer, x: mx.array, segments, rope: nn.Module, lanes: mx.array) -> mx.array:
    """Block rows ``x`` [1, rows, hidden] through a DFlash2 decoder layer (``backend.conv_layer``)."""
    return backend.conv_layer(layer, x, lanes, lambda rows: layer.self_attn(rows[None], segments, rope)[0])


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


def selector(config: DFlashConfig) -> CandidateSelector:
    f = config.dflash2
    if f.selector_top_k > config.vocab_size:
        raise ValueError(f"dflash_config.selector_top_k {f.selector_top_k} > vocab_size {config.vocab_size}")
    return CandidateSelector(config.hidden_size, config.vocab_size, f.selector_rank, f.selector_top_k)


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
