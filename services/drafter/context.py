"""The drafter's context-cache plan: which rows each layer's K/V buffer holds, and the block mask.

Backend-neutral host bookkeeping, as ``verifier/layout.py`` plans the verifier's rings. A context only grows, so a
layer's buffer is ``capacity`` preallocated rows of which ``[0, stop)`` are written; the last ``keep`` are visible on
a sliding layer, all on a full one. Full layers grow geometrically; a sliding buffer has a fixed capacity and is
compacted in place when full. A block of ``B`` queries attends to ``visible ++ block``. (The torch drafter keeps its
context in pool pages, ``torch_backend/batch_step.py``; it shares :class:`ContextSnapshot` and :class:`Segment`.)
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from kakeya.core.contract import SLIDING
from kakeya.core.request import MAX_BLOCK_SIZE
from kakeya.drafter.config import DFlashConfig, LayerAttention

DEFAULT_STEP = 256  # first capacity of a full layer; spare rows of a sliding layer


@dataclass(frozen=True)
class Resize:
    """Make the buffer ``capacity`` rows holding, at its front, the old rows ``[src, src+count)`` (the same
    capacity: compact in place; larger: a new buffer)."""

    capacity: int
    src: int
    count: int


@dataclass(frozen=True)
class Append:
    """Write rows ``skip:`` of the new K/V into buffer rows ``[dst, dst+n)`` (after ``resize``)."""

    resize: Resize | None
    skip: int
    dst: int
    n: int


@dataclass(frozen=True)
class BlockView:
    """How one layer kind's attention sees a block of ``n_block`` queries."""

    resize: Resize | None  # room for the block's rows after the context (scratch=True only)
    n_ctx: int  # visible context rows
    start: int  # buffer rows [start, stop) are the visible context
    stop: int


class ContextLayout:
    """Row bookkeeping of one kind of layer (``keep=None``: full attention; else the last ``keep`` rows)."""

    def __init__(self, keep: int | None, step: int = DEFAULT_STEP):
        if step < 1:
            raise ValueError(f"step must be >= 1, got {step}")
        if keep is not None and keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.keep, self.step = keep, step
        self.capacity = 0
        self.stop = 0  # buffer rows [0, stop) are written; the newest row is stop - 1

    @property
    def start(self) -> int:
        """First visible buffer row."""
        return 0 if self.keep is None else max(0, self.stop - self.keep)

    def _room(self, extra: int, carry: int) -> Resize | None:
        """A resize that leaves room for ``extra`` rows after the last ``carry`` written rows, or None."""
        if self.stop + extra <= self.capacity:
            return None
        if self.keep is None:
            cap = max(self.capacity, self.step)
            while cap < carry + extra:
                cap *= 2
        else:
            cap = max(self.capacity, self.keep + max(self.step, MAX_BLOCK_SIZE, extra))
        resize = Resize(cap, self.stop - carry, carry)
        self.capacity, self.stop = cap, carry
        return resize

    def append(self, n: int) -> Append:
        """Plan writing ``n`` new positions (oldest first)."""
        if n < 0:
            raise ValueError(f"cannot append {n} rows")
        skip = 0
        if self.keep is not None and n >= self.keep:  # the new rows alone fill the window
            skip, n = n - self.keep, self.keep
            self.stop = 0
        carry = self.stop if self.keep is None else min(self.stop, self.keep - n)
        resize = self._room(n, carry)
        plan = Append(resize, skip, self.stop, n)
        self.stop += n
        return plan

    def block(self, n_block: int, scratch: bool = False) -> BlockView:
        """Plan one block forward; ``scratch``: room for its K/V in rows ``[stop, stop+n_block)`` (what a
        server's admission counts a block by, :meth:`ContextKVCache.rows_after`)."""
        resize = self._room(n_block, self.stop - self.start) if scratch else None
        return BlockView(resize, self.stop - self.start, self.start, self.stop)


