"""One K/V pool per layer kind of a torch target: every session's caches are pages of it, read through tables.

A session (:class:`PooledCaches`) holds its sliding rings as pages taken when it opens (its ``RingLayout`` stays the one
position counter, so rollback stays exact) and its full-attention K/V as pages taken as the context grows. Growth
happens only between steps (:meth:`KVPool.stepping`) and bumps ``generation``, which keys captured CUDA graphs.
Quantized full K/V (``full_kv_bits``, ``mx.quantize``'s rule) live in a pool of their own; sliding rings stay exact.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager

import numpy as np
import torch

from kakeya.backends.torch.pages import CHUNK_PAGES, PAGE, PagePool, Storage, give_back, page_rows
from kakeya.core.contract import SLIDING
from kakeya.verifier.backend import SessionCaches
from kakeya.verifier.layout import ForwardPlan, RingLayout


def quantize(x: torch.Tensor, group_size: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Affine per-group quantization of the last dim, ``mx.quantize``'s rule: ``(codes, scales, biases)``, codes
    uint8 ``[..., D * bits / 8]``, scales/biases ``[..., D / group_size]`` in ``x.dtype``, ``x ~= code * scale +
    bias``; the larger-magnitude end of each group's range is exact, as in MLX."""
    *lead, D = x.shape
    if D % group_size:
        raise ValueError(f"head dim {D} is not a multiple of the quantization group size {group_size}")
    g = x.float().reshape(*lead, D // group_size, group_size)
    n_bins = 2**bits - 1
    w_max, w_min = g.amax(-1, keepdim=True), g.amin(-1, keepdim=True)
    neg = w_min.abs() > w_max.abs()
    scales = torch.clamp((w_max - w_min) / n_bins, min=1e-7)
    scales = torch.where(neg, scales, -scales)
    edge = torch.where(neg, w_min, w_max)
    q0 = torch.round(edge / scales)
    scales = torch.where(q0 != 0, edge / q0, scales)
    biases = torch.where(q0 == 0, torch.zeros_like(edge), edge)
    codes = torch.clamp(torch.round((g - biases) / scales), 0, n_bins).to(torch.uint8).reshape(*lead, D)
    if bits == 4:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return codes, scales.squeeze(-1).to(x.dtype), biases.squeeze(-1).to(x.dtype)


def dequantize(codes, scales, biases, group_size: int, bits: int, dtype: torch.dtype) -> torch.Tensor:
    if bits == 4:
        codes = torch.stack([codes & 15, codes >> 4], dim=-1).flatten(-2)
    *lead, D = codes.shape
    g = codes.float().reshape(*lead, D // group_size, group_size)
    out = g * scales.float().unsqueeze(-1) + biases.float().unsqueeze(-1)
    return out.reshape(*lead, D).to(dtype)


class QuantizedStorage(Storage):
    """Affine-quantized rows (4 or 8 bits per element, a scale and a bias per ``group`` of the head dim)."""

    def __init__(self, bits: int, group: int):
        if bits not in (4, 8):
            raise ValueError(f"cache_policy.full_kv_bits must be 4 or 8, got {bits}")
        self.bits, self.group = bits, group
        self.key = (bits, group)

    def widths(self, head_dim, dtype):  # codes, scales, biases
        return [(head_dim * self.bits // 8, torch.uint8)] + [(head_dim // self.group, dtype)] * 2

    def parts(self, x):
        return list(quantize(x, self.group, self.bits))

    def load(self, parts, dtype):
        return dequantize(*parts, self.group, self.bits, dtype)


class KVPool:
    """A target's pools: the sliding one (exact, every policy) and one full pool per storage."""

    def __init__(self, args, device, dtype, page: int = PAGE, chunk: int = CHUNK_PAGES):
        self.args, self.device, self.dtype, self.page, self.chunk = args, device, dtype, page, chunk
        kinds = list(args.layer_types[: args.n_cached])
        self.sliding_layers = [i for i, t in enumerate(kinds) if t == SLIDING]
        self.full_layers = [i for i, t in enumerate(kinds) if t != SLIDING]
        self.sliding = self._pool(self.sliding_layers) if self.sliding_layers else None
        self.fulls: dict[tuple, PagePool] = {}
        self.lock = threading.RLock()

    def _pool(self, layers: list[int], storage=None) -> PagePool:
        shapes = {i: (self.args.kv_heads_of(i), self.args.head_dim_of(i)) for i in layers}
        stores = {i: storage(i) for i in layers} if storage else None
        return PagePool(shapes, self.device, self.dtype, self.page, self.chunk, stores)

    def full(self, bits: int = 0, group: int = 64) -> PagePool | None:
        """The full pool of one storage (made on first use; None: the model has no full layers)."""
        if not self.full_layers:
            return None
        key = (bits, group) if bits else ()
        with self.lock:
            if key not in self.fulls:
                args = self.args
                storage = (lambda i: QuantizedStorage(bits, min(group, args.head_dim_of(i)))) if bits else None
                self.fulls[key] = self._pool(self.full_layers, storage)
            return self.fulls[key]

    @contextmanager
    def stepping(self):
        """Held by a running step: no pool grows under it (a growth waits for the step to end)."""
        pools = [p for p in [self.sliding, *self.fulls.values()] if p is not None]
        for p in pools:
            p.lock.acquire()
        try:
            yield
        finally:
            for p in reversed(pools):
                p.lock.release()


def runs_of(plan: ForwardPlan) -> tuple[np.ndarray, np.ndarray]:
    """A ring plan's writes as (slot, row of the forward) per written position."""
    if not plan.writes:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    slots = np.concatenate([np.arange(w.dst, w.dst + w.length) for w in plan.writes])
    src = np.concatenate([np.arange(w.src, w.src + w.length) for w in plan.writes])
    return slots, src


class PooledCaches(SessionCaches):
    """A session's caches as pages of its target's pools (``layers``: per cached layer, a view that a
    dynamic forward writes and fetches through, ``PooledRing`` / ``PooledFull``)."""

    pooled = True

    def __init__(self, pool: KVPool, layout: RingLayout, bits: int = 0, group: int = 64):
        kinds = list(pool.args.layer_types[: pool.args.n_cached])
        me = weakref.proxy(self)  # no reference cycle: a dropped session's pages come back at once
        layers = [PooledRing(me, i) if t == SLIDING else PooledFull(me, i) for i, t in enumerate(kinds)]
        super().__init__(layers, kinds)
        self.pool = pool
        self.sliding, self.full = pool.sliding, pool.full(bits, group)
        self.page = pool.page
        self.sink, self.window, self.capacity = layout.sink, layout.window, layout.capacity
        self.batch_key = ("pool", bits, group) if bits else ("pool",)  # sessions of one full pool batch together
        self.ring_pages = self.sliding.take(-(-self.capacity // self.page)) if self.sliding is not None else []
        self.full_pages: list[int] = []
        self.last_logits: torch.Tensor | None = None  # the latest greedy step's logits rows (tests read them)
        self._plan_rows: tuple | None = None  # (plan, device write indices) of the dynamic forward running
        self._release = weakref.finalize(
            self, give_back, [(self.sliding, self.ring_pages), (self.full, self.full_pages)]
        )

    def ring_rows(self) -> np.ndarray:
        """Pool row of every ring slot, in slot order."""
        return page_rows(self.ring_pages, self.page)[: self.capacity]

    def full_rows(self, lo: int, hi: int) -> np.ndarray:
        """Pool rows of full-attention positions ``lo .. hi`` (pages reserved)."""
        if self.full is None:
            return np.zeros(0, np.int64)
        return self.full.position_rows(self.full_pages, lo, hi)

    def reserve(self, positions: int) -> None:
        """Pages for ``positions`` full-attention positions (taken before a step, never during one)."""
        if self.full is not None:
            self.full.hold(self.full_pages, positions)

    def release(self) -> None:
        """Every page back to its pool (the session is closed); idempotent."""
        self._release()

    def kv_bytes(self) -> dict:
        """The ring's slots (``verifier/memory.py``'s figure; the pool's stats count its last page's spare
        rows too) and the full layers' pages."""
        s = self.capacity * self.sliding.row_bytes if self.sliding is not None else 0
        f = len(self.full_pages) * self.page * self.full.row_bytes if self.full is not None else 0
        return {"sliding": s, "full": f}

    def arrays(self) -> list:
        return []  # the session owns no tensor: its rows live in the pools

    # -- prefix snapshots (``verifier/snapshot.py``): the same arrays a per-session cache keeps ------

    def copy(self, positions: int, copy=None) -> list[list]:
        """Per layer, its stored tensors ``[1, heads, n, width]``: a ring's every slot, a full layer's first
        ``positions`` (copies: gathered rows)."""
        return [[t[:, rows][None] for t in pool.keys[i] + pool.values[i]] for i, pool, rows in self._layers(positions)]

    def load(self, saved: list[list], positions: int) -> None:
        """A snapshot's tensors (:meth:`copy`) into this session's rows (its full pages reserved first)."""
        self.reserve(positions)
        for (i, pool, rows), arrays in zip(self._layers(positions), saved):
            for dst, src in zip(pool.keys[i] + pool.values[i], arrays):
                dst.index_copy_(1, rows, src[0].to(dst.dtype))

    def _layers(self, positions: int):
        """Per cached layer: its index, its pool and the rows of its slots (a ring's all, a full layer's first
        ``positions``) on the device."""
        dev = self.pool.device
        ring = torch.from_numpy(self.ring_rows()).to(dev)
        full = torch.from_numpy(self.full_rows(0, positions)).to(dev)
        return [(i, *((self.sliding, ring) if k == SLIDING else (self.full, full))) for i, k in enumerate(self.kinds)]

    def plan_rows(self, plan: ForwardPlan) -> tuple:
        """(ring rows written, the forward rows written there, full rows written, full rows attended) on
        the device for the dynamic forward of ``plan``."""
        if self._plan_rows is None or self._plan_rows[0] is not plan:
            dev = self.pool.device
            slots, src = runs_of(plan)
            ring = self.ring_rows()
            end = plan.start + plan.n_new
            self.reserve(end)
            full = self.full_rows(0, end)
            t = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(dev)
            self._plan_rows = (plan, t(ring[slots]), t(src), t(ring[: plan.used]), t(full[plan.start :]), t(full))
        return self._plan_rows[1:]


class _PooledLayer:
    """One layer of a session whose K/V live in the pools: it holds no arrays of its own."""

    def __init__(self, caches: PooledCaches, i: int):
        self.caches, self.i = caches, i


class PooledRing(_PooledLayer):
    """One sliding layer of a session, as its dynamic forward sees it (``SegmentAttention``): the ring's
    slots are rows of the sliding pool; ``plan.in_place``: write first, then read ``slots[:used]``,
    else read ``slots[:used]`` ++ the new rows, then write (what MLX's ``RingKVCache`` does)."""

    def fetch(self, keys: torch.Tensor, values: torch.Tensor, plan: ForwardPlan):
        c, i = self.caches, self.i
        rows, src, attended, _, _ = c.plan_rows(plan)
        if plan.in_place:
            c.sliding.write(i, rows, keys[0][:, src], values[0][:, src])
            k, v = c.sliding.gather(i, attended)
            return k[None], v[None]
        k, v = c.sliding.gather(i, attended)
        k, v = torch.cat([k[None], keys], dim=2), torch.cat([v[None], values], dim=2)
        c.sliding.write(i, rows, keys[0][:, src], values[0][:, src])
        return k, v


class PooledFull(_PooledLayer):
    """One full-attention layer of a session, as its dynamic forward sees it: positions ``start ..``
    written into its pages, positions ``0 .. end`` read back."""

    def fetch(self, keys: torch.Tensor, values: torch.Tensor, plan: ForwardPlan):
        c, i = self.caches, self.i
        _, _, _, written, attended = c.plan_rows(plan)
        c.full.write(i, written, keys[0], values[0])
        k, v = c.full.gather(i, attended)
        return k[None], v[None]
