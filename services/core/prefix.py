"""The prefix cache both sides keep: snapshots of a session's state after exactly ``ids``, found by a prompt.

A verifier keeps its sessions' K/V, a drafter its context caches, each in its own :class:`PrefixCache` and budget; both
find a snapshot by the same token prefix, so the orchestrator resumes both from the same one or from none. Keys are
chained hashes of every :data:`HASH_BLOCK` tokens (as vLLM keys its blocks). A snapshot is filed under the boundary a
block before its end, its exact ids beside it (a collision costs a miss, never a wrong state), so a prompt parting from
it within its last block still finds it, ``back`` positions short. LRU eviction; one lock guards everything.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

HASH_BLOCK = 16  # tokens per hashed block (MAX_BLOCK_SIZE: a session rolls back at most one block)


def block_hashes(ids: Sequence[int], namespace: Hashable, limit: int | None = None) -> list[bytes]:
    """``out[j]``: the chained hash of ``ids[: j * HASH_BLOCK]`` (``out[0]``: the namespace alone), for every
    boundary up to ``limit`` tokens (default: all of ``ids``)."""
    n = len(ids) if limit is None else min(limit, len(ids))
    h = hashlib.blake2b(repr(namespace).encode(), digest_size=16).digest()
    out = [h]
    for start in range(0, n - HASH_BLOCK + 1, HASH_BLOCK):
        h = hashlib.blake2b(h + array("q", ids[start : start + HASH_BLOCK]).tobytes(), digest_size=16).digest()
        out.append(h)
    return out


@dataclass(frozen=True)
class Entry:
    """One snapshot: the state after exactly ``ids`` (its ``positions``), ``nbytes`` of it."""

    namespace: Hashable
    ids: tuple[int, ...]
    value: Any
    nbytes: int

    @property
    def positions(self) -> int:
        return len(self.ids)


@dataclass(frozen=True)
class Match:
    """A snapshot a prompt resumes from at ``positions``: its own length, or ``back`` fewer (see the module)."""

    entry: Entry
    positions: int

    @property
    def back(self) -> int:
        return self.entry.positions - self.positions

    @property
    def value(self) -> Any:
        return self.entry.value


def _filed_at(positions: int) -> int:
    """The boundary a snapshot of ``positions`` tokens is filed under: a block before its end."""
    return max(positions - HASH_BLOCK, 0) // HASH_BLOCK * HASH_BLOCK


def common_prefix(a: Sequence, b: Sequence) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class PrefixCache:
    """Snapshots by token prefix, at most ``budget`` bytes of them, least recently used evicted first."""

    def __init__(self, budget: int):
        if budget < 0:
            raise ValueError(f"prefix cache budget must be >= 0 bytes, got {budget}")
        self.budget = budget
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple, Entry] = OrderedDict()  # (namespace, ids) -> entry, oldest use first
        self._by_boundary: dict[bytes, set[tuple]] = {}  # hash of the last boundary -> keys of its entries
        self._boundary: dict[tuple, bytes] = {}  # key -> the hash it is filed under
        self.bytes = 0
        self.peak_bytes = 0  # the most bytes ever held at once: the budget's proof under load
        # counters (read by the metrics): lookups that found something / nothing, prompt tokens not recomputed
        self.hits = self.misses = self.tokens_reused = self.insertions = self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, namespace: Hashable, ids: Sequence[int], value: Any, nbytes: int) -> bool:
        """Keep ``value``, the state after exactly ``ids``; False when it does not fit the budget at all. A snapshot
        of the same ids is the same state: the one kept is refreshed, the new one dropped."""
        ids = tuple(ids)
        key = (namespace, ids)
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return True
            if nbytes > self.budget or not ids:
                return False
            while self.bytes + nbytes > self.budget:
                self._evict(next(iter(self._entries)))
            self._entries[key] = Entry(namespace, ids, value, nbytes)
            boundary = self._boundary[key] = block_hashes(ids, namespace, _filed_at(len(ids)))[-1]
            self._by_boundary.setdefault(boundary, set()).add(key)
            self.bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.bytes)
            self.insertions += 1
            return True

    def _evict(self, key: tuple) -> None:
        entry = self._entries.pop(key)
        boundary = self._boundary.pop(key)
        keys = self._by_boundary[boundary]
        keys.discard(key)
        if not keys:
            del self._by_boundary[boundary]
        self.bytes -= entry.nbytes
        self.evictions += 1

    def find(
        self,
        namespace: Hashable,
        prompt_ids: Sequence[int],
        allowed: Collection[int] | None = None,
        partial: bool = False,
    ) -> list[Match]:
        """Every snapshot a session may resume ``prompt_ids`` from, longest first: its ids a prefix of the prompt (with
        ``partial``, also one sharing at least a block, matched that far: ``Match.back`` > 0), at least one prompt token
        left to compute, and the length in ``allowed`` (None: any). Marks them used (LRU); :meth:`count` counts."""
        prompt = tuple(prompt_ids)
        hashes = block_hashes(prompt, namespace, len(prompt) - 1)
        found = []
        with self._lock:
            for h in hashes:
                for key in self._by_boundary.get(h, ()):
                    entry = self._entries[key]
                    n = entry.positions
                    if n >= len(prompt) or prompt[:n] != entry.ids:
                        if not partial:
                            continue
                        b = _filed_at(n)  # the prompt's hash matched there: compare the tokens after it
                        if prompt[:b] != entry.ids[:b]:
                            continue  # a collision
                        n = b + common_prefix(prompt[b : len(prompt) - 1], entry.ids[b:])
                        if n < HASH_BLOCK:  # a block shared at least: not a snapshot copied to keep a few tokens
                            continue
                    if allowed is None or n in allowed:
                        found.append(Match(entry, n))
            for match in found:
                self._entries.move_to_end((match.entry.namespace, match.entry.ids))
        return sorted(found, key=lambda m: (-m.positions, m.back))

    def count(self, reused: int) -> None:
        """One lookup's outcome for the metrics: ``reused`` prompt tokens resumed instead of computed (0: a miss)."""
        with self._lock:
            if reused:
                self.hits += 1
                self.tokens_reused += reused
            else:
                self.misses += 1

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "bytes": self.bytes, "peak_bytes": self.peak_bytes, "budget_bytes": self.budget,
                "entries": len(self._entries), "hits": self.hits, "misses": self.misses,
                "tokens_reused": self.tokens_reused, "insertions": self.insertions, "evictions": self.evictions,
            }  # fmt: skip
