"""The sliding-layer ring layout (backend-neutral): a verifier session's only position counter.

Every sliding layer keeps ``window - 1 + slack`` rotating slots, so a block of ``L <= slack`` positions, and
a trim of up to ``slack``, never lose a position a query still needs: rollback is moving the offset back,
exact past wraps, in bounded memory (``docs/design.md``, "The sliding-layer ring"). Which position each
slot holds is tracked here on the host and the mask derived from it, so the ring is never reordered. Each
forward gets one immutable :class:`ForwardPlan`; the caches only hold the arrays and apply its writes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

EMPTY = -1  # slot holds no position yet


@dataclass(frozen=True)
class RingWrite:
    """Copy ``length`` new positions starting at ``src`` into slots ``dst .. dst+length``."""

    dst: int
    src: int
    length: int


@dataclass(frozen=True)
class RestoreView:
    """What a restoring forward needs besides the K/V ring: f_theta and the latent ring before this forward."""

    restorer: object  # kakeya.verifier.mlx_backend.ftheta.Restorer
    latents: object  # backend array [slots, latent_dim], slot order
    positions: np.ndarray  # int64 [slots]: absolute position per slot (EMPTY = -1)
    mask: np.ndarray  # bool [n_new, slots] from restore_mask


@dataclass(frozen=True)
class ForwardPlan:
    """One forward of ``n_new`` positions from ``start``: everything a backend needs besides the arrays.
    Full-attention layers write positions ``start ..`` and attend causally; sliding layers write the ring as
    ``writes`` says and attend as ``mask`` says; a restoring forward (f_theta) also attends over ``restore``'s."""

    start: int  # absolute position of the first new token
    n_new: int
    in_place: bool  # True: write first, attend over slots[:used]; False: attend over slots[:used] ++ new, then write
    used: int  # slots attended to from the ring
    writes: tuple[RingWrite, ...]
    mask: np.ndarray  # bool [n_new, used (+ n_new if not in_place)], True = attend
    slot_positions: np.ndarray  # int64 [capacity]: each slot's position before this forward (EMPTY: none)
    restore: RestoreView | None = None


