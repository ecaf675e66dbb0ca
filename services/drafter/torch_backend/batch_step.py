"""The torch drafter's draft step over pooled context K/V: any number of sessions' extensions and blocks in
one step whose device work does not grow with the number of sessions.

A step takes context extensions (a session's cache and its new aux rows) and blocks (a cache and the
block's token ids; several blocks of one cache are a pre-draft's) over caches that are pages of one
model's pools (``pool.py``), and runs:

* the extension: ``fc``, ``hidden_norm`` and every layer's K/V projection once over all sessions' new
  aux rows (RoPE from a tensor of positions), then per layer ONE ``index_copy_`` of K and of V into the
  rows the host planned (ring slots, full-attention pages; rows a ring will not keep go to the trash);
* the block: every row-wise op (embedding, norms, projections, RoPE at each row's position, MLP, LM head)
  once over all rows; per layer ONE write of every row's K/V into scratch rows of the pools and ONE
  attention call over every block, K/V read through a padded ``[blocks, context slots + block lanes]``
  table with masks built on the device from positions (each slot's position, each block's context
  length and end, the layer's causality and window); eagerly a gather and SDPA;
* the greedy tokens of every drafted row in one argmax, read back in ONE host sync.

The host plans (pages reserved, rows chosen) and packs every integer input into one vector copied to
the device once. Shapes depend only on :class:`Shape`; with ``static_extent`` (CUDA) blocks are padded
up to a sessions bucket, lanes to a block bucket, extension rows to ``sessions * bucket``, the full
context to a doubling extent, so ``StepGraphs`` captures one graph per shape for any set of sessions.
Padded rows write the trash row or unused scratch rows and see one real key (a softmax over none is
NaN); their outputs are dropped. Eagerly (the CPU) sizes are exact and the row-wise ops see the blocks'
rows unpadded (``ragged``): only attention lays them out ``[blocks, lanes]``, one index op each way.

An extension longer than a block (a prompt) runs first as an eager step of its own when graphs are on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kakeya.backends.torch.graphs import BUCKETS, GraphedStep, StepGraphs, bucket_for, unpack
from kakeya.backends.torch.ops import rope_from_positions, sdpa, sdpa_backends
from kakeya.core.contract import SLIDING
from kakeya.core.request import MAX_BLOCK_SIZE

SESSION_BUCKETS = (1, 2, 4, 8, 16)  # blocks a captured step has (beyond 16: multiples of 16)
LANE_BUCKETS = BUCKETS + (2 * MAX_BLOCK_SIZE,)  # a pre-draft's block: its pending candidates, then a block
MIN_EXTENT = 256  # full-attention positions a captured step attends over at least (then doubling)


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


def session_bucket(n: int) -> int:
    return next((b for b in SESSION_BUCKETS if b >= n), -(-n // SESSION_BUCKETS[-1]) * SESSION_BUCKETS[-1])


def _up(n: int, page: int) -> int:
    return max(page, -(-n // page) * page)


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
        f: dict[str, np.ndarray] = {}
        # the extensions first: the blocks' context includes them
        ext_pos, ext_ring, ext_full, at = np.zeros(X, np.int64), np.zeros(X, np.int64), np.zeros(X, np.int64), 0
        for c, n in ext:
            ring, full = c.write_rows(c.length, n)
            ext_pos[at : at + n] = np.arange(c.length, c.length + n)
            if ring is not None:
                ext_ring[at : at + n] = ring
            if full is not None:
                ext_full[at : at + n] = full
            c.length += n
            at += n
        f.update(ext_pos=ext_pos, ext_ring=ext_ring, ext_full=ext_full)
        clens = [c.length for c, _ in blocks]
        S_full = 0
        if pool.full is not None and N:
            if static:
                S_full = MIN_EXTENT
                while S_full < max(clens):
                    S_full *= 2
            S_full = _up(max(S_full, *clens), page)
        scratch = {  # taken (the pools may grow) before the generations are read
            kind: p.scratch(Nb * Lb) for kind, p in (("ring", pool.sliding), ("full", pool.full)) if p is not None
        }
        gens = tuple(p.generation if p is not None else 0 for p in (pool.sliding, pool.full))
        S_full = S_full or (page if pool.full is not None else 0)  # (an extension alone: no table, but its rows)
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
            table = rows.copy()
            f[f"tab_{kind}"] = table
            f[f"blk_{kind}"] = np.zeros(sh.rows, np.int64)
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
                ring_full = c.full_pages[: sh.full // page]
                full_pages[b, : len(ring_full)] = ring_full
        f["ring_pages"], f["full_pages"] = ring_pages.reshape(-1), full_pages.reshape(-1)


class PooledAttention:
    """Per layer: every block row's K/V into its scratch row, then one attention call over every block,
    its context read through the tables: the Triton decode-attention kernel (``kernel``: it reads the
    pool through the table itself) where the layer's rule fits it, else a gather and SDPA."""

    def __init__(self, pool, shape: Shape, f: dict, kernel: bool = False):
        self.pool, self.shape, self.f, self.kernel = pool, shape, f, kernel
        self.groups: dict[tuple, tuple] = {}

    def takes_kernel(self, spec) -> bool:
        """The kernel's rule is causal with a window behind the query; a block that attends non-causally
        is its queries all at the block's last position, which a window would shift."""
        return self.kernel and (spec.is_causal or spec.window is None)

    def _group(self, kind: str, spec) -> tuple:
        """(write rows, table, key positions, query positions, mask) of a layer kind and attention rule,
        made once per step on the device (query positions as the kernel takes them, or None; the mask
        only where SDPA runs)."""
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
        if qpos is not None:
            from kakeya.backends.torch.kernels import attention as kernel

            rows = q[0].transpose(0, 1)  # [rows, heads, hd]
            if sh.ragged:
                rows = rows[f["to_pad"]]
            out = kernel.decode_attention(
                rows.reshape(N, L, H, D), pages.keys[i][0], pages.values[i][0], table, kpos, qpos,
                window=spec.window or 0, scale=spec.scale,
            ).view(N * L, H, D)  # fmt: skip
            if sh.ragged:
                out = out[f["from_pad"]]
            return out.transpose(0, 1)[None]
        keys, values = pages.gather(i, table)  # [n_kv, blocks, slots, hd]
        qq = q[0]  # [heads, rows, hd]
        if sh.ragged:
            qq = qq[:, f["to_pad"]]
        qq = qq.reshape(H, N, L, D).transpose(0, 1)
        out = sdpa(qq, keys.transpose(0, 1), values.transpose(0, 1), mask, spec.scale)  # [blocks, heads, lanes, hd]
        out = out.transpose(0, 1).reshape(H, N * L, D)
        if sh.ragged:
            out = out[:, f["from_pad"]]
        return out[None]