class ContextPlan:
    """The context-cache plan of one drafter session: one layout per layer kind, one length."""

    def __init__(self, config: DFlashConfig, step: int = DEFAULT_STEP):
        self.length = 0  # context positions seen so far (absolute)
        kinds: dict[int | None, ContextLayout] = {}
        self.layer_layouts: list[ContextLayout] = []
        for t in config.layer_types:
            keep = int(config.sliding_window) - 1 if t == SLIDING else None
            self.layer_layouts.append(kinds.setdefault(keep, ContextLayout(keep, step)))
        self.layouts = list(kinds.values())

    def append(self, n: int) -> dict[ContextLayout, Append]:
        """Plan ``n`` new positions for every layout."""
        plans = {l: l.append(n) for l in self.layouts}
        self.length += n
        return plans

    def block(self, n_block: int, scratch: bool = False) -> dict[ContextLayout, BlockView]:
        return {l: l.block(n_block, scratch) for l in self.layouts}


class ContextKVCache:
    """Per-layer context K/V of one generation (only ever extended): the bookkeeping is ``self.plan``, the
    arrays live in one ``layer_kv`` per layer, the backend's own class."""

    layer_kv: type  # the backend's per-layer K/V: append(plan, k, v), with_block(view, k, v), visible(), nbytes

    def __init__(self, config: DFlashConfig, step: int = DEFAULT_STEP):
        self.plan = ContextPlan(config, step)
        self.layers = [self.layer_kv(layout) for layout in self.plan.layer_layouts]

    @property
    def length(self) -> int:
        return self.plan.length

    def append(self, kv: list) -> None:
        """``kv``: one ``(keys, values)`` pair per layer, each ``[1, n_kv, n_new, head_dim]``."""
        if len(kv) != len(self.layers):
            raise ValueError(f"expected K/V for {len(self.layers)} layers, got {len(kv)}")
        plans = self.plan.append(kv[0][0].shape[2])
        for layer, (k, v) in zip(self.layers, kv):
            layer.append(plans[layer.layout], k, v)

    def view(self, i: int):
        return self.layers[i].visible()

    @property
    def rows_held(self) -> int:
        """Rows allocated over every layer (``nbytes`` per row: what a server's admission counts by)."""
        return sum(layout.capacity for layout in self.plan.layer_layouts)

    def rows_after(self, new_rows: int) -> int:
        """``rows_held`` once ``new_rows`` more positions and a block are in: the plan run ahead on a copy."""
        plan = copy.deepcopy(self.plan)
        plan.append(new_rows)
        plan.block(MAX_BLOCK_SIZE, scratch=True)
        return sum(layout.capacity for layout in plan.layer_layouts)

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def snapshot(self) -> ContextSnapshot:
        """A copy of what this cache holds now (its visible rows), which nothing it does later changes:
        a prefix snapshot of the drafter (``core/prefix.py``)."""
        kv = [layer.copy_visible() for layer in self.layers]
        nbytes = sum(k.nbytes + v.nbytes for k, v in kv if k is not None)
        return ContextSnapshot(self.length, [layout.stop - layout.start for layout in self.plan.layouts], kv, nbytes)

    def restore(self, snap: ContextSnapshot, back: int = 0) -> None:
        """An empty cache (of the same model) set to ``snap``'s rows, less its newest ``back`` positions
        (``snap.truncatable`` ones only), copied in as an extension writes rows."""
        keep = snap.resumed(self.length, back)
        plans = {layout: layout.append(rows - back) for layout, rows in zip(self.plan.layouts, snap.rows)}
        self.plan.length = keep
        for layer, (k, v) in zip(self.layers, snap.kv):
            if k is not None:
                layer.append(plans[layer.layout], k[:, :, :keep], v[:, :, :keep])


