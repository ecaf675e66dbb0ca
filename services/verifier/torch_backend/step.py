"""The torch verify step with static shapes: what runs eagerly on a CPU and is captured on CUDA.

A verify of L block tokens, planned by the session at its bucket's length n
(``n <= the ring's slack``, so the sliding ring is written in place), is split in two:

* the **step** (:func:`verify_step`), pure device work on tensors whose shapes
  depend only on n and the attended extents: positions from a 0-d ``start``
  tensor, RoPE from the positions, the sliding mask from the device copy of
  the ring's slot positions, the full-attention mask from an iota, the write
  indices of every layer (ring slots, full positions) handed to the layer loop
  as arguments (``attention.IndexedAttention``), the choices by argmax. No host
  sync, no Python-side tensor building -- so ``graphs.GraphedStep`` can capture it;
* the **host part** (:func:`verify_block`): room in the full-attention buffers,
  writing the static inputs, and the one host sync (the choices). The session
  plans, applies and trims its layout around it.

The per-session device state lives on :class:`TorchCaches` (the session's cache
set). On CUDA the extents are the buffers' capacities (fixed shapes); eagerly
(the CPU default) they are the filled prefix, so the CPU never attends over
empty slots.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kakeya.backends.torch.graphs import GraphedStep, GraphOptions, StepGraphs
from kakeya.core.contract import FULL, SLIDING
from kakeya.verifier.caches import SessionCaches
from kakeya.verifier.layout import ForwardPlan, RingLayout
from kakeya.verifier.torch_backend.attention import IndexedAttention

PAD_ID = 0  # token id written into padded block positions (its outputs are dropped)
EMPTY_FAR = -(2**40)  # ring_pos of a slot holding nothing: before every window, so no mask term needed


class TorchCaches(SessionCaches):
    """A session's caches plus the static step's device state; reused whole (graphs included) by a later
    session whose ``key`` (ring geometry, full-cache quantization) is the same."""

    def __init__(
        self,
        layers: list,
        kinds: Sequence[str],
        layout: RingLayout,
        key: tuple,
        device: torch.device,
        options: GraphOptions,
        max_block: int,
        pool=None,
    ):
        super().__init__(layers, kinds)
        self.key = key
        self.sink, self.window, self.rotating = layout.sink, layout.window, layout.rotating
        self.full_layers = [i for i, kind in enumerate(kinds) if kind != SLIDING]
        self.device = device
        self.options = options
        long = dict(dtype=torch.long, device=device)
        self.ids = torch.full((1, max_block), PAD_ID, **long)  # static input: block ids (padded)
        # pinned staging for the ids: a copy from pageable memory would wait for the device
        self.ids_host = torch.empty(max_block, dtype=torch.long, pin_memory=device.type == "cuda")
        self.start = torch.zeros((), **long)  # static input: position of the block's first token
        self.iota = torch.arange(max_block, **long)
        self.ring_pos = torch.full((layout.capacity,), EMPTY_FAR, **long)  # device copy of the slots' positions
        self.key_iota = torch.arange(0, **long)  # slot index of the full buffers (= position)
        self.synced = -1  # the serial of the plan ring_pos is current for (other forwards write the ring too)
        self.last_logits: torch.Tensor | None = None  # the latest step's logits (static output on CUDA)
        self.graphs = StepGraphs(options, pool)

    def reopen(self) -> None:
        """For a new session: its ring holds nothing yet, so ring_pos is resynced before its first step."""
        self.synced = -1

    def full_capacity(self) -> int:
        return min((c.capacity for c in self.fulls), default=0)


def verify_step(target, c: TorchCaches, aux_layers: Sequence[int], n: int, ring_extent: int, full_extent: int):
    """Device work of one verify of ``n`` (padded) positions from ``c.start``: returns
    ``(choices [n] long, aux [n, A] or None, logits [n, vocab] float32)``. Reads and writes only
    ``c``'s buffers."""
    model = target.model
    pos = c.iota[:n] + c.start
    sink, rot = c.sink, c.rotating
    q = pos[:, None]
    where, masks = {}, {}
    if c.rings:
        slots = torch.where(pos < sink, pos, sink + (pos - sink) % rot) if sink else pos % rot
        c.ring_pos.index_copy_(0, slots, pos)  # write first: the block attends to itself (in place)
        k = c.ring_pos[None, :ring_extent]
        if sink:
            masks[SLIDING] = (k >= 0) & (k <= q) & ((k > q - c.window) | (k < sink))
        else:  # empty slots hold EMPTY_FAR, outside every window
            masks[SLIDING] = (k <= q) & (k > q - c.window)
        where[SLIDING] = (slots, ring_extent)
    if c.fulls:
        # eagerly a single query sees all of its filled prefix: no mask (what SDPA runs fastest)
        masks[FULL] = None if n == 1 and not c.options.static_extent else c.key_iota[None, :full_extent] <= q
        where[FULL] = (pos, full_extent)
    hidden, saved = model(c.ids[:, :n], pos, IndexedAttention(c.layers, where, masks), aux_layers)
    logits = model.logits(hidden)[0]
    aux = torch.cat([saved[i][0] for i in aux_layers], dim=-1) if aux_layers else None
    return torch.argmax(logits, dim=-1), aux, logits


def _reserve_full(target, c: TorchCaches, start: int, end: int) -> None:
    """Room for ``end`` positions in every full-attention buffer, the first ``start`` kept (grown on the
    host, between steps)."""
    if not c.fulls or (end <= c.full_capacity() and c.key_iota.numel() >= c.full_capacity()):
        return
    moved = False
    for i in c.full_layers:
        moved |= c.layers[i].reserve(end, start, *target.kv_like(i))
    cap = c.full_capacity()
    if moved or c.key_iota.numel() < cap:
        c.key_iota = torch.arange(cap, dtype=torch.long, device=c.device)
        c.graphs.invalidate()  # graphs hold the old buffers' addresses


def verify_block(target, c: TorchCaches, block_ids: Sequence[int], aux_layers: Sequence[int], plan: ForwardPlan):
    """Verify ``block_ids`` through the static step as ``plan`` (its bucket's length, padding appended) says;
    returns ``(choices list, aux [L, A] or None)``."""
    L, n, start = len(block_ids), plan.n_new, plan.start
    if plan.serial != c.synced:  # another forward wrote the ring since this set's last step
        c.ring_pos.copy_(torch.from_numpy(np.where(plan.slot_positions < 0, EMPTY_FAR, plan.slot_positions)))
    c.synced = plan.serial + 1
    _reserve_full(target, c, start, start + n)
    c.ids_host[:L] = torch.tensor(block_ids, dtype=torch.long)
    c.ids[0, :L].copy_(c.ids_host[:L], non_blocking=True)
    if n > L:
        c.ids[0, L:n].fill_(PAD_ID)
    c.start.fill_(start)
    if c.options.static_extent:  # fixed shapes: one graph per (bucket, buffer sizes)
        key = (n, len(c.ring_pos), c.full_capacity(), tuple(aux_layers))
        step = c.graphs.get(key, lambda k: (lambda: verify_step(target, c, k[3], *k[:3]), ()))
    else:  # eager: attend over the filled prefix only (the CPU never scans empty slots)
        step = GraphedStep(lambda: verify_step(target, c, aux_layers, n, plan.used, start + n), (), capture=False)
    choices, aux, c.last_logits = step()  # the logits stay on the device (tests read them)
    out = choices[:L].tolist()  # the one host sync of a verify
    if aux is not None:
        aux = aux[:L].clone() if step.captured else aux[:L]  # a replay overwrites static outputs
    return out, aux