class RingLayout:
    """Slot bookkeeping shared by all sliding layers of one session."""

    def __init__(self, sink: int, window: int, slack: int):
        if slack < 1:
            raise ValueError("slack must be >= 1")
        self.sink, self.window, self.slack = sink, window, slack
        self.rotating = window - 1 + slack
        self.capacity = sink + self.rotating
        self.positions = np.full(self.capacity, EMPTY, dtype=np.int64)
        self.offset = 0  # absolute position of the next token
        self.written = 0  # one past the newest position ever written (a trimmed block's too)
        self.used = 0  # slots [0, used) have been written at least once
        self._pending: ForwardPlan | None = None

    def slot(self, pos: np.ndarray) -> np.ndarray:
        return np.where(pos < self.sink, pos, self.sink + (pos - self.sink) % self.rotating)

    def _visible(self, key_pos: np.ndarray, query_pos: np.ndarray) -> np.ndarray:
        q, k = query_pos[:, None], key_pos[None, :]
        in_window = (k > q - self.window) | (k < self.sink)
        return (k >= 0) & (k <= q) & in_window

    def plan(self, n_new: int) -> ForwardPlan:
        """Plan a forward of ``n_new`` positions starting at ``offset``."""
        if self._pending is not None:
            raise RuntimeError("previous ring plan was not applied")
        start = self.offset
        new_pos = np.arange(start, start + n_new)
        in_place = n_new <= self.slack
        # Positions that will sit in the ring afterwards: all of them when in place, else the
        # last `rotating` positions plus any sink positions.
        keep = new_pos if in_place else new_pos[(new_pos < self.sink) | (new_pos >= start + n_new - self.rotating)]
        writes = self._runs(keep, start)
        after = self.positions.copy()
        after[self.slot(keep)] = keep
        used = max(self.used, int(self.slot(keep).max()) + 1 if len(keep) else 0)
        if in_place:
            mask = self._visible(after[:used], new_pos)
        else:
            mask = self._visible(np.concatenate([self.positions[: self.used], new_pos]), new_pos)
            used = self.used
        plan = ForwardPlan(start, n_new, in_place, used, writes, mask, self.positions)
        self._pending = plan
        self._after = after
        return plan

    def _runs(self, keep: np.ndarray, start: int) -> tuple[RingWrite, ...]:
        slots = self.slot(keep)
        runs, i = [], 0
        while i < len(keep):
            j = i
            while j + 1 < len(keep) and slots[j + 1] == slots[j] + 1:
                j += 1
            runs.append(RingWrite(int(slots[i]), int(keep[i] - start), j - i + 1))
            i = j + 1
        return tuple(runs)

    def applied(self) -> None:
        """Record that the planned forward ran on every sliding layer."""
        plan = self._pending
        if plan is None:
            raise RuntimeError("no ring plan to apply")
        self.positions = self._after
        self.used = max(self.used, max((w.dst + w.length for w in plan.writes), default=0))
        self.offset += plan.n_new
        self.written = max(self.written, self.offset)
        self._pending = None

    def resume(self, positions: np.ndarray, offset: int, written: int, used: int) -> None:
        """Continue where another layout of this geometry stood (a prefix snapshot's): ``positions`` is
        never edited in place by either (every change makes a new array), so it is shared as it is."""
        if self.offset or self._pending is not None:
            raise RuntimeError("only a layout that planned nothing yet can resume another's state")
        if positions.shape != self.positions.shape:
            raise ValueError(f"a ring of {positions.shape[0]} slots cannot resume into one of {self.capacity}")
        self.positions, self.offset, self.written, self.used = positions, offset, written, used

    def can_trim(self, n: int) -> bool:
        """Whether forgetting the newest ``n`` positions is exact: the ring still holds every position the
        next query needs as long as no write since reached more than ``slack`` past it (a rejected draft's
        positions were written too, so two trims in a row count together)."""
        return trim_is_exact(self.offset, self.written, n, self.slack)

    def trim(self, n: int) -> None:
        """Forget the newest ``n`` positions. Exact for ``n <= slack`` past everything written (:meth:`can_trim`)."""
        if n < 0 or n > self.offset:
            raise ValueError(f"cannot trim {n} positions from a cache holding {self.offset}")
        if not self.can_trim(n):
            raise ValueError(
                f"trim of {n} exceeds the ring's rollback slack {self.slack}"
                f" ({self.written - self.offset} positions past the offset were written)"
            )
        self.offset -= n
        # Slots of trimmed positions keep stale K/V; marking them empty keeps masks honest. A new
        # array, not an edit: a plan's slot_positions stay as they were.
        self.positions = np.where(self.positions >= self.offset, EMPTY, self.positions)


def trim_is_exact(offset: int, written: int, n: int, slack: int) -> bool:
    """:meth:`RingLayout.can_trim` of a ring at ``offset`` with ``written`` positions written (a prefix
    snapshot's, asked before any layout resumes it)."""
    return 0 <= n <= offset and written - (offset - n) <= slack


def restore_mask(
    latent_positions: np.ndarray, start: int, n_new: int, sink: int, window: int, native_window: int
) -> np.ndarray:
    """Bool ``[n_new, slots]``: which latent-ring slots each new query attends to as RESTORED K/V: query
    ``t`` sees ``p`` iff it was evicted from the exact window but the model would still attend to it (``p >=
    sink`` and ``t - native_window < p <= t - window``). A restored position precedes ``start`` (its latent
    comes from an earlier forward's aux) as long as ``n_new <= window``."""
    if n_new > window:
        raise ValueError(f"a restoring forward may hold at most window={window} positions, got {n_new}")
    q = np.arange(start, start + n_new)[:, None]
    p = latent_positions[None, :]
    return (p >= 0) & (p >= sink) & (p <= q - window) & (p > q - native_window)
