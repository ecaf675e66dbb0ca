"""Adaptive block size: pick each block's length to maximise expected tokens per second.

A block of length ``L`` commits ``E(L) = 1 + sum_{k<L} prod_{j<=k} a_j`` tokens on average (``a_k``: the chance
candidate ``k`` is accepted given the ones before it) and costs ``t(L) = t_draft(L) + t_verify(L)``; the best ``L``
maximises ``E(L) / t(L)``. Costs are timed on the live endpoints at warm-up (:func:`measure_costs`) and refined by each
block; the acceptance chain is counted from every block, older ones weighing less (``FORGET``). A position short blocks
never reach takes the previous position's rate as prior (the pooled rate would talk the sizer into short blocks).

Now and then a block is drafted one size longer or, in turn, shorter (a probe): a choice of 1 is not final, and the
sizes not chosen are timed again. Copied blocks (``proposers.py``) accept by a law of their own, so they keep their own
chain. Sessions sharing a round are priced by :class:`RoundCosts`. Only counts and timings go in: no token changes
whichever size is chosen.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kakeya.core.contract import Draft, SessionOptions
from kakeya.core.generation import Block
from kakeya.core.request import MAX_BLOCK_SIZE

PRIOR_STRENGTH = 4.0  # pseudo-observations behind each position's prior (the pooled rate)
COST_EMA = 0.2  # weight of a new timing in the machine's running pace (every size's cost alike)
SHAPE_EMA = 0.05  # weight of a new timing in its size's cost relative to the others
SPIKE_CAP = 2.0  # a new timing counts as at most this many times the running cost (or as little as 1/this)
WARM_BLOCKS = 4  # blocks drafted at the trained size before the model of E(L)/t(L) takes over
EXPLORE_SHARE = 0.02  # the share of decode time probes may lose (their time beyond their tokens' at the choice's pace)
FORGET = 0.95  # each block scales the acceptance seen before it by this: about the last 20 blocks count ...
FORGET_FLOOR = 8.0  # ... but never below this many first positions, so a run of blocks of 1 (which observe
# nothing) does not melt the evidence back to the 0.5 prior and retry, unbudgeted, a drafter known to miss
ROUND_FORGET = 0.98  # each round scales the rounds seen before it by this: about the last 50 count
PRIOR_WEIGHT = 2.0  # each point of the alone curve counts as this many rounds of one session
RIDGE = 1e-6  # keeps the rounds' solve defined before they spread; relative to the moments' scale


@dataclass
class CostCurve:
    """Seconds per block by block size: measured points, linear in between and beyond. A timing moves every size's cost
    (the machine's pace) and, twenty times more slowly, its own size's relative cost, so one slow spell cannot price the
    chosen sizes above the others, which only probes re-time."""

    seconds: dict[int, float] = field(default_factory=dict)

    def observe(self, size: int, seconds: float) -> None:
        old = self.seconds.get(size)
        if old is None:
            self.seconds[size] = seconds
            return
        # in logs (multiplied in, noisy ratios drift the sizes not timed ever dearer); a stalled block counts as 2x at most
        ratio = math.log(min(max(seconds, old / SPIKE_CAP), SPIKE_CAP * old) / old)
        pace = COST_EMA * ratio  # the machine's speed: every size alike
        for s in self.seconds:
            self.seconds[s] *= math.exp(pace)
        self.seconds[size] *= math.exp(SHAPE_EMA * (ratio - pace))  # what is left is this size's own

    def __call__(self, size: int) -> float:
        if size in self.seconds:  # first: the sizer asks for measured sizes, every candidate of every block
            return self.seconds[size]
        pts = sorted(self.seconds.items())
        if not pts:
            return float(size)  # nothing measured yet: cost grows with the block
        if len(pts) == 1:
            return pts[0][1] * size / pts[0][0] if pts[0][0] else pts[0][1]
        lo = [p for p in pts if p[0] < size]
        hi = [p for p in pts if p[0] > size]
        (x0, y0), (x1, y1) = (lo[-1], hi[0]) if lo and hi else (pts[-2], pts[-1]) if lo else (pts[0], pts[1])
        return max(y0 + (y1 - y0) * (size - x0) / (x1 - x0), 1e-9)


@dataclass
class AcceptanceChain:
    """Per-position acceptance counts: ``reached[k]`` blocks drafted a k-th candidate after k-1 accepts."""

    reached: list[float] = field(default_factory=lambda: [0.0] * MAX_BLOCK_SIZE)
    accepted: list[float] = field(default_factory=lambda: [0.0] * MAX_BLOCK_SIZE)

    def observe(self, drafted: int, accepted: int, forget: float = 1.0, floor: float = 0.0) -> None:
        """Count one block; ``forget`` first scales the counts so far (the first position keeps ``floor``)."""
        if forget != 1.0 and self.reached[0] * forget >= floor:
            self.reached = [x * forget for x in self.reached]
            self.accepted = [x * forget for x in self.accepted]
        for k in range(min(accepted + 1, drafted)):
            self.reached[k] += 1
            self.accepted[k] += k < accepted

    def pooled(self) -> float:
        r = sum(self.reached)
        return (sum(self.accepted) + 1.0) / (r + 2.0)  # Laplace: 0.5 before any data

    def rates(self) -> list[float]:
        """Each position's smoothed rate; its prior is the rate of the position before (the first's: pooled)."""
        out, prior = [], self.pooled()
        for a, r in zip(self.accepted, self.reached):
            prior = (a + PRIOR_STRENGTH * prior) / (r + PRIOR_STRENGTH)
            out.append(prior)
        return out

    def expected_tokens(self, most: int) -> list[float]:
        """E(L) for L = 1 .. ``most``: what a block of L commits on average, 1 + r1 + r1 r2 + ... (one running
        product; past the positions observed, nothing more)."""
        out, run = [1.0], 1.0
        for a in self.rates()[: most - 1]:
            run *= a
            out.append(out[-1] + run)
        return out + [out[-1]] * (most - len(out))

    def merged(self, other: AcceptanceChain, cap: float) -> AcceptanceChain:
        """``self`` + ``other``, scaled so no position holds more than ``cap`` observations."""
        r = [x + y for x, y in zip(self.reached, other.reached)]
        a = [x + y for x, y in zip(self.accepted, other.accepted)]
        scale = min(1.0, cap / max(max(r), 1.0))
        return AcceptanceChain([x * scale for x in r], [x * scale for x in a])


class BlockSizer:
    """One generation's block-size choice; ``choose`` before a block, ``observe`` after it."""

    def __init__(
        self,
        costs: CostCurve,
        chain: AcceptanceChain | None = None,
        max_size: int = MAX_BLOCK_SIZE,
        explore_share: float = EXPLORE_SHARE,
        initial: int = 0,
        copies: AcceptanceChain | None = None,
        rounds: RoundCosts | None = None,
    ):
        self.costs, self.chain = costs, chain or AcceptanceChain()
        self.rounds = rounds  # what batched rounds cost (the engine's, shared by its sizers)
        self.copies = copies or AcceptanceChain()  # the blocks drafted by copy (``Block.copied``)
        self.max_size, self.explore_share = max_size, explore_share  # 0: never probe
        self.initial = initial  # the size to use until a few blocks were seen (0: the model's choice from the start)
        # blocks still to draft at ``initial``: none when the chain carried enough from earlier requests
        self.warm = WARM_BLOCKS if initial and self.chain.reached[0] < WARM_BLOCKS else 0
        self.since_probe = 0.0  # the cost curve's seconds of the blocks since the last probe
        self.probing, self.shorter = 0, False  # the size of the probe in flight (0: none); the next one shorter
        self.sharing = 1  # sessions in the round its next block runs in (``loop.advance`` sets it each round)

    def cost(self, size: int) -> float:
        """A block of ``size``'s seconds: alone, the cost curve's; shared by ``sharing`` sessions, the rounds' price."""
        if self.sharing > 1 and self.rounds is not None:
            price = self.rounds.price(self.sharing, size)
            if price is not None:
                return price
        return self.costs(size)

    def candidates(self) -> list[int]:
        """The sizes with a measured cost, and the largest allowed: an in-between size is only interpolated,
        and its first forward in a process pays for a shape no one warmed."""
        measured = [s for s in self.costs.seconds if s < self.max_size]
        return sorted(set(measured) | {self.max_size}) if measured else list(range(1, self.max_size + 1))

    def _best(self, expected: list[float]) -> int:
        """The candidate size with the most tokens a second, committing ``expected`` (E(L) for L = 1 ..)."""
        return max(self.candidates(), key=lambda size: expected[size - 1] / self.cost(size))

    def choose(self, copy: bool = False) -> int:
        """The next block's size; ``copy``: for a block drafted by copy (1: not worth copying)."""
        expected = self.chain.expected_tokens(self.max_size)  # once per block
        best = min(self.initial, self.max_size) if self.warm else self._best(expected)
        if copy:  # no probing: a copy's later positions take the rate before them, and copies rarely stop midway
            if self.copies.reached[0] < WARM_BLOCKS:  # too few copies seen to judge: the size a draft would have
                return min(max(best, 2), self.max_size)
            return self._best(self.copies.expected_tokens(self.max_size))  # 1: copies break at once; a draft instead
        if self.warm:  # no acceptance seen yet: trust the drafter's training
            return best
        # probes take turns one size longer (acceptance past the choice) and shorter (re-timing what the curve keeps)
        sizes = self.candidates()
        at = sizes.index(best)
        near = sizes[at + 1 : at + 2], sizes[max(at - 1, 0) : at]  # (longer, shorter), indexed by ``shorter``
        probe = (near[self.shorter] or near[not self.shorter] or [0])[0]
        # what a probe costs: its time beyond what its tokens take at the choice's pace
        lost = self.cost(probe) - expected[probe - 1] * self.cost(best) / expected[best - 1] if probe else 0.0
        if probe and self.explore_share and self.since_probe * self.explore_share >= lost:
            self.since_probe, self.probing, self.shorter = 0.0, probe, probe > best
            return probe
        return best

    def observe(self, block: Block) -> None:
        size = block.drafted + 1
        self.since_probe += self.cost(size)
        if self.probing == size and block.accepted == block.drafted and self.shorter:
            self.since_probe, self.shorter = float("inf"), False  # a longer probe accepted whole: another at once
        self.probing = 0
        if block.copied:  # its own chain; and its timing lacks the drafted block's forward, so it times no size
            self.copies.observe(block.drafted, block.accepted, FORGET, FORGET_FLOOR)
            return
        self.warm = max(self.warm - 1, 0)
        self.chain.observe(block.drafted, block.accepted, FORGET, FORGET_FLOOR)
        if self.sharing > 1:  # the timing is the batched round's, every session's rows in it
            return
        if block.total_s > 0 and (size in self.costs.seconds or size == self.max_size or not self.costs.seconds):
            # only the sizes it chooses from: a block cut short by max_tokens would add a size the
            # sizer then picks on one lucky timing
            self.costs.observe(size, block.draft_s + block.verify_s)


