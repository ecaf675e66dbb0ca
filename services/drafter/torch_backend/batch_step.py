"""The torch drafter's context K/V pool and its draft step: any number of sessions' extensions and blocks in one step
whose device work does not grow with the number of sessions.

The pool is the verifier's design (``verifier/torch_backend/pool.py``) without rollback, since a drafter's context only
grows: a session (:class:`PooledContext`) holds its full-attention context as pages and its sliding context as a ring of
``ring >= sliding_window - 1`` slots. A step writes each block's K/V into the pools' *scratch* rows, never a session's
pages, so several blocks of one session (a pre-draft's) run in one step and the context holds committed positions only.

A step (:func:`run`) projects every extension's new aux rows at once, then runs as the verifier's step does
(``verifier/torch_backend/batch_step.py``: shapes fixed by :class:`Shape`, captured per shape with ``static_extent``)
over a padded ``[blocks, context slots + block lanes]`` table, then the greedy tokens in ONE host sync.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kakeya.backends.torch.graphs import BUCKETS, StepGraphs, bucket_for, eager_step, session_bucket, unpack
from kakeya.backends.torch.ops import rope_from_positions, sdpa, sdpa_backends
from kakeya.backends.torch.pages import CHUNK_PAGES, PAGE, TRASH_PAGE, PagePool, give_back, page_rows, whole_pages
from kakeya.core.contract import SLIDING
from kakeya.core.request import MAX_BLOCK_SIZE
from kakeya.drafter.context import ContextSnapshot

LANE_BUCKETS = BUCKETS + (2 * MAX_BLOCK_SIZE,)  # a pre-draft's block: its pending candidates, then a block
MIN_EXTENT = 256  # full-attention positions a captured step attends over at least (then doubling)


class DraftPool:
    """A drafter model's pools: ``sliding`` (rings) and ``full`` (pages by position), None where no layer
    is of that kind; ``ring``: slots of a session's ring (a whole number of pages)."""

    def __init__(self, config, device, dtype, page: int = PAGE, chunk: int = CHUNK_PAGES):
        self.config, self.device, self.dtype, self.page = config, device, dtype, page
        self.kinds = list(config.layer_types)
        a = config.layer_attention(0)  # every layer's K/V rows have the same shape
        sliding = [i for i, t in enumerate(self.kinds) if t == SLIDING]
        full = [i for i, t in enumerate(self.kinds) if t != SLIDING]
        shapes = lambda layers: {i: (a.n_kv, a.head_dim) for i in layers}
        make = lambda ls: PagePool(shapes(ls), device, dtype, page, chunk) if ls else None
        self.sliding, self.full = make(sliding), make(full)
        self.keep = int(config.sliding_window) - 1 if sliding else 0  # the context rows a window shows
        self.ring = whole_pages(self.keep, page) if sliding else 0
        self.lock = threading.RLock()

    def of(self, i: int) -> PagePool:  # layer ``i``'s pool
        return self.sliding if self.kinds[i] == SLIDING else self.full

    def stepping(self) -> threading.RLock:
        """Held while pages are planned and a step runs: one step of a model at a time, no growth under it."""
        return self.lock


def _release(pool: DraftPool, ring: list, full: list) -> None:
    with pool.lock:
        give_back([(pool.sliding, ring), (pool.full, full)])


