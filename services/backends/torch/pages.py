"""Pages of K/V rows: the pool the torch verifier's and drafter's batched steps read through tables.

A :class:`PagePool` holds, per layer of one kind that owns K/V, a K and a V tensor ``[kv_heads, rows, width]`` (the
layout ``kernels/attention.py`` reads), cut into pages of ``page`` rows, handed out lowest first. A pool that runs out
grows by whole chunks (at least doubling); growth moves the tensors but no page's rows, and bumps ``generation`` (a
captured CUDA graph holds the old addresses). Page 0 is never handed out: padded rows write there and padded table
entries read there. A row's storage is its layer's :class:`Storage`; what pages mean (rings, positions) is the caller's.
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Sequence

import numpy as np
import torch

PAGE = 16  # rows per page: a block of up to MAX_BLOCK_SIZE positions spans at most two
CHUNK_PAGES = 64  # the fewest pages a pool grows by
TRASH_PAGE = 0  # never handed out: padded rows write here, padded table entries read here


def page_rows(pages: Sequence[int], page: int) -> np.ndarray:
    """Every row of ``pages``, in order."""
    return (np.asarray(pages, dtype=np.int64)[:, None] * page + np.arange(page)).reshape(-1)


def whole_pages(n: int, page: int) -> int:
    """``n`` rows rounded up to whole pages (at least one page)."""
    return max(page, -(-n // page) * page)


def give_back(held: Sequence[tuple]) -> None:
    """Each ``(pool, pages)``'s pages back to its pool, the list emptied (idempotent: a finalizer)."""
    for pool, pages in held:
        if pages:
            pool.give(pages)
            pages.clear()


