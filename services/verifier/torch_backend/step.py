"""The torch verify step with static shapes: what runs eagerly on a CPU and is captured on CUDA.

A verify of L block tokens (L <= the ring's slack, so the sliding ring is written
in place) is split in two:

* the **step** (:func:`verify_step`), pure device work on tensors whose shapes
  depend only on the padded length and the attended extents: positions from a
  0-d ``start`` tensor, RoPE from the positions, the sliding mask from the
  device copy of the ring's slot positions, the full-attention mask from an
  iota, K/V written with ``index_copy_``, the choices by argmax. No host sync,
  no Python-side tensor building -- so ``graphs.GraphedStep`` can capture it;
* the **host part** (:func:`verify_block`): ring planning (``cache.py``), room in
  the full-attention buffers, writing the static inputs, padding up to the
  bucket and trimming the padding back, and the one host sync (the choices).

The per-session device state lives on :class:`TorchCaches` (the session's cache
list). On CUDA the extents are the buffers' capacities (fixed shapes); eagerly
(the CPU default) they are the filled prefix, so the CPU never attends over
empty slots.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from kakeya.backends.torch.graphs import GraphedStep, GraphOptions, StepGraphs, bucket_for
from kakeya.core.contract import FULL, SLIDING
from kakeya.verifier.layout import RingLayout
from kakeya.verifier.torch_backend.cache import RingKVCache

PAD_ID = 0  # token id written into padded block positions (its outputs are dropped)
EMPTY_FAR = -(2**40)  # ring_pos of a slot holding nothing: before every window, so no mask term needed


class TorchCaches(list):
    """A session's per-layer caches (the list ``session.py`` sees) plus the static step's device state."""

    def __init__(self, caches: list, layout: RingLayout, device: torch.device, options: GraphOptions, max_block: int, pool=None):
        super().__init__(caches)
        self.layout = layout
        self.device = device
        self.options = options
        self.rings = [c for c in caches if isinstance(c, RingKVCache)]
        self.fulls = [c for c in caches if not isinstance(c, RingKVCache)]
        self.max_block = max_block
        long = dict(dtype=torch.long, device=device)
        self.ids = torch.full((1, max_block), PAD_ID, **long)  # static input: block ids (padded)
        # pinned staging for the ids: a copy from pageable memory would wait for the device
        self.ids_host = torch.empty(max_block, dtype=torch.long, pin_memory=device.type == "cuda")
        self.start = torch.zeros((), **long)  # static input: position of the block's first token
        self.iota = torch.arange(max_block, **long)
        self.ring_pos = torch.full((layout.capacity,), EMPTY_FAR, **long)  # device copy of layout.positions
        self.key_iota = torch.arange(0, **long)  # slot index of the full buffers (= position)
        self.ring_stale = True  # a dynamic forward wrote the ring: resync ring_pos from the host
        self.last_logits: torch.Tensor | None = None  # the latest step's logits (static output on CUDA)
        self.graphs = StepGraphs(options, pool)

    def mark_dynamic(self) -> None:
        self.ring_stale = True

    def full_capacity(self) -> int:
        return min((c.capacity for c in self.fulls), default=0)


def verify_step(target, c: TorchCaches, aux_layers: Sequence[int], n: int, ring_extent: int, full_extent: int):
    """Device work of one verify of ``n`` (padded) positions from ``c.start``: returns
    ``(choices [n] long, aux [n, A] or None, logits [n, vocab] float32)``. Reads and writes only
    ``c``'s buffers."""
    model, layout = target.model, c.layout
    pos = c.iota[:n] + c.start
    sink, rot = layout.sink, layout.rotating
    q = pos[:, None]
    masks: dict = {}
    if c.rings:
        slots = torch.where(pos < sink, pos, sink + (pos - sink) % rot) if sink else pos % rot
        c.ring_pos.index_copy_(0, slots, pos)  # write first: the block attends to itself (in place)
        k = c.ring_pos[None, :ring_extent]
        if sink:
            masks[SLIDING] = (k >= 0) & (k <= q) & ((k > q - layout.window) | (k < sink))
        else:  # empty slots hold EMPTY_FAR, outside every window
            masks[SLIDING] = (k <= q) & (k > q - layout.window)
        for r in c.rings:
            r.at = (slots, ring_extent)
    if c.fulls:
        # eagerly a single query sees all of its filled prefix: no mask (what SDPA runs fastest)
        masks[FULL] = None if n == 1 and not c.options.static_extent else c.key_iota[None, :full_extent] <= q
        for f in c.fulls:
            f.at = (pos, full_extent)
    try:
        out = model(c.ids[:, :n], c, aux_layers, masks, pos)
    finally:
        for x in c.rings + c.fulls:
            x.at = None
    logits = model.logits(out.hidden)[0]
    return torch.argmax(logits, dim=-1), out.aux, logits


def _reserve_full(target, c: TorchCaches, end: int) -> None:
    """Room for ``end`` positions in every full-attention buffer (grown on the host, between steps)."""
    if not c.fulls or (end <= c.full_capacity() and c.key_iota.numel() >= c.full_capacity()):
        return
    moved = False
    for i, f in enumerate(c):
        if not isinstance(f, RingKVCache):
            moved |= f.reserve(end, *target.kv_like(i))
    cap = c.full_capacity()
    if moved or c.key_iota.numel() < cap:
        c.key_iota = torch.arange(cap, dtype=torch.long, device=c.device)
        c.graphs.invalidate()  # graphs hold the old buffers' addresses


def verify_block(target, c: TorchCaches, block_ids: Sequence[int], aux_layers: Sequence[int]):
    """Verify ``block_ids`` through the static step; returns ``(choices list, aux [L, A] or None)``.

    The block runs at its bucket's length (padding appended); the padded positions
    are planned, written and then trimmed like rejected draft tokens, so the
    caches end exactly as after an unpadded verify.
    """
    layout = c.layout
    L = len(block_ids)
    n = bucket_for(L, c.options.buckets, min(layout.slack, c.max_block))
    if c.ring_stale:
        c.ring_pos.copy_(torch.from_numpy(np.where(layout.positions < 0, EMPTY_FAR, layout.positions)))
        c.ring_stale = False
    start = layout.offset
    plan = layout.plan(n)  # in place (n <= slack): the host's slot bookkeeping; the device derives the rest
    _reserve_full(target, c, start + n)
    c.ids_host[:L] = torch.tensor(block_ids, dtype=torch.long)
    c.ids[0, :L].copy_(c.ids_host[:L], non_blocking=True)
    if n > L:
        c.ids[0, L:n].fill_(PAD_ID)
    c.start.fill_(start)
    if c.options.static_extent:  # fixed shapes: one graph per (bucket, buffer sizes)
        key = (n, layout.capacity, c.full_capacity(), tuple(aux_layers))
        step = c.graphs.get(key, lambda k: (lambda: verify_step(target, c, k[3], *k[:3]), ()))
    else:  # eager: attend over the filled prefix only (the CPU never scans empty slots)
        step = GraphedStep(lambda: verify_step(target, c, aux_layers, n, plan.used, start + n), (), capture=False)
    choices, aux, c.last_logits = step()  # the logits stay on the device (tests read them)
    layout.applied()
    for f in c.fulls:
        f.offset += n
    if n > L:
        layout.trim(n - L)
        for f in c.fulls:
            f.trim(n - L)
    out = choices[:L].tolist()  # the one host sync of a verify
    if aux is not None:
        aux = aux[:L].clone() if step.captured else aux[:L]  # a replay overwrites static outputs
    return out, aux
