"""The torch drafter's block forward with static shapes: captured in a CUDA graph, replayed per block.

The eager block forward (``DFlashDraftModel.draft_hidden``) attends over
exactly the visible rows, so its shapes change with every block. Here it runs
the ``span="capacity"`` way (see ``context.py``): each layer writes the block's
K/V into its buffer's scratch rows with ``index_copy_`` (row indices from a
0-d device ``stop``), attends over the WHOLE buffer with a mask, and RoPE comes
from a 0-d device ``start`` -- so the kernels depend only on the padded block
length and the buffers' capacities, and ``torch_graphs.GraphedStep`` can record
them once per ``(bucket, capacities)`` and replay them with one launch.

Per call the host plans rows (``context.py``), writes the static inputs
(token ids and masks through pinned staging buffers, so no copy waits on the
device) and reads the drafted tokens back: the one host sync of a draft. A
block of ``B`` runs at its bucket's length ``n >= B`` with the padded rows
masked out as keys, so the real rows see exactly the keys they see eagerly.

On a CPU the same objects run eagerly (``capture=False``): that is how tests
check this path against the eager forward without a GPU.
"""

from __future__ import annotations

import numpy as np
import torch

from services.contract import MAX_BLOCK_SIZE
from services.torch_graphs import GraphOptions, StepGraphs, bucket_for
from services.torch_ops import rope_from_positions, sdpa_backends

from .context import block_mask


class _Span:
    """A layer's context buffer as a captured step sees it: block K/V written at device row indices."""

    def __init__(self, kv, rows: torch.Tensor):
        self.kv, self.rows = kv, rows

    def with_block(self, view, k: torch.Tensor, v: torch.Tensor):
        self.kv.keys.index_copy_(2, self.rows, k)
        self.kv.values.index_copy_(2, self.rows, v)
        return self.kv.keys, self.kv.values


class StaticDraft:
    """A session's device-side inputs of the static block step, and its graphs."""

    def __init__(self, model, options: GraphOptions, pool=None):
        self.device = model.device
        long = dict(dtype=torch.long, device=self.device)
        pin = self.device.type == "cuda"
        self.ids = torch.full((MAX_BLOCK_SIZE,), int(model.config.mask_token_id), **long)
        self.ids_host = torch.empty(MAX_BLOCK_SIZE, dtype=torch.long, pin_memory=pin)
        self.start = torch.zeros((), **long)
        self.iota = torch.arange(MAX_BLOCK_SIZE, **long)
        self.stops: dict = {}  # layout -> 0-d first scratch row
        self.masks: dict = {}  # (layout, causal) -> [MAX_BLOCK_SIZE, capacity] bool on the device
        self.masks_host: dict = {}  # the same, pinned, where the host writes them
        self.capacities: tuple = ()
        self.graphs = StepGraphs(options, pool)
        self.pin = pin

    def fit(self, cache, mask_keys) -> None:
        """(Re)make the mask buffers for the buffers' capacities; a change drops the graphs
        (they hold the old buffers' addresses)."""
        caps = tuple(layout.capacity for layout in cache.plan.layouts)
        if caps == self.capacities:
            return
        self.graphs.invalidate()
        self.capacities = caps
        for layout in cache.plan.layouts:
            self.stops.setdefault(layout, torch.zeros((), dtype=torch.long, device=self.device))
        self.masks, self.masks_host = {}, {}
        for layout, causal in mask_keys:
            shape = (MAX_BLOCK_SIZE, layout.capacity)
            self.masks[(layout, causal)] = torch.zeros(shape, dtype=torch.bool, device=self.device)
            self.masks_host[(layout, causal)] = torch.zeros(shape, dtype=torch.bool, pin_memory=self.pin)


def _mask_keys(model, cache) -> list:
    keys = []
    for layer, ctx in zip(model.layers, cache.layers):
        k = (ctx.layout, layer.self_attn.is_causal)
        if k not in keys:
            keys.append(k)
    return keys


def block_step(model, cache, st: StaticDraft, n: int) -> torch.Tensor:
    """Device work of one block of ``n`` (padded) rows: the greedy tokens ``[n]`` (row 0's is junk)."""
    x = model.target.embed_rows(st.ids[:n]).to(model.dtype)
    if model.config.input_embedding_scale != 1.0:
        x = x * model.config.input_embedding_scale
    x = x[None]
    cos, sin = rope_from_positions(model.inv_freq, st.start + st.iota[:n], model.dtype, model.rope_scale)
    rows = {layout: stop + st.iota[:n] for layout, stop in st.stops.items()}
    with sdpa_backends():
        for layer, ctx in zip(model.layers, cache.layers):
            mask = st.masks[(ctx.layout, layer.self_attn.is_causal)][:n]
            x = layer(x, _Span(ctx, rows[ctx.layout]), None, cos, sin, mask)
    return torch.argmax(model.compute_logits(model.norm(x[0])), dim=-1)


@torch.inference_mode()
def propose_static(model, cache, last_token: int, block_size: int) -> list[int]:
    """``block_size - 1`` greedy draft tokens after ``last_token`` through the static step."""
    options: GraphOptions = model.graph_options
    n = bucket_for(block_size, options.buckets, MAX_BLOCK_SIZE)
    mask_keys = _mask_keys(model, cache)
    views = cache.plan.block(n, scratch=True, span="capacity")
    for ctx in cache.layers:  # room for the scratch rows: host-planned, done before the step
        view = views[ctx.layout]
        if view.resize is not None:
            ctx._resize(view.resize, ctx.keys, ctx.values)
    st = cache.static
    if st is None:
        st = cache.static = StaticDraft(model, options, model.graph_pool)
    st.fit(cache, mask_keys)
    ids = st.ids_host
    ids[0] = last_token
    ids[1:n] = int(model.config.mask_token_id)
    st.ids[:n].copy_(ids[:n], non_blocking=True)
    st.start.fill_(cache.length)
    for layout, stop in st.stops.items():
        stop.fill_(views[layout].stop)
    for (layout, causal), host in st.masks_host.items():
        view = views[layout]
        attn = next(l.self_attn for l, c in zip(model.layers, cache.layers) if (c.layout, l.self_attn.is_causal) == (layout, causal))
        m = block_mask(view, n, is_causal=causal, window=attn.window, span="capacity")
        m[:, view.stop + block_size - view.key_start : view.stop + n - view.key_start] = False  # padded rows
        host[:n].copy_(torch.from_numpy(np.ascontiguousarray(m)))
        st.masks[(layout, causal)][:n].copy_(host[:n], non_blocking=True)
    key = (n, st.capacities)
    step = st.graphs.get(key, lambda k: (lambda: block_step(model, cache, st, k[0]), ()))
    return step()[1:block_size].tolist()  # the one host sync
