"""The torch drafter's context K/V cache: per-layer preallocated buffers whose rows are planned by
``context.py`` (backend-neutral), plus the fixed context the block trainer hands in."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kakeya.drafter import context
from kakeya.drafter.context import Append, BlockView, ContextLayout, Resize

if TYPE_CHECKING:
    from kakeya.drafter.torch_backend.step import StaticDraft


class LayerKV:
    """One layer's context K/V: preallocated ``[1, n_kv, capacity, hd]`` buffers, rows planned by its layout.

    A block forward writes the block's K/V into the scratch rows after the
    context and attends over a span of the buffer (no concatenation): the
    valid rows (eager; the same keys in the same order as ``context ++ block``)
    or the whole capacity with a mask (a fixed shape per capacity, for a
    captured forward). A sliding layer's buffer keeps its storage when it is
    compacted.
    """

    def __init__(self, layout: ContextLayout):
        self.layout = layout
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def resize(self, r: Resize, like: torch.Tensor) -> None:
        """Carry out a planned resize; ``like`` ([1, n_kv, any, hd]) gives a new buffer's shape and dtype."""
        if self.keys is not None and r.capacity == self.keys.shape[2]:
            if r.src:  # compact in place; the ranges may overlap
                self.keys[:, :, : r.count] = self.keys[:, :, r.src : r.src + r.count].clone()
                self.values[:, :, : r.count] = self.values[:, :, r.src : r.src + r.count].clone()
            return
        B, H, _, D = like.shape
        nk = like.new_zeros((B, H, r.capacity, D))
        nv = like.new_zeros((B, H, r.capacity, D))
        if r.count:
            nk[:, :, : r.count] = self.keys[:, :, r.src : r.src + r.count]
            nv[:, :, : r.count] = self.values[:, :, r.src : r.src + r.count]
        self.keys, self.values = nk, nv

    def append(self, plan: Append, k: torch.Tensor, v: torch.Tensor) -> None:
        if plan.resize is not None:
            self.resize(plan.resize, k)
        if plan.n:
            self.keys[:, :, plan.dst : plan.dst + plan.n] = k[:, :, plan.skip :]
            self.values[:, :, plan.dst : plan.dst + plan.n] = v[:, :, plan.skip :]

    def with_block(self, view: BlockView, k: torch.Tensor, v: torch.Tensor):
        """Keys/values a block attends to: its own K/V written after the context, one buffer span."""
        if view.resize is not None:
            self.resize(view.resize, k)
        n = k.shape[2]
        self.keys[:, :, view.stop : view.stop + n] = k
        self.values[:, :, view.stop : view.stop + n] = v
        return self.keys[:, :, view.key_start : view.key_stop], self.values[:, :, view.key_start : view.key_stop]

    def write_rows(self, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``/``v`` into the buffer rows ``rows`` (a device index: the static step's planned rows)."""
        self.keys.index_copy_(2, rows, k)
        self.values.index_copy_(2, rows, v)

    def visible(self):
        """The visible context rows (None when empty)."""
        start, stop = self.layout.start, self.layout.stop
        if self.keys is None or stop == start:
            return None, None
        return self.keys[:, :, start:stop], self.values[:, :, start:stop]

    def copy_visible(self):
        """The visible rows as tensors of their own (a prefix snapshot; None, None when empty)."""
        k, v = self.visible()
        return (None, None) if k is None else (k.clone(), v.clone())

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


class GivenContext:
    """Context K/V handed in as tensors (the block trainer: many blocks over one precomputed context)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys, self.values = keys, values

    def with_block(self, view, k: torch.Tensor, v: torch.Tensor):
        return torch.cat([self.keys, k], dim=2), torch.cat([self.values, v], dim=2)


class ContextKVCache(context.ContextKVCache):
    """The context K/V of one generation, in this backend's arrays (plan: ``context.py``)."""

    layer_kv = LayerKV
    static: StaticDraft | None = None  # the static step's device inputs and graphs, once it has run

    @torch.inference_mode()  # the buffers are inference tensors: written in that mode only
    def append(self, kv: list) -> None:
        super().append(kv)

    @torch.inference_mode()
    def snapshot(self) -> context.ContextSnapshot:
        return super().snapshot()

    @torch.inference_mode()
    def restore(self, snap: context.ContextSnapshot, back: int = 0) -> None:
        super().restore(snap, back)

    def reserve(self, rows: int, like: torch.Tensor) -> None:
        """Room for ``rows`` more rows after the written ones in every buffer, every visible row kept
        (the static step's extension and block then move nothing); ``like`` as in ``LayerKV.resize``."""
        for layout in self.plan.layouts:
            resize = layout.reserve(rows)
            if resize is None:
                continue
            for layer in self.layers:
                if layer.layout is layout:
                    layer.resize(resize, like)