@dataclass(frozen=True)
class ContextSnapshot:
    """A context cache's state: ``length`` positions, each layout's visible ``rows``, every layer's K/V of them."""

    length: int
    rows: list[int]
    kv: list  # per layer: (keys, values) of its visible rows, or (None, None)
    nbytes: int

    @property
    def truncatable(self) -> bool:
        """Every layout holds every position (no window dropped any), so the first ``n`` rows are exactly
        the context after ``n`` positions."""
        return all(rows == self.length for rows in self.rows)

    def resumed(self, length: int, back: int) -> int:
        """The positions a cache holding ``length`` (it must be empty) keeps when it resumes this snapshot
        less its newest ``back`` (a truncatable one only)."""
        if length:
            raise RuntimeError("only an empty context cache can resume a snapshot")
        if back and not (self.truncatable and 0 < back < self.length):
            raise ValueError(f"cannot resume {self.length} context positions less {back}")
        return self.length - back


def split_rows(kv: list, counts: Sequence[int]) -> list[list]:
    """Per-layer ``(k, v)`` over the rows of several auxes in a row -> one per-layer list per aux."""
    if len(counts) == 1:
        return [kv]
    out, at = [], 0
    for n in counts:
        out.append([(k[:, :, at : at + n], v[:, :, at : at + n]) for k, v in kv])
        at += n
    return out


class Segment(NamedTuple):
    """One session's rows in a block forward whose rows are several sessions' blocks in a row,
    as one layer's attention sees them."""

    context: Any  # that layer's context K/V: ``with_block(view, k, v)`` -> the keys/values the rows attend to
    view: BlockView | None  # where the block sits in that buffer (None: ``context`` knows)
    mask: Any  # bool [rows, keys] (True = attend) in the backend's array type, or None: every key
    rows: int  # how many of the forward's rows are this session's
    position: int | None = None  # the first row's position (MLX rotates per segment; torch's cos/sin cover all rows)


def block_segments(blocks, layers: Sequence[LayerAttention], as_array) -> list[list[Segment]]:
    """Per layer, the :class:`Segment` of every ``(cache, n_rows)`` block of one forward (``as_array``: a
    numpy mask as the backend's array, one per session and layer kind)."""
    segments: list[list[Segment]] = [[] for _ in layers]
    for cache, n in blocks:
        views, position = cache.plan.block(n), cache.length
        masks: dict = {}
        for layer, (attn, ctx) in enumerate(zip(layers, cache.layers)):
            key = (ctx.layout, attn.is_causal)
            if key not in masks:
                m = block_mask(views[ctx.layout], n, is_causal=attn.is_causal, window=attn.window)
                masks[key] = None if m is None else as_array(m)
            segments[layer].append(Segment(ctx, views[ctx.layout], masks[key], n, position))
    return segments


def draft_rows(block_sizes) -> list[int]:
    """Rows of every block's positions ``1..B-1`` when blocks of these sizes are flattened in order
    (row 0 of each block is its last committed token, which drafts nothing)."""
    rows, at = [], 0
    for size in block_sizes:
        rows.extend(range(at + 1, at + size))
        at += size
    return rows


def block_mask(view: BlockView, n_block: int, *, is_causal: bool, window: int | None) -> np.ndarray | None:
    """Bool ``[n_block, keys]`` visibility (True = attend) over the visible context then the block, or None when every
    key is visible. Context keys obey ``p_q - p_k < window``; block keys causality (if ``is_causal``) and, on sliding
    layers, ``|p_q - p_k| < window`` (the reference's training mask)."""
    n_ctx = view.n_ctx
    need_ctx = window is not None and n_ctx + n_block - 1 >= window
    need_block = is_causal or (window is not None and n_block > window)
    if not (need_ctx or need_block):
        return None
    q, k = np.arange(n_block)[:, None], np.arange(-n_ctx, n_block)[None, :]  # key positions relative to C
    vis = np.ones((n_block, n_ctx + n_block), bool)
    if is_causal:
        vis = vis & (k <= q)
    if window is not None:
        vis = vis & (np.abs(q - k) < window)
    return vis
