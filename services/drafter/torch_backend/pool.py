"""The torch drafter's context K/V: one pool per layer kind of a model, every session's context pages of it.

The verifier's pool design (``verifier/torch_backend/pool.py``) without rollback, since a drafter's context
only grows. A session (:class:`PooledContext`) holds its full-attention context as pages taken as it grows
and its sliding context as a ring of ``ring >= sliding_window - 1`` slots (position ``p`` in slot
``p % ring``, so a long context never moves a row). A batched step writes each block's own K/V into
*scratch* rows (:meth:`PagePool.scratch`), never a session's pages, so several blocks of one session run
in one step and the context holds committed positions only. Page 0 is never handed out.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager

import numpy as np
import torch

from kakeya.backends.torch.pages import CHUNK_PAGES, PAGE, TRASH_PAGE, PagePool, Storage, page_rows
from kakeya.core.contract import SLIDING
from kakeya.drafter.context import ContextSnapshot


class DraftPool:
    """A drafter model's pools: ``sliding`` (rings) and ``full`` (pages by position), None where no layer
    is of that kind; ``ring``: slots of a session's ring (a whole number of pages)."""

    def __init__(self, config, device, dtype, page: int = PAGE, chunk: int = CHUNK_PAGES):
        self.config, self.device, self.dtype, self.page = config, device, dtype, page
        self.kinds = list(config.layer_types)
        a = config.layer_attention(0)  # every layer's K/V rows have the same shape
        sliding = [i for i, t in enumerate(self.kinds) if t == SLIDING]
        full = [i for i, t in enumerate(self.kinds) if t != SLIDING]
        make = lambda layers: (
            PagePool(
                {i: (a.n_kv, a.head_dim) for i in layers}, {i: Storage() for i in layers}, device, dtype, page, chunk
            )
            if layers
            else None
        )
        self.sliding, self.full = make(sliding), make(full)
        self.keep = int(config.sliding_window) - 1 if sliding else 0  # the context rows a window shows
        self.ring = max(page, -(-self.keep // page) * page) if sliding else 0
        self.lock = threading.RLock()

    def of(self, i: int) -> PagePool:
        """Layer ``i``'s pool."""
        return self.sliding if self.kinds[i] == SLIDING else self.full

    @contextmanager
    def stepping(self):
        """Held while pages are planned and a step runs: one step of a model at a time, no growth under it."""
        with self.lock:
            yield

    def stats(self) -> dict:
        """Pages per pool (``PagePool.stats``)."""
        return {name: p.stats() for name, p in (("sliding", self.sliding), ("full", self.full)) if p is not None}


def _release(pool: DraftPool, ring: list, full: list) -> None:
    with pool.lock:
        if ring:
            pool.sliding.give(ring)
            ring.clear()
        if full:
            pool.full.give(full)
            full.clear()


class PooledContext:
    """One session's context K/V as pages of its model's pools (the torch ``ContextKVCache``)."""

    def __init__(self, pool: DraftPool):
        self.pool = pool
        self.length = 0  # context positions written (absolute)
        with pool.lock:
            self.ring_pages = pool.sliding.take(pool.ring // pool.page) if pool.sliding is not None else []
        self.full_pages: list[int] = []
        self._release = weakref.finalize(self, _release, pool, self.ring_pages, self.full_pages)

    # -- rows ------------------------------------------------------------------------------------

    def reserve(self, positions: int) -> None:
        """Full pages for ``positions`` positions (taken before a step, never during one)."""
        if self.pool.full is None:
            return
        need = -(-positions // self.pool.page) - len(self.full_pages)
        if need > 0:
            with self.pool.lock:
                self.full_pages.extend(self.pool.full.take(need))

    def ring_rows(self) -> np.ndarray:
        """Pool row of every ring slot, in slot order."""
        return page_rows(self.ring_pages, self.pool.page)

    def full_rows(self, lo: int, hi: int) -> np.ndarray:
        """Pool rows of full-attention positions ``lo .. hi`` (pages reserved)."""
        p = np.arange(lo, hi)
        return np.asarray(self.full_pages, dtype=np.int64)[p // self.pool.page] * self.pool.page + p % self.pool.page

    def write_rows(self, start: int, n: int) -> tuple[np.ndarray | None, np.ndarray | None]:
        """(ring rows, full rows) where positions ``start .. start+n`` go; a position the ring will not
        hold once they are all written (older than its newest ``ring``) goes to the trash row."""
        pool = self.pool
        ring = full = None
        if pool.sliding is not None:
            p = np.arange(start, start + n)
            ring = np.where(p >= start + n - pool.ring, self.ring_rows()[p % pool.ring], TRASH_PAGE * pool.page)
        if pool.full is not None:
            self.reserve(start + n)
            full = self.full_rows(start, start + n)
        return ring, full

    # -- eager writes and reads (a snapshot, a restore, ``drafter.backend.extend``) ----------------------

    @torch.inference_mode()  # the pools are inference tensors: written in that mode only
    def append(self, kv: list) -> None:
        """``kv``: one ``(keys, values)`` pair per layer, each ``[1, n_kv, n_new, head_dim]``."""
        if len(kv) != len(self.pool.kinds):
            raise ValueError(f"expected K/V for {len(self.pool.kinds)} layers, got {len(kv)}")
        self._write(self.length, kv)
        self.length += kv[0][0].shape[2]

    def _write(self, start: int, kv: list) -> None:
        with self.pool.lock:
            ring, full = self.write_rows(start, kv[0][0].shape[2])
            dev = self.pool.device
            rows = {
                SLIDING: None if ring is None else torch.from_numpy(ring).to(dev),
                "full": None if full is None else torch.from_numpy(full).to(dev),
            }
            for i, (k, v) in enumerate(kv):
                kind = SLIDING if self.pool.kinds[i] == SLIDING else "full"
                self.pool.of(i).write(i, rows[kind], k[0], v[0])

    def visible_positions(self, i: int) -> tuple[int, int]:
        """The positions layer ``i``'s attention shows a block: the last ``keep`` on a sliding layer."""
        if self.pool.kinds[i] == SLIDING:
            return max(0, self.length - self.pool.keep), self.length
        return 0, self.length

    def view(self, i: int):
        """Layer ``i``'s visible context K/V ``[1, n_kv, n, head_dim]`` (copies; None, None when empty)."""
        lo, hi = self.visible_positions(i)
        if hi == lo:
            return None, None
        pool = self.pool
        if pool.kinds[i] == SLIDING:
            rows = self.ring_rows()[np.arange(lo, hi) % pool.ring]
        else:
            rows = self.full_rows(lo, hi)
        k, v = pool.of(i).gather(i, torch.from_numpy(rows).to(pool.device))
        return k[None], v[None]

    @property
    def nbytes(self) -> int:
        pool, n = self.pool, 0
        if pool.sliding is not None:
            n += len(self.ring_pages) * pool.page * pool.sliding.row_bytes
        if pool.full is not None:
            n += len(self.full_pages) * pool.page * pool.full.row_bytes
        return n

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
            pages = (
                len(self.full_pages)
                if new_rows is None
                else max(len(self.full_pages), -(-(self.length + new_rows) // pool.page))
            )
            rows += len(pool.full.shapes) * pages * pool.page
        return rows

    @torch.inference_mode()
    def snapshot(self) -> ContextSnapshot:
        """What this cache shows now (per layer its visible rows, copied): a prefix snapshot."""
        kv = [self.view(i) for i in range(len(self.pool.kinds))]
        nbytes = sum(k.nbytes + v.nbytes for k, v in kv if k is not None)
        kinds = list(dict.fromkeys(self.pool.kinds))  # one row count per layer kind, as context.py's layouts
        rows = [
            next(k.shape[2] if k is not None else 0 for (k, _), t in zip(kv, self.pool.kinds) if t == kind)
            for kind in kinds
        ]
        return ContextSnapshot(self.length, rows, kv, nbytes)

    @torch.inference_mode()
    def restore(self, snap: ContextSnapshot, back: int = 0) -> None:
        """An empty cache set to ``snap``'s rows, less its newest ``back`` positions (``snap.truncatable`` only)."""
        if self.length:
            raise RuntimeError("only an empty context cache can resume a snapshot")
        if back and not (snap.truncatable and 0 < back < snap.length):
            raise ValueError(f"cannot resume {snap.length} context positions less {back}")
        keep = snap.length - back
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
        with self.pool.lock:
            if self.full_pages:
                self.pool.full.give(self.full_pages)
                self.full_pages.clear()

    def release(self) -> None:
        """Every page back to its pool (idempotent)."""
        self._release()