def draft_step(model, shape: Shape, packed: torch.Tensor, aux: torch.Tensor | None):
    """Device work of one step: ``(greedy tokens [drafts], logits [drafts, vocab])`` (None, None for an
    extension alone); reads ``packed``, ``aux`` and the pools, writes only the pools."""
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
    static inputs; eagerly one made per call around the packed vector itself."""

    def __init__(self, model, options, graph_pool=None):
        self.model, self.options = model, options
        self.graphs = StepGraphs(options, graph_pool)
        self.inputs: dict[Shape, tuple] = {}  # shape -> (device input, pinned staging, its numpy view, aux)
        self.generation: tuple | None = None
        # A step that drafts nothing ends with no host sync, so its copy out of the pinned staging may still
        # be pending when the next step of that shape rewrites it: such a step leaves an event to wait on.
        self.unsynced: dict[Shape, torch.cuda.Event] = {}

    def __call__(self, batch: Batch, aux: torch.Tensor | None, static: bool) -> GraphedStep:
        model, sh = self.model, batch.shape
        if not static:
            packed = torch.from_numpy(batch.packed)
            if model.device.type != "cpu":
                packed = packed.pin_memory().to(model.device, non_blocking=True)
            return GraphedStep(lambda: draft_step(model, sh, packed, aux), (), capture=False)
        if sh.generation != self.generation:  # a pool grew: every kept step reads stale tensors
            self.graphs.invalidate()
            self.inputs.clear()
            self.unsynced.clear()
            self.generation = sh.generation
        if sh not in self.inputs:
            pin = model.device.type == "cuda"
            staging = torch.zeros(len(batch.packed), dtype=torch.long, pin_memory=pin)
            device = torch.zeros(len(batch.packed), dtype=torch.long, device=model.device)
            static_aux = torch.zeros((sh.ext, model.config.aux_width), dtype=model.dtype, device=model.device)
            self.inputs[sh] = (device, staging, staging.numpy(), static_aux)
        device, staging, view, static_aux = self.inputs[sh]
        pending = self.unsynced.pop(sh, None)
        if pending is not None:
            pending.synchronize()
        view[:] = batch.packed
        device.copy_(staging, non_blocking=True)
        if aux is not None:
            static_aux[: aux.shape[0]].copy_(aux)  # the rest are padded rows, written to the trash row
        if not sh.block and model.device.type == "cuda":
            self.unsynced[sh] = torch.cuda.Event()
            self.unsynced[sh].record()
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