class PooledContext:
    """One session's context K/V as pages of its model's pools (the torch ``ContextKVCache``)."""

    def __init__(self, pool: DraftPool):
        self.pool, self.length = pool, 0  # length: context positions written (absolute)
        with pool.lock:
            self.ring_pages = pool.sliding.take(pool.ring // pool.page) if pool.sliding is not None else []
        self.full_pages: list[int] = []
        self._release = weakref.finalize(self, _release, pool, self.ring_pages, self.full_pages)

    def reserve(self, positions: int) -> None:
        """Full pages for ``positions`` positions (taken before a step, never during one)."""
        if self.pool.full is not None:
            with self.pool.lock:
                self.pool.full.hold(self.full_pages, positions)

    def ring_rows(self) -> np.ndarray:  # pool row of every ring slot, in slot order
        return page_rows(self.ring_pages, self.pool.page)

    def full_rows(self, lo: int, hi: int) -> np.ndarray:
        """Pool rows of full-attention positions ``lo .. hi`` (pages reserved)."""
        return self.pool.full.position_rows(self.full_pages, lo, hi)

    def write_rows(self, start: int, n: int) -> tuple[np.ndarray | None, np.ndarray | None]:
        """(ring rows, full rows) where positions ``start .. start+n`` go (one the ring will not hold once
        all are written goes to the trash row)."""
        pool, ring, full = self.pool, None, None
        if pool.sliding is not None:
            p = np.arange(start, start + n)
            ring = np.where(p >= start + n - pool.ring, self.ring_rows()[p % pool.ring], TRASH_PAGE * pool.page)
        if pool.full is not None:
            self.reserve(start + n)
            full = self.full_rows(start, start + n)
        return ring, full

    @torch.inference_mode()  # the pools are inference tensors: written in that mode only
    def append(self, kv: list) -> None:
        """Eagerly (``backend.extend``): ``kv``, one ``(keys, values)`` ``[1, n_kv, n_new, head_dim]`` per layer."""
        if len(kv) != len(self.pool.kinds):
            raise ValueError(f"expected K/V for {len(self.pool.kinds)} layers, got {len(kv)}")
        for i, (k, v) in enumerate(kv):
            self._write_layer(i, self.length, k, v)
        self.length += kv[0][0].shape[2]

    def view(self, i: int):
        """Layer ``i``'s visible context K/V ``[1, n_kv, n, head_dim]`` (the last ``keep`` positions on a
        sliding layer; copies; None, None when empty)."""
        pool = self.pool
        sliding = pool.kinds[i] == SLIDING
        lo = max(0, self.length - pool.keep) if sliding else 0
        if self.length == lo:
            return None, None
        rows = self.ring_rows()[np.arange(lo, self.length) % pool.ring] if sliding else self.full_rows(lo, self.length)
        k, v = pool.of(i).gather(i, torch.from_numpy(rows).to(pool.device))
        return k[None], v[None]

    @property
    def nbytes(self) -> int:
        pages = ((self.pool.sliding, self.ring_pages), (self.pool.full, self.full_pages))
        return sum(len(held) * self.pool.page * p.row_bytes for p, held in pages if p is not None)

    @property
    def rows_held(self) -> int:
        """Rows held over every layer (``nbytes`` per row: what a server's admission counts by)."""
        return self.rows_after(None)

    def rows_after(self, new_rows: int | None) -> int:
        """``rows_held`` once ``new_rows`` more positions are in (None: now); a block's rows are the pool's
        scratch, held by no session."""
        pool, rows = self.pool, 0
        if pool.sliding is not None:
            rows += len(pool.sliding.shapes) * len(self.ring_pages) * pool.page
        if pool.full is not None:
            pages = max(len(self.full_pages), -(-(self.length + (new_rows or 0)) // pool.page))
            rows += len(pool.full.shapes) * pages * pool.page
        return rows

    @torch.inference_mode()
    def snapshot(self) -> ContextSnapshot:  # a prefix snapshot: per layer its visible rows, copied
        kv = [self.view(i) for i in range(len(self.pool.kinds))]
        nbytes = sum(k.nbytes + v.nbytes for k, v in kv if k is not None)
        rows: dict = {}  # one row count per layer kind, as context.py's layouts
        for (k, _), t in zip(kv, self.pool.kinds):
            rows.setdefault(t, 0 if k is None else k.shape[2])
        return ContextSnapshot(self.length, list(rows.values()), kv, nbytes)

    @torch.inference_mode()
    def restore(self, snap: ContextSnapshot, back: int = 0) -> None:
        """An empty cache set to ``snap``'s rows, less its newest ``back`` positions (``snap.truncatable`` only)."""
        keep = snap.resumed(self.length, back)
        for i, (k, v) in enumerate(snap.kv):
            if k is not None:  # its rows are positions lo .. snap.length (lo = 0 when truncatable)
                lo = snap.length - k.shape[2]
                self._write_layer(i, lo, k[:, :, : keep - lo], v[:, :, : keep - lo])
        self.length = keep

    def _write_layer(self, i: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        with self.pool.lock:
            ring, full = self.write_rows(start, k.shape[2])
            rows = ring if self.pool.kinds[i] == SLIDING else full
            self.pool.of(i).write(i, torch.from_numpy(rows).to(self.pool.device), k[0], v[0])

    def reset(self) -> None:
        """Empty, for the next session: the ring's pages kept, the full pages given back."""
        self.length = 0
        _release(self.pool, [], self.full_pages)

    def release(self) -> None:  # every page back to its pool (idempotent)
        self._release()


@dataclass(frozen=True)
class Shape:
    """What fixes a step's tensor shapes (a captured graph's key)."""

    sessions: int  # table rows: blocks (padded)
    block: int  # query lanes per block in attention's layout (0: an extension alone)
    rows: int  # block rows of the row-wise ops: the blocks in a row (ragged) or sessions * block
    drafts: int  # rows whose logits are taken
    ext: int  # extension rows
    ring: int  # ring slots a block attends (0: no sliding layers)
    full: int  # full-attention positions a block attends (a multiple of the page; 0: no full layers)
    ragged: bool
    generation: tuple[int, int]  # the pools' generations: a graph holds their tensors' addresses

    def fields(self, page: int) -> list[tuple[str, int]]:
        """The packed input's fields, in order, with their lengths."""
        out = []
        if self.ext:
            out += [("ext_pos", self.ext)]
            out += [("ext_ring", self.ext)] if self.ring else []
            out += [("ext_full", self.ext)] if self.full else []
        if self.block:
            n, lanes = self.sessions, self.sessions * self.block
            out += [("ids", self.rows), ("pos", self.rows), ("qpos", lanes), ("clen", n), ("bend", n)]
            out += [("drafts", self.drafts)]
            if self.ragged:
                out += [("to_pad", lanes), ("from_pad", self.rows)]
            if self.ring:
                out += [("blk_ring", self.rows), ("tab_ring", lanes), ("ring_pages", n * self.ring // page)]
            if self.full:
                out += [("blk_full", self.rows), ("tab_full", lanes), ("full_pages", n * self.full // page)]
        return out


class Batch:
    """The host half of one step: caches' rows planned (their lengths advanced by the extensions), the
    :class:`Shape`, the packed inputs, and how many drafted rows are real."""

    def __init__(self, pool, extensions: Sequence[tuple], blocks: Sequence[tuple], static: bool):
        page = pool.page
        ext = [(c, a.shape[0]) for c, a in extensions if a.shape[0]]
        sizes = [len(ids) for _, ids in blocks]
        if any(n < 2 for n in sizes):
            raise ValueError("a block drafts after its first token: at least 2 ids")
        N, total = len(blocks), sum(n for _, n in ext)
        if static:
            Nb = session_bucket(max(N, len(ext), 1))
            Lb = bucket_for(max(sizes), LANE_BUCKETS, 2 * MAX_BLOCK_SIZE) if N else 0
            X = Nb * bucket_for(max(n for _, n in ext), BUCKETS, MAX_BLOCK_SIZE) if ext else 0
        else:
            Nb, Lb, X = N, max(sizes, default=0), total
        ragged = not static and any(n != Lb for n in sizes)
        rows = sum(sizes) if ragged else Nb * Lb
        self.offsets = list(np.cumsum([0] + sizes[:-1])) if ragged else [b * Lb for b in range(N)]
        self.real = sum(n - 1 for n in sizes)  # drafted rows: each block's rows 1..
        drafts = Nb * (Lb - 1) if static and N else self.real
        f = {name: np.zeros(X, np.int64) for name in ("ext_pos", "ext_ring", "ext_full")}
        at = 0
        for c, n in ext:  # the extensions first: the blocks' context includes them
            ring, full = c.write_rows(c.length, n)
            f["ext_pos"][at : at + n] = np.arange(c.length, c.length + n)
            for name, where in (("ext_ring", ring), ("ext_full", full)):
                if where is not None:
                    f[name][at : at + n] = where
            c.length += n
            at += n
        clens = [c.length for c, _ in blocks]
        S_full = 0
        if pool.full is not None:  # static: a doubling extent from MIN_EXTENT; eagerly the context (or a page)
            end = max(clens, default=0)
            S_full = MIN_EXTENT if static and N else end
            while S_full < end:
                S_full *= 2
            S_full = whole_pages(S_full, page)
        scratch = {  # taken (the pools may grow) before the generations are read
            kind: p.scratch(Nb * Lb) for kind, p in (("ring", pool.sliding), ("full", pool.full)) if p is not None
        }
        gens = tuple(p.generation if p is not None else 0 for p in (pool.sliding, pool.full))
        self.shape = Shape(Nb, Lb, rows, drafts, X, pool.ring, S_full, ragged, gens)
        if N:
            self._blocks(f, pool, blocks, sizes, clens, scratch)
        self.packed = np.concatenate([f[name] for name, _ in self.shape.fields(page)])

    def _blocks(self, f, pool, blocks, sizes, clens, scratch) -> None:
        sh, page = self.shape, pool.page
        Nb, Lb = sh.sessions, sh.block
        lanes = np.arange(Lb)
        f["ids"] = np.zeros(sh.rows, np.int64)  # padded rows: token 0, position 0 (their outputs are dropped)
        f["pos"] = np.zeros(sh.rows, np.int64)
        f["qpos"] = np.tile(lanes, Nb)  # a padded block: queries at 0.. seeing its one key at 0
        f["clen"], f["bend"] = np.zeros(Nb, np.int64), np.ones(Nb, np.int64)
        f["drafts"] = np.zeros(sh.drafts, np.int64)
        f["to_pad"], f["from_pad"] = np.zeros(Nb * Lb, np.int64), np.zeros(sh.rows, np.int64)
        ring_pages = np.zeros((Nb, sh.ring // page), np.int64)
        full_pages = np.zeros((Nb, sh.full // page), np.int64)
        for kind, rows in scratch.items():
            f[f"tab_{kind}"], f[f"blk_{kind}"] = rows.copy(), np.zeros(sh.rows, np.int64)
        at = 0
        for b, ((c, ids), n, C, o) in enumerate(zip(blocks, sizes, clens, self.offsets)):
            width = n if sh.ragged else Lb  # this block's rows in the row-wise layout
            f["ids"][o : o + n] = ids
            f["pos"][o : o + width] = C + lanes[:width]
            # a padded lane asks what the block's last row asks: it sees keys
            f["qpos"][b * Lb : (b + 1) * Lb] = C + np.minimum(lanes, n - 1)
            f["clen"][b], f["bend"][b] = C, C + n
            f["drafts"][at : at + n - 1] = o + np.arange(1, n)
            at += n - 1
            if sh.ragged:
                f["to_pad"][b * Lb : (b + 1) * Lb] = o + np.minimum(lanes, n - 1)
                f["from_pad"][o : o + n] = b * Lb + lanes[:n]
            for kind in scratch:
                f[f"blk_{kind}"][o : o + width] = f[f"tab_{kind}"][b * Lb : b * Lb + width]
            if sh.ring:
                ring_pages[b] = c.ring_pages
            if sh.full:
                held = c.full_pages[: sh.full // page]
                full_pages[b, : len(held)] = held
        f["ring_pages"], f["full_pages"] = ring_pages.reshape(-1), full_pages.reshape(-1)


class PooledAttention:
    """Per layer: every block row's K/V into its scratch row, then one attention call over every block through the
    tables: the Triton decode-attention kernel where the layer's rule fits it, else a gather and SDPA."""

    def __init__(self, pool, shape: Shape, f: dict, kernel: bool = False):
        self.pool, self.shape, self.f, self.kernel = pool, shape, f, kernel
        self.groups: dict[tuple, tuple] = {}

    def takes_kernel(self, spec) -> bool:
        """The kernel's rule is causal with a window behind the query; a block that attends non-causally
        is its queries all at the block's last position, which a window would shift."""
        return self.kernel and (spec.is_causal or spec.window is None)

    def _group(self, kind: str, spec) -> tuple:
        """(write rows, table, key positions, the kernel's query positions or None, SDPA's mask or None) of
        a layer kind and attention rule, made once per step on the device."""
        key = (kind, spec.is_causal, spec.window)
        if key in self.groups:
            return self.groups[key]
        sh, f, P = self.shape, self.f, self.pool.page
        N, L = sh.sessions, sh.block
        S = sh.ring if kind == "ring" else sh.full
        iota = torch.arange(max(S, L), device=f["clen"].device)
        clen = f["clen"][:, None]
        table = (f[f"{kind}_pages"].view(N, S // P)[:, :, None] * P + iota[:P]).view(N, S)
        if kind == "ring":  # slot s holds the newest position p <= clen - 1 with p = s (mod S); p < 0: none
            kpos = (clen - 1) - torch.remainder(clen - 1 - iota[None, :S], S)
        else:
            kpos = torch.where(iota[None, :S] < clen, iota[None, :S], -1)
        bpos = clen + iota[None, :L]
        bpos = torch.where(bpos < f["bend"][:, None], bpos, -1)  # a padded lane is never a key
        table = torch.cat([table, f[f"tab_{kind}"].view(N, L)], dim=1)
        kpos = torch.cat([kpos, bpos], dim=1)
        qpos = f["qpos"].view(N, L)
        if self.takes_kernel(spec):
            if not spec.is_causal:  # every key up to the block's end: the queries at its last position
                qpos = (f["bend"] - 1)[:, None].expand(N, L).contiguous()
            g = (f[f"blk_{kind}"], table, kpos, qpos, None)
        else:
            k, q = kpos[:, None, :], qpos[:, :, None]
            mask = k >= 0
            if spec.is_causal:
                mask = mask & (k <= q)
            if spec.window is not None:
                mask = mask & ((q - k).abs() < spec.window)
            g = (f[f"blk_{kind}"], table, kpos, None, mask[:, None])  # [blocks, 1, lanes, slots]: every head alike
        self.groups[key] = g
        return g

    def __call__(self, i: int, spec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kind = "ring" if self.pool.kinds[i] == SLIDING else "full"
        write, table, kpos, qpos, mask = self._group(kind, spec)
        pages = self.pool.of(i)
        pages.write(i, write, k[0], v[0])
        sh, f = self.shape, self.f
        N, L = sh.sessions, sh.block
        H, D = q.shape[1], q.shape[3]
        rows = q[0].transpose(0, 1)  # [rows, heads, hd]
        rows = (rows[f["to_pad"]] if sh.ragged else rows).reshape(N, L, H, D)
        if qpos is not None:
            from kakeya.backends.torch.kernels import attention as kernel

            out = kernel.decode_attention(
                rows, pages.keys[i][0], pages.values[i][0], table, kpos, qpos, window=spec.window or 0, scale=spec.scale
            )
        else:
            keys, values = (t.transpose(0, 1) for t in pages.gather(i, table))  # [blocks, n_kv, slots, hd]
            out = sdpa(rows.transpose(1, 2), keys, values, mask, spec.scale).transpose(1, 2)
        out = out.reshape(N * L, H, D)
        return (out[f["from_pad"]] if sh.ragged else out).transpose(0, 1)[None]


def draft_step(model, shape: Shape, packed: torch.Tensor, aux: torch.Tensor | None):
    """Device work of one step: ``(greedy tokens [drafts], logits [drafts, vocab])`` (None, None for an
    extension alone); writes only the pools."""
    pool = model.pool
    f = unpack(packed, shape.fields(pool.page))
    if shape.ext:
        cos, sin = rope_from_positions(model.inv_freq, f["ext_pos"], model.dtype, model.rope_scale)
        for i, (k, v) in enumerate(model.layers_kv(model.context_rows(aux), cos, sin)):
            rows = f["ext_ring"] if pool.kinds[i] == SLIDING else f["ext_full"]
            pool.of(i).write(i, rows, k[0], v[0])
    if not shape.block:
        return None, None
    cos, sin = rope_from_positions(model.inv_freq, f["pos"], model.dtype, model.rope_scale)
    x = model.embed_block(f["ids"])
    attention = PooledAttention(pool, shape, f, model.attention_kernel)
    if model.convolves:  # DFlash2 (``dflash2.py``): its layers and selector need each row's lane in its block
        rows = f["from_pad"] if shape.ragged else torch.arange(shape.rows, device=f["pos"].device)
        lanes = f["pos"] - f["clen"][rows // shape.block]
        with sdpa_backends():
            x = model.run_layers(x, cos, sin, attention, lanes)
        h = model.norm(x[0]).index_select(0, f["drafts"])
        return model.select(h, f["ids"], f["drafts"], lanes, shape.block - 1)
    with sdpa_backends():
        for i, layer in enumerate(model.layers):
            q, k, v = layer.project(x, cos, sin)
            x = layer.finish(x, attention(i, layer.self_attn.spec, q, k, v))
    logits = model.compute_logits(model.norm(x[0]).index_select(0, f["drafts"]))
    return torch.argmax(logits, dim=-1), logits


class DraftSteps:
    """A model's steps: with ``static_extent`` one per :class:`Shape`, kept (captured on CUDA) with its
    static inputs; eagerly one per call."""

    def __init__(self, model, options, graph_pool=None):
        self.model, self.options = model, options
        self.graphs = StepGraphs(options, graph_pool)
        self.aux: dict[Shape, torch.Tensor] = {}  # shape -> its static aux input
        self.generation: tuple | None = None

    def __call__(self, batch: Batch, aux: torch.Tensor | None, static: bool):
        model, sh = self.model, batch.shape
        if not static:
            return eager_step(lambda packed: draft_step(model, sh, packed, aux), batch.packed, model.device)
        if sh.generation != self.generation:  # a pool grew: every kept step reads stale tensors
            self.graphs.invalidate()
            self.aux.clear()
            self.generation = sh.generation
        if sh not in self.aux:
            self.aux[sh] = torch.zeros((sh.ext, model.config.aux_width), dtype=model.dtype, device=model.device)
        static_aux = self.aux[sh]
        device = self.graphs.stage(sh, batch.packed, model.device, syncs=bool(sh.block))
        if aux is not None:
            static_aux[: aux.shape[0]].copy_(aux)  # the rest are padded rows, written to the trash row
        return self.graphs.get(sh, lambda key: (lambda: draft_step(model, key, device, static_aux), ()))


def _aux(extensions) -> torch.Tensor | None:
    auxs = [a for _, a in extensions if a.shape[0]]
    return None if not auxs else auxs[0] if len(auxs) == 1 else torch.cat(auxs)


@torch.inference_mode()  # the pools are inference tensors: written in that mode only
def run(model, extensions: Sequence[tuple], blocks: Sequence[tuple], greedy: bool, keep_logits: bool):
    """Extend each ``(cache, aux)``, then draft every ``(cache, block ids)``: ``(tokens, logits)`` of the
    blocks' drafted rows in order (rows 1.. of each block): the greedy tokens when ``greedy`` (one host sync
    for all), the logits rows when ``keep_logits`` (copied out of a captured step's static output)."""
    static = model.graph_options.static_extent
    if not blocks and not any(a.shape[0] for _, a in extensions):
        return None, None  # nothing to extend, nothing to draft
    with model.pool.stepping():
        if static and any(a.shape[0] > MAX_BLOCK_SIZE for _, a in extensions):  # a prompt: eagerly, first
            long = [(c, a) for c, a in extensions if a.shape[0] > MAX_BLOCK_SIZE]
            model.steps(Batch(model.pool, long, [], False), _aux(long), False)()
            extensions = [(c, a) for c, a in extensions if a.shape[0] <= MAX_BLOCK_SIZE]
        batch = Batch(model.pool, extensions, blocks, static)
        step = model.steps(batch, _aux(extensions), static)
        picked, logits = step()
        if not blocks:
            return None, None
        tokens = picked.tolist()[: batch.real] if greedy else None  # the one host sync
        if not keep_logits:
            return tokens, None
        logits = logits[: batch.real]
        return tokens, logits.clone() if step.captured else logits