class AdaptivePolicy:
    """An engine's cost curve and acceptance, across requests. Each request starts from a copy (no races)
    whose acceptance weighs at most ``carry`` blocks, so its own text takes over within a few blocks."""

    def __init__(
        self, costs: CostCurve | None = None, max_size: int = MAX_BLOCK_SIZE, carry: float = 32.0, initial: int = 0
    ):
        self.costs = costs or CostCurve()
        self.chain, self.copies = AcceptanceChain(), AcceptanceChain()
        self.max_size, self.carry, self.initial = max_size, carry, initial
        self.rounds = RoundCosts()  # the scheduler's rounds, observed; what a block costs when several share one
        self.rounds.prime(self.costs.seconds)
        self._lock = threading.Lock()

    def sizer(self, max_size: int | None = None) -> BlockSizer:
        """A request's sizer, primed with what this policy has seen, capped at ``max_size``."""
        with self._lock:
            chain = AcceptanceChain().merged(self.chain, self.carry)
            copies = AcceptanceChain().merged(self.copies, self.carry)
            costs = CostCurve(dict(self.costs.seconds))
        cap = self.max_size if max_size is None else min(max_size, self.max_size)
        return BlockSizer(costs, chain, cap, initial=self.initial, copies=copies, rounds=self.rounds)

    def learn(self, sizer: BlockSizer) -> None:
        """Fold a finished request's timings and acceptance back in."""
        with self._lock:
            self.costs = CostCurve(dict(sizer.costs.seconds))
            self.chain = self.chain.merged(sizer.chain, 4 * self.carry)
            self.copies = self.copies.merged(sizer.copies, 4 * self.carry)