class Storage:
    """How one layer's K (or V) rows are stored: exact, in the compute dtype."""

    key: tuple = ()

    def widths(self, head_dim: int, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        """(width, dtype) of each tensor a row is stored as."""
        return [(head_dim, dtype)]

    def parts(self, x: torch.Tensor) -> list[torch.Tensor]:
        """``x`` ``[heads, n, head_dim]`` as the tensors it is stored as."""
        return [x]

    def load(self, parts: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """Stored tensors (gathered rows) back as K or V in ``dtype``."""
        return parts[0]


class PagePool:
    """The rows of one layer kind's K and V, handed out in pages. ``shapes``: layer index -> (kv_heads,
    head_dim); ``storage``: layer index -> :class:`Storage` (None: every layer exact); ``keys[i]`` /
    ``values[i]``: layer ``i``'s stored tensors, each ``[kv_heads, rows, width]``."""

    def __init__(self, shapes: dict, device, dtype, page: int = PAGE, chunk: int = CHUNK_PAGES, storage=None):
        if page < 1 or chunk < 1:
            raise ValueError(f"page and chunk must be >= 1, got {page}, {chunk}")
        self.shapes, self.storage = shapes, storage or {i: Storage() for i in shapes}
        self.device, self.dtype, self.page, self.chunk = device, dtype, page, chunk
        self.keys: dict[int, list[torch.Tensor]] = {i: [] for i in shapes}
        self.values: dict[int, list[torch.Tensor]] = {i: [] for i in shapes}
        self.pages = 0  # pages the tensors hold (page 0 included)
        self.free: list[int] = []  # a heap: the lowest free page is handed out first
        self.scratch_pages: list[int] = []  # a batched step's own rows (:meth:`scratch`), kept for every step
        self.generation = 0  # bumped whenever the tensors are reallocated
        self.growths = 0
        self.lock = threading.RLock()
        self._grow(chunk)

    @property
    def rows(self) -> int:
        return self.pages * self.page

    @property
    def row_bytes(self) -> int:
        """Bytes of K and V of one row over every layer of this pool."""
        return sum(
            2 * h * w * torch.empty((), dtype=dt).element_size()
            for i, (h, d) in self.shapes.items()
            for w, dt in self.storage[i].widths(d, self.dtype)
        )

    @property
    def used_pages(self) -> int:
        return self.pages - 1 - len(self.free)

    def stats(self) -> dict:
        """Its pages: held by sessions, free, their bytes, and how often it grew (what a server exports)."""
        return {
            "pages": self.pages - 1,
            "used_pages": self.used_pages,
            "free_pages": len(self.free),
            "page_rows": self.page,
            "bytes": (self.pages - 1) * self.page * self.row_bytes,
            "growths": self.growths,
        }

    def take(self, n: int) -> list[int]:
        """``n`` pages (grown by whole chunks when too few are free)."""
        with self.lock:
            if n > len(self.free):
                self._grow(n - len(self.free))
            return [heapq.heappop(self.free) for _ in range(n)]

    def hold(self, pages: list[int], positions: int) -> None:
        """``pages`` (one session's, position-ordered) extended to hold ``positions`` positions."""
        need = -(-positions // self.page) - len(pages)
        if need > 0:
            pages.extend(self.take(need))

    def position_rows(self, pages: Sequence[int], lo: int, hi: int) -> np.ndarray:
        """Pool rows of positions ``lo .. hi`` held in order by ``pages``."""
        p = np.arange(lo, hi)
        return np.asarray(pages, dtype=np.int64)[p // self.page] * self.page + p % self.page

    def give(self, pages: Sequence[int]) -> None:
        """Pages a session no longer holds, back for the next one."""
        with self.lock:
            for p in pages:
                heapq.heappush(self.free, p)

    def scratch(self, n: int) -> np.ndarray:
        """Rows of the first ``n`` scratch slots: a batched step's own rows, held by no session (pages taken on
        first need, then kept for every step)."""
        self.hold(self.scratch_pages, n)
        return page_rows(self.scratch_pages, self.page)[:n]

    @torch.inference_mode()  # inference tensors, whichever thread or mode first asks for pages
    def _grow(self, need: int) -> None:
        """At least ``need`` more pages, in whole chunks and at least doubling; every row keeps its index."""
        add = max(need, self.pages - 1)
        add = -(-add // self.chunk) * self.chunk
        old, self.pages = self.pages, self.pages + add + (0 if self.pages else 1)  # the first growth adds page 0
        for i, (heads, dim) in self.shapes.items():
            for store in (self.keys, self.values):
                grown = []
                for j, (w, dt) in enumerate(self.storage[i].widths(dim, self.dtype)):
                    t = torch.zeros((heads, self.rows, w), dtype=dt, device=self.device)
                    if old:
                        t[:, : old * self.page] = store[i][j]
                    grown.append(t)
                store[i] = grown
        for p in range(max(old, TRASH_PAGE + 1), self.pages):
            heapq.heappush(self.free, p)
        self.generation += 1
        self.growths += 1

    def write(self, i: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """``k``/``v`` ``[kv_heads, n, head_dim]`` into ``rows`` [n] (device) of layer ``i``."""
        store = self.storage[i]
        for dst, src in zip(self.keys[i], store.parts(k)):
            dst.index_copy_(1, rows, src)
        for dst, src in zip(self.values[i], store.parts(v)):
            dst.index_copy_(1, rows, src)

    def gather(self, i: int, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s K and V at ``table`` (any shape of row indices): ``[kv_heads, *table.shape, head_dim]``."""
        flat = table.reshape(-1)  # index_select: advanced indexing cost ~5x on a CPU
        return self._loaded(i, lambda t: t.index_select(1, flat).view(t.shape[0], *table.shape, t.shape[-1]))

    def span(self, i: int, first: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s K and V of rows ``first .. first + n - 1`` as :meth:`gather` of one table row
        returns them (``[kv_heads, 1, n, head_dim]``), as views where the storage is exact."""
        return self._loaded(i, lambda t: t.narrow(1, first, n).unsqueeze(1))

    def _loaded(self, i: int, rows) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of layer ``i`` from ``rows`` of each stored tensor, as its :class:`Storage` loads them."""
        store = self.storage[i]
        k = store.load([rows(t) for t in self.keys[i]], self.dtype)
        return k, store.load([rows(t) for t in self.values[i]], self.dtype)

    @property
    def exact(self) -> bool:
        return all(type(s) is Storage for s in self.storage.values())
