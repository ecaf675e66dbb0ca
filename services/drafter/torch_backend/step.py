"""The torch drafter's draft call with static shapes: one CUDA graph per call, replayed per block.

A draft call is two things: extend the context by the new aux rows (their K/V
in every layer), then ONE forward over the block. Eagerly that is ~15 small
launches per layer for the extension and a block forward whose shapes change
with the context. Here both run as one static step (:func:`draft_step`), made
of the model's own pieces (``context_rows``, ``layers_kv``, ``embed_block``,
``decode``: the same layers and attention as the eager forward):

* the new aux rows (up to ``MAX_BLOCK_SIZE``, one per committed token) sit in a
  static buffer; their K/V go into the planned buffer rows with ``index_copy_``;
* the block's K/V go into the scratch rows after the context, and attention
  runs over the WHOLE buffer (``span="capacity"`` of ``context.py``) with a mask
  computed on the device from each layout's row bounds;
* token ids, positions and row bounds reach the device as one packed long
  vector through a pinned staging buffer: one copy, no host-built tensors.

So the kernels depend only on the padded block length, the padded extension
length and the buffers' capacities, and ``torch_graphs.GraphedStep`` records
them once per ``(n, m, capacities)`` key. Per call the host plans rows
(``context.py``: room for the extension and the block is made first, so no
buffer moves between the two), writes the packed inputs and reads the drafted
tokens back: the one host sync of a draft.

Padding never shows: padded block rows are masked out as keys, padded
extension rows are written onto the block's first scratch row, which the block
overwrites later in the same step. A prompt's worth of context (more rows than
a block) is extended eagerly first, as is any extension on a sliding layer
whose window is shorter than the rows (its plan drops rows, see
``ContextLayout.append``).

On a CPU the same objects run eagerly (``capture=False``): that is how tests
check this path against the eager forward without a GPU.
"""

from __future__ import annotations

import torch

from kakeya.backends.torch.graphs import GraphOptions, StepGraphs, bucket_for
from kakeya.backends.torch.ops import rope_from_positions
from kakeya.core.request import MAX_BLOCK_SIZE
from kakeya.drafter.backend import extend
from kakeya.drafter.context import Segment

# the packed long inputs: block ids, then the scalars, then 3 per layout (see StaticDraft.pack)
IDS, START, EXT_N, REAL = 0, MAX_BLOCK_SIZE, MAX_BLOCK_SIZE + 1, MAX_BLOCK_SIZE + 2
PER_LAYOUT = MAX_BLOCK_SIZE + 3  # first per-layout slot: (extension's first row, first visible row, stop)


class StaticDraft:
    """A session's device-side inputs of the static draft step, and its graphs."""

    def __init__(self, model, cache, options: GraphOptions, pool=None):
        self.device = model.device
        self.layouts = list(cache.plan.layouts)
        pin = self.device.type == "cuda"
        n = PER_LAYOUT + 3 * len(self.layouts)
        # pinned staging: a copy from pageable memory would wait for the device
        self.packed_host = torch.zeros(n, dtype=torch.long, pin_memory=pin)
        self.staged = self.packed_host.numpy()  # the host writes through numpy: ~20x cheaper per item
        self.packed = torch.zeros(n, dtype=torch.long, device=self.device)
        self.aux = torch.zeros((MAX_BLOCK_SIZE, model.config.aux_width), dtype=model.dtype, device=self.device)
        self.iota = torch.arange(MAX_BLOCK_SIZE, dtype=torch.long, device=self.device)
        self.rows = torch.arange(0, dtype=torch.long, device=self.device)  # buffer row index, >= every capacity
        self.capacities: tuple = ()
        self.graphs = StepGraphs(options, pool)
        # A call that reads no tokens back (an extension alone) ends without a host sync, so its copy
        # out of the pinned staging buffer may still be pending when the next call rewrites it: such a
        # call records this event (``unsynced``) and the next one waits for it; a draft after a draft never does.
        self.copied = torch.cuda.Event() if pin else None
        self.unsynced = False

    def leave_unsynced(self) -> None:
        """This call ends without a host sync: the next :meth:`pack` first waits for its work (on CUDA)."""
        if self.copied is not None:
            self.copied.record()
            self.unsynced = True

    def fit(self) -> None:
        """Follow the buffers' capacities; a change drops the graphs (they hold the old addresses)."""
        caps = tuple(layout.capacity for layout in self.layouts)
        if caps == self.capacities:
            return
        self.graphs.invalidate()
        self.capacities = caps
        if self.rows.numel() < max(caps):
            self.rows = torch.arange(max(caps), dtype=torch.long, device=self.device)

    def pack(self, ids: list[int], start: int, ext_n: int, real: int, ext_dst: dict) -> None:
        """Stage one call's inputs and copy them to the device (asynchronously)."""
        if self.unsynced:
            self.copied.synchronize()
            self.unsynced = False
        h = self.staged
        h[: len(ids)] = ids
        h[START], h[EXT_N], h[REAL] = start, ext_n, real
        for j, layout in enumerate(self.layouts):
            at = PER_LAYOUT + 3 * j
            h[at : at + 3] = ext_dst.get(layout, 0), layout.start, layout.stop
        self.packed.copy_(self.packed_host, non_blocking=True)


