"""The torch verify step over pooled K/V: any number of sessions' blocks in one forward whose device work does not grow
with the number of sessions.

A step takes :class:`~kakeya.verifier.backend.Segment` s (a session's block and its ``RingLayout``'s plan, in place:
``n_new <= slack``) whose caches are pages of one target's pools (``pool.py``), runs every row-wise op once over all
rows, and per layer ONE cache write and ONE attention call through a padded ``[sessions, slots]`` table of pool rows,
masks built on the device from positions; then the greedy choices of all rows in ONE host sync.

Shapes depend only on :class:`Shape`: with ``static_extent`` (CUDA) everything is padded to buckets and ``StepGraphs``
captures one graph per shape (padded rows write the trash page and see one real key: a softmax over none is NaN);
eagerly sizes are exact. Outputs equal each session's alone up to the floating-point order of a matmul over more rows
and of attention over more (masked) slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kakeya.backends.torch.graphs import StepGraphs, bucket_for, eager_step, session_bucket, unpack
from kakeya.backends.torch.pages import whole_pages
from kakeya.core.contract import FULL, SLIDING
from kakeya.core.request import MAX_BLOCK_SIZE
from kakeya.verifier.backend import Forward, Segment
from kakeya.verifier.torch_backend.pool import runs_of

PAD_ID = 0  # token id of padded rows (their outputs are dropped)
DEFAULT_MIN_EXTENT = 256  # full-attention positions a captured step attends over at least (then doubling)


@dataclass(frozen=True)
class Shape:
    """What fixes a step's tensor shapes (a captured graph's key)."""

    sessions: int  # table rows
    block: int  # query slots per session in attention's layout
    rows: int  # rows of the row-wise ops: the blocks in a row (ragged) or sessions * block
    ring: int  # ring slots attended per session (a multiple of the page; 0: no sliding layers)
    full: int  # full-attention positions attended per session (a multiple of the page; 0: no full layers)
    ragged: bool
    aux: tuple[int, ...]
    choices: bool
    full_key: tuple  # which full pool (its storage)
    generation: tuple[int, int]  # the pools' generations: a graph holds their tensors' addresses

    def fields(self, page: int) -> list[tuple[str, int]]:
        """The packed input's fields, in order, with their lengths."""
        n, slots = self.sessions, self.sessions * self.block
        out = [("ids", self.rows), ("pos", self.rows), ("qpos", slots)]
        if self.ragged:
            out += [("to_pad", slots), ("from_pad", self.rows)]
        if self.ring:
            out += [("ring_write", self.rows), ("ring_pages", n * self.ring // page), ("ring_kpos", n * self.ring)]
            out += [("window", n), ("sinks", n)]
        if self.full:
            out += [("full_write", self.rows), ("full_pages", n * self.full // page), ("end", n)]
        return out


def poolable(segments: Sequence[Segment]) -> bool:
    """Whether one batched step takes ``segments``: pooled caches of one full pool, plans in place,
    nothing restored (f_theta is MLX-only)."""
    keys = {getattr(s.caches, "batch_key", None) for s in segments}
    return (
        len(keys) == 1
        and getattr(segments[0].caches, "pooled", False)
        and all(s.plan.in_place and s.plan.restore is None for s in segments)
    )


class Batch:
    """The host half of one step: pages reserved, the :class:`Shape`, the packed inputs, each segment's first row."""

    def __init__(self, target, segments: Sequence[Segment], choices: bool):
        opts = target.graph_options
        caches = [s.caches for s in segments]
        for s in segments:  # every page the step writes, before its tables are built
            s.caches.reserve(s.plan.start + s.plan.n_new)
        pool, c0 = target.pool, caches[0]
        page = pool.page
        planned = [s.plan.n_new for s in segments]
        if any(len(s.ids) > s.plan.n_new for s in segments):
            raise ValueError("a segment holds more ids than its plan's positions")
        N = len(segments)
        if opts.static_extent:
            Nb, Lb = session_bucket(N), bucket_for(max(planned), opts.buckets, MAX_BLOCK_SIZE)
        else:
            Nb, Lb = N, max(planned)
        ragged = not opts.static_extent and any(n != Lb for n in planned)
        rows = sum(planned) if ragged else Nb * Lb
        self.offsets = list(np.cumsum([0] + planned[:-1])) if ragged else [b * Lb for b in range(N)]
        ring = full = 0
        if pool.sliding is not None:  # static: every ring slot; eagerly: the slots used
            used = max(
                len(c.ring_pages) * page if opts.static_extent else s.plan.used for c, s in zip(caches, segments)
            )
            ring = whole_pages(used, page)
        if c0.full is not None:  # static: a doubling extent from min_extent; eagerly: the positions held
            end = max(s.plan.start + s.plan.n_new for s in segments)
            full = target.min_extent if opts.static_extent else end
            while full < end:
                full *= 2
            full = whole_pages(full, page)
        aux = segments[0].aux_layers
        self.uniform_aux = all(s.aux_layers == aux for s in segments)
        if not self.uniform_aux:
            aux = tuple(sorted({i for s in segments for i in s.aux_layers}))
        gens = (pool.sliding.generation if pool.sliding is not None else 0, c0.full.generation if c0.full else 0)
        self.shape = Shape(Nb, Lb, rows, ring, full, ragged, aux, choices, c0.batch_key, gens)
        self.segments, self.page = segments, page
        self.packed = self._pack(segments, planned)
        # A lone session whose attended pages lie in a row (pages are handed out lowest first, so a session
        # alone usually holds consecutive ones) is read as a slice of the pool instead of gathered row by row:
        # eagerly only (a captured step reads through its tables whatever the pages are).
        self.spans: dict[str, int] = {}
        if N == 1 and not opts.static_extent:
            for kind, pages, extent in ((SLIDING, c0.ring_pages, ring), (FULL, c0.full_pages, full)):
                first = _first_row(pages, extent // page, page) if extent else None
                if first is not None:
                    self.spans[kind] = first

    def _pack(self, segments, planned) -> np.ndarray:
        sh, page = self.shape, self.page
        Nb, Lb = sh.sessions, sh.block
        f = {name: np.zeros(size, np.int64) for name, size in sh.fields(page)}
        f["ids"][:] = PAD_ID
        f["qpos"][:] = np.tile(np.arange(Lb), Nb)  # padded sessions: positions 0.. (they see the trash row)
        if sh.ring:
            kpos = f["ring_kpos"].reshape(Nb, sh.ring)
            kpos[:] = -1
            kpos[:, 0] = 0  # a padded session's one visible key: the trash row, a sink at position 0
            f["window"][:] = f["sinks"][:] = 1
        if sh.full:
            f["end"][:] = 1
        lane = np.arange(Lb)
        for b, (s, n, o) in enumerate(zip(segments, planned, self.offsets)):
            plan, c = s.plan, s.caches
            f["ids"][o : o + len(s.ids)] = s.ids
            width = n if sh.ragged else Lb  # rows of this session in the row-wise layout
            f["pos"][o : o + width] = plan.start + lane[:width]
            # a padded row asks what the session's last row asks: it sees keys (a softmax over none is NaN)
            f["qpos"][b * Lb : (b + 1) * Lb] = plan.start + np.minimum(lane, n - 1)
            if sh.ragged:
                f["to_pad"][b * Lb : (b + 1) * Lb] = o + np.minimum(lane, n - 1)
                f["from_pad"][o : o + n] = b * Lb + lane[:n]
            if sh.ring:
                slots, src = runs_of(plan)
                ring_rows = c.ring_rows()
                f["ring_write"][o + src] = ring_rows[slots]
                after = plan.slot_positions.copy()
                after[slots] = plan.start + src
                kpos[b] = -1
                k = min(sh.ring, len(after))
                kpos[b, :k] = after[:k]
                pages = c.ring_pages[: sh.ring // page]
                f["ring_pages"].reshape(Nb, -1)[b, : len(pages)] = pages
                f["window"][b], f["sinks"][b] = c.window, c.sink
            if sh.full:
                f["full_write"][o : o + n] = c.full_rows(plan.start, plan.start + n)
                pages = c.full_pages[: sh.full // page]
                f["full_pages"].reshape(Nb, -1)[b, : len(pages)] = pages
                f["end"][b] = plan.start + n
        return np.concatenate([f[name] for name, _ in sh.fields(page)])


def _first_row(pages: Sequence[int], n: int, page: int) -> int | None:
    """The first row of ``pages[:n]`` if those pages are consecutive (their rows one slice of the pool)."""
    if len(pages) < n or any(pages[j] != pages[0] + j for j in range(1, n)):
        return None
    return pages[0] * page


class PooledAttention:
    """The ``Attend`` of a batched step (``gemma4.Gemma4Text.forward``): per layer, every row's K/V into
    its pool row, then one attention call over every session's rows through the tables."""

    def __init__(self, target, shape: Shape, f: dict, page: int, spans: dict[str, int] | None = None):
        self.shape, self.f, self.page = shape, f, page
        self.spans = spans or {}  # layer type -> first pool row of a lone session's attended slots (``Batch``)
        pool = target.pool
        self.pools = (
            {SLIDING: pool.sliding, FULL: pool.fulls[shape.full_key[1:]]} if shape.full else {SLIDING: pool.sliding}
        )
        self.kernel = target.attention_kernel and all(p is None or p.exact for p in self.pools.values())
        self.groups: dict[str, tuple] = {}

    def _group(self, t: str) -> tuple:
        """(write rows, table, key positions, query positions, windows, sinks, mask) of a layer type,
        made once per step on the device."""
        g = self.groups.get(t)
        if g is not None:
            return g
        sh, f, P = self.shape, self.f, self.page
        N, L = sh.sessions, sh.block
        ring = t == SLIDING
        S = sh.ring if ring else sh.full
        iota = torch.arange(S, device=f["qpos"].device)
        pages = f["ring_pages" if ring else "full_pages"].view(N, S // P)
        table = (pages[:, :, None] * P + iota[:P]).view(N, S)
        q = f["qpos"].view(N, L)
        if ring:
            kpos, win, snk = f["ring_kpos"].view(N, S), f["window"], f["sinks"]
        else:
            kpos, win, snk = torch.where(iota[None, :] < f["end"][:, None], iota[None, :], -1), None, None
        mask = None
        if not self.kernel:
            k, qq = kpos[:, None, :], q[:, :, None]
            mask = (k >= 0) & (k <= qq)
            if ring:
                mask = mask & ((k > qq - win[:, None, None]) | (k < snk[:, None, None]))
            mask = mask[:, None]  # [sessions, 1, block, slots]: every head alike
        g = (f["ring_write" if ring else "full_write"], table, kpos, q, win, snk, mask)
        self.groups[t] = g
        return g

    def __call__(self, i: int, layer, q: torch.Tensor, k, v, shared):
        t = layer.layer_type
        write, table, kpos, qpos, win, snk, mask = self._group(t)
        pool = self.pools[t]
        sh = self.shape
        N, L = sh.sessions, sh.block
        if shared is None:
            pool.write(i, write, k[0], v[0])
            if self.kernel:
                kv = i  # the kernel reads the pool itself
            elif t in self.spans:
                kv = pool.span(i, self.spans[t], table.shape[1])
            else:
                kv = pool.gather(i, table)
        else:
            kv = shared
        H, D = q.shape[1], q.shape[3]
        if self.kernel:
            from kakeya.backends.torch.kernels import attention as kernel

            rows = q[0].transpose(0, 1)  # [rows, heads, D]: the projection's own layout
            rows = (rows[self.f["to_pad"]] if sh.ragged else rows).reshape(N, L, H, D)
            window, sinks = 0 if win is None else win, 0 if snk is None else snk
            out = kernel.decode_attention(
                rows, pool.keys[kv][0], pool.values[kv][0], table, kpos, qpos, window=window, sinks=sinks
            ).view(N * L, H, D)
            return (out[self.f["from_pad"]] if sh.ragged else out).transpose(0, 1)[None], kv
        qq = q[0][:, self.f["to_pad"]] if sh.ragged else q[0]  # [heads, rows, D]
        keys, values = (t.transpose(0, 1) for t in kv)
        out = layer.attn.attend(qq.reshape(H, N, L, D).transpose(0, 1), keys, values, mask, 1.0)  # [N, heads, L, D]
        out = out.transpose(0, 1).reshape(H, N * L, -1)
        return (out[:, self.f["from_pad"]] if sh.ragged else out)[None], kv


def batch_step(target, shape: Shape, packed: torch.Tensor, spans: dict[str, int] | None = None):
    """Device work of one step: ``(choices [rows] or None, aux [rows, A] or None, hidden [1, rows, H],
    logits [rows, vocab] or None, saved)``; reads only ``packed`` and the pools, writes only the pools."""
    f = unpack(packed, shape.fields(target.pool.page))
    model = target.model
    hidden, saved = model(
        f["ids"].view(1, -1), f["pos"], PooledAttention(target, shape, f, target.pool.page, spans), shape.aux
    )
    aux = torch.cat([saved[i][0] for i in shape.aux], dim=-1) if shape.aux else None
    if not shape.choices:
        return None, aux, hidden, None, saved
    logits = model.logits(hidden)[0]
    return torch.argmax(logits, dim=-1), aux, hidden, logits, saved


class BatchSteps:
    """A target's steps: with ``static_extent`` one per :class:`Shape`, kept (captured on CUDA) with its
    static packed input; eagerly one made per call around the packed vector itself."""

    def __init__(self, target, graph_pool=None):
        self.target = target
        self.graphs = StepGraphs(target.graph_options, graph_pool)
        self.generations: dict[tuple, tuple] = {}  # full pool -> the generations its kept steps read

    def __call__(self, batch: Batch):
        target, sh = self.target, batch.shape
        if not target.graph_options.static_extent:
            return eager_step(lambda packed: batch_step(target, sh, packed, batch.spans), batch.packed, target.device)
        if sh.generation != self.generations.get(sh.full_key):  # a pool grew: graphs that read it are stale
            graphs = self.graphs
            for k in [k for k in graphs.inputs if k.generation[0] != sh.generation[0] or k.full_key == sh.full_key]:
                graphs.drop(k)
            self.generations = {k: g for k, g in self.generations.items() if g[0] == sh.generation[0]}
            self.generations[sh.full_key] = sh.generation
        device = self.graphs.stage(sh, batch.packed, target.device, syncs=sh.choices)
        return self.graphs.get(sh, lambda key: (lambda: batch_step(target, key, device), ()))


def run(target, segments: Sequence[Segment], choices: bool) -> tuple[list[Forward], list | None, torch.Tensor]:
    """Segments through one step: a :class:`Forward` per segment (its ``len(ids)`` rows), the greedy choices of those
    rows (``choices``; one host sync for them all) and the logits of every row (None without choices)."""
    with target.pool.stepping():
        batch = Batch(target, segments, choices)
        step = target.steps(batch)
        picked, aux, hidden, logits, saved = step()
    flat = picked.tolist() if choices else None  # the one host sync
    if step.captured:  # a replay overwrites static outputs: keep what outlives this call
        hidden = hidden.clone()
        aux = aux.clone() if aux is not None else None
        logits = logits.clone() if logits is not None else None
        saved = {i: x.clone() for i, x in saved.items()} if not batch.uniform_aux else saved
    outs, picks = [], []
    for s, o in zip(segments, batch.offsets):
        n = len(s.ids)
        if batch.uniform_aux:
            a = aux[o : o + n] if aux is not None else None
        else:
            a = torch.cat([saved[i][0, o : o + n] for i in s.aux_layers], dim=-1) if s.aux_layers else None
        outs.append(Forward(hidden[:, o : o + n], a))
        picks.append(flat[o : o + n] if flat is not None else None)
    return outs, picks, logits