def measure_costs(
    verifier,
    drafter,
    sizes: Sequence[int] = (1, 2, 4, 8, 16),
    repeats: int = 3,
    clock=time.perf_counter,
) -> CostCurve:
    """Time one block (draft + verify) at each size on live sessions (a remote endpoint's wire included): ``repeats``
    passes over every size, each size's median, so a burst of the machine's falls on several sizes once each, not on
    one size's every timing (which priced it out for good). A first pass runs untimed: a process's first forward at
    a shape pays for allocations and kernel selection, which would price the sizes far too dear."""
    prompt = [(7 * i + 3) % verifier.info.vocab_size for i in range(32)]
    options = SessionOptions(max_positions=len(prompt) + (repeats + 1) * sum(sizes))  # not the whole context:
    vs = verifier.open_session(None, None, options)  # a --max-kv-bytes budget below it refused every auto request
    ds = drafter.open_session(None, options) if drafter is not None else None
    sized, times = [s for s in sizes if s == 1 or ds is not None], {}
    try:
        last, aux = vs.prefill(prompt)
        for n, size in enumerate(sized * (repeats + 1)):
            t0 = clock()
            draft = ds.draft(aux, last, size) if ds is not None else Draft(())  # size 1: the context still grows
            verdict = vs.decide(last, draft)
            if n >= len(sized):
                times.setdefault(size, []).append(clock() - t0)
            aux, last = verdict.aux, verdict.next_token
    finally:
        vs.close()
        if ds is not None:
            ds.close()
    return CostCurve({size: float(np.median(t)) for size, t in times.items()})


class RoundCosts:
    """What a batched round costs, learnt from the rounds: ``n`` sessions verifying ``R`` rows take ``T = g + f * n + s
    * R``, so one session's block of ``L`` costs it ``g / n + f + s * L``. The alone curve makes extra candidates look
    nearly free in a batch (long, mostly rejected blocks); sharing out the alone cost misses ``f`` and shrinks every
    block to 1.

    Least squares on ``T / n`` over the rounds seen (``ROUND_FORGET`` per round) plus, never forgotten, the alone curve
    as rounds of one (``prime``), which tells ``g`` from ``f`` even when every round has the same ``n``. Thread-safe."""

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
            self._xx = ROUND_FORGET * self._xx + np.outer(x, x)
            self._xy = ROUND_FORGET * self._xy + x * (seconds / n)
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
        """``(g, f, s)`` as fitted so far."""
        with self._lock:
            return self._params