def draft_step(model, cache, st: StaticDraft, n: int, m: int) -> torch.Tensor:
    """Device work of one draft call: extend by ``m`` (padded) aux rows, then a block of ``n``
    (padded) rows. Returns the greedy tokens ``[n]`` (row 0's is junk)."""
    p, iota = st.packed, st.iota
    start, real = p[START], p[REAL]
    bounds = {layout: p[PER_LAYOUT + 3 * j : PER_LAYOUT + 3 * j + 3] for j, layout in enumerate(st.layouts)}
    if m:
        ext_n = p[EXT_N]
        cos, sin = rope_from_positions(model.inv_freq, start - ext_n + iota[:m], model.dtype, model.rope_scale)
        rows = {  # real rows to their planned rows; padded ones onto the block's first scratch row
            layout: torch.where(iota[:m] < ext_n, b[0] + iota[:m], b[2]) for layout, b in bounds.items()
        }
        for (k, v), ctx in zip(model.layers_kv(model.context_rows(st.aux[:m]), cos, sin), cache.layers):
            ctx.write_rows(rows[ctx.layout], k, v)
    cos, sin = rope_from_positions(model.inv_freq, start + iota[:n], model.dtype, model.rope_scale)
    block_rows = {layout: b[2] + iota[:n] for layout, b in bounds.items()}
    masks: dict = {}
    segments = []
    for layer, ctx in zip(model.layers, cache.layers):
        attn = layer.self_attn.spec
        key = (ctx.layout, attn.is_causal)
        if key not in masks:
            masks[key] = _mask(bounds[ctx.layout], st.rows[: ctx.keys.shape[2]], iota[:n], real, attn)
        segments.append([Segment(ScratchRows(ctx, block_rows[ctx.layout]), None, masks[key], n)])
    h = model.decode(model.embed_block(p[IDS:n]), cos, sin, segments)
    return torch.argmax(model.compute_logits(h), dim=-1)


def _mask(bounds: torch.Tensor, rows: torch.Tensor, q: torch.Tensor, real: torch.Tensor, attn) -> torch.Tensor:
    """``context.block_mask(..., span="capacity")`` on the device: bool ``[n, capacity]``.

    Buffer row ``r`` holds the position ``r - stop`` relative to the block's
    first query when ``first visible row <= r < stop + real`` (context, then
    the block's real rows); padded and empty rows are never keys.
    """
    rel = rows - bounds[2]
    vis = ((rows >= bounds[1]) & (rel < real))[None, :]
    d = q[:, None] - rel[None, :]
    if attn.is_causal:
        vis = vis & (d >= 0)
    if attn.window is not None:
        vis = vis & (d.abs() < attn.window)
    return vis


class ScratchRows:
    """A layer's context buffer as the step's attention sees it: the block's K/V written at device
    row indices, then the whole buffer as keys (the capacity-span mask says which rows count)."""

    def __init__(self, kv, rows: torch.Tensor):
        self.kv, self.rows = kv, rows

    def with_block(self, view, k: torch.Tensor, v: torch.Tensor):
        self.kv.write_rows(self.rows, k, v)
        return self.kv.keys, self.kv.values


def fuses_extension(cache, rows: int) -> bool:
    """Whether ``rows`` new aux rows can be extended inside the step (else: eagerly, first)."""
    return 0 < rows <= MAX_BLOCK_SIZE and all(l.keep is None or rows < l.keep for l in cache.plan.layouts)


class StaticStep:
    """One model's greedy draft calls through the static step (``DraftModel.static_step``); each
    cache keeps its own inputs and graphs (``cache.static``), so a reused cache keeps its graphs."""

    def __init__(self, model, options: GraphOptions):
        if options.capture and model.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.model, self.options = model, options
        self.pool = torch.cuda.graph_pool_handle() if options.capture else None
        a = model.layers[0].self_attn.spec  # every layer's K/V rows have this shape (``LayerKV.resize``'s like)
        self.no_rows = torch.empty((1, a.n_kv, 0, a.head_dim), dtype=model.dtype, device=model.device)

    def takes(self, cache, rows: int, block_size: int) -> bool:
        """Whether a call of ``rows`` new aux rows and ``block_size`` is worth this step: any draft, and an
        extension alone (block size 1: after a block copied by n-gram, or a block the sizer chose to verify
        alone) when it fuses, so it replays a graph instead of ~15 eager launches a layer."""
        return block_size > 1 or fuses_extension(cache, rows)

    @torch.inference_mode()
    def draft(self, cache, new_aux: torch.Tensor, last_token: int, block_size: int) -> list[int]:
        """Extend ``cache`` by ``new_aux`` [m, aux_width] and draft ``block_size - 1`` greedy tokens
        after ``last_token`` (none for a block size of 1: the extension alone, and no host sync)."""
        model, options = self.model, self.options
        ext_n = new_aux.shape[0]
        if ext_n and not fuses_extension(cache, ext_n):
            extend(model, [cache], [new_aux])
            ext_n = 0
        n = bucket_for(block_size, options.buckets, MAX_BLOCK_SIZE)
        m = bucket_for(ext_n, options.buckets, MAX_BLOCK_SIZE) if ext_n else 0
        plan = cache.plan
        cache.reserve(ext_n + n, self.no_rows)
        start = plan.length + ext_n
        ext_dst = {layout: a.dst for layout, a in plan.append(ext_n).items()} if ext_n else {}
        st = cache.static
        if st is None:
            st = cache.static = StaticDraft(model, cache, options, self.pool)
        st.fit()
        if ext_n:
            st.aux[:ext_n].copy_(new_aux)
        mask_id = int(model.config.mask_token_id)
        st.pack([last_token] + [mask_id] * (n - 1), start, ext_n, block_size, ext_dst)
        step = st.graphs.get((n, m, st.capacities), lambda k: (lambda: draft_step(model, cache, st, k[0], k[1]), ()))
        tokens = step()
        if block_size == 1:  # the extension alone: nothing to read back, so no host sync
            st.leave_unsynced()
            return []
        return tokens[1:block_size].tolist()  # the one host sync
