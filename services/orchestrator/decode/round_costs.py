"""What a batched round costs, learnt from the rounds themselves: the price the block sizer pays per block
when several sessions share a round (``decode/block_sizing.py``, ``BlockSizer.cost``).

A round of ``n`` sessions verifying ``R`` rows in all (each session's block: its last token and its
candidates) takes ``T = g + f * n + s * R`` seconds: ``g`` the round's own fixed cost (one forward's
weight reads and launches, the host's loop), ``f`` each session's (its K/V gathered for attention, its
sampling, its draft call's share), ``s`` each row's (the batched matmuls). One session's block of ``L``
then costs it ``g / n + f + s * L``: the round's fixed cost shared, its own, and its rows. Priced from
the alone cost curve instead (``g + f + s * L``: every session paying the whole fixed cost), every
block looks nearly free per extra candidate and the sizer drafts long blocks whose later candidates are
mostly rejected -- rows a batched verify pays for (on a 2-core CPU, 16 streams of the demo pair's auto
blocks grew to ~8 and ran slower than a fixed 4). Priced with the fixed cost shared out
(``c(L) / n`` plus rows), the per-session cost ``f`` is missed and every block shrinks to 1.

Fitted by least squares on the per-session form ``T / n = g * (1 / n) + f + s * (R / n)``: the rounds
seen (older ones weighing less, ``FORGET`` per round: the load moves) plus, never forgotten, the alone
cost curve measured at warm-up as rounds of one session (``prime``). The two together tell ``g`` from
``f`` even when every round has the same ``n``; the rows' spread (sizes differ between sessions and
probes) and the alone curve's slope give ``s``. Thread-safe: the scheduler's driving thread observes,
sizers read on the model thread.
"""

from __future__ import annotations

import threading

import numpy as np

FORGET = 0.98  # each round scales the rounds seen before it by this: about the last 50 count
PRIOR_WEIGHT = 2.0  # each point of the alone curve counts as this many rounds of one session
RIDGE = 1e-6  # keeps the solve defined before the rounds spread; relative to the moments' scale


class RoundCosts:
    def __init__(self):
        self._lock = threading.Lock()
        self._alone_xx, self._alone_xy = np.zeros((3, 3)), np.zeros(3)
        self._xx, self._xy = np.zeros((3, 3)), np.zeros(3)
        self._params: tuple[float, float, float] | None = None
        self.rounds = 0  # batched rounds (more than one session) observed

    def prime(self, alone: dict[int, float]) -> None:
        """The alone cost curve (block size -> seconds of a block of one session) as rounds of one session."""
        with self._lock:
            self._alone_xx[:], self._alone_xy[:] = 0.0, 0.0
            for size, seconds in alone.items():
                x = np.array([1.0, 1.0, float(size)])
                self._alone_xx += PRIOR_WEIGHT * np.outer(x, x)
                self._alone_xy += PRIOR_WEIGHT * x * seconds
            self._fit()

    def observe(self, n: int, rows: int, seconds: float) -> None:
        """One round: ``n`` sessions, ``rows`` verified rows in all, ``seconds`` its draft and verify."""
        if n < 1 or rows < n or seconds <= 0:
            return
        x = np.array([1.0 / n, 1.0, rows / n])
        with self._lock:
            self._xx = FORGET * self._xx + np.outer(x, x)
            self._xy = FORGET * self._xy + x * (seconds / n)
            self.rounds += n > 1
            self._fit()

    def _fit(self) -> None:
        xx, xy = self._alone_xx + self._xx, self._alone_xy + self._xy
        if not xx.any():
            return
        ridge = RIDGE * np.trace(xx) * np.eye(3)
        g, f, s = np.linalg.solve(xx + ridge, xy)
        self._params = (max(float(g), 0.0), max(float(f), 0.0), max(float(s), 0.0))

    def price(self, n: int, size: int) -> float | None:
        """A block of ``size``'s seconds to one of ``n`` sessions sharing a round (None: nothing seen yet)."""
        with self._lock:
            if self._params is None or self.rounds == 0:
                return None
            g, f, s = self._params
        return max(g / n + f + s * size, 1e-9)

    @property
    def params(self) -> tuple[float, float, float] | None:
        """``(g, f, s)`` as fitted so far (see the module docstring)."""
        with self._lock:
            return self._params
