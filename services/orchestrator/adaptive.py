"""Adaptive block size: pick each block's length to maximise expected tokens per second.

A block of length ``L`` commits ``E(L) = 1 + sum_{k<L} prod_{j<=k} a_j`` tokens on
average, where ``a_k`` is the chance that candidate ``k`` is accepted given
that the ones before it were, and costs ``t(L) = t_draft(L) + t_verify(L)``.
The best ``L`` maximises ``E(L) / t(L)``; it moves with the backend (a verify
of 16 costs about one step on a GPU, several on a CPU, more on an MoE whose
experts spread with ``L``) and with the text (repetitive code accepts long runs).

Both halves are measured, never assumed: ``measure_costs`` times draft and
verify at each size on the live endpoints at warm-up (so the wire is in it
for a split deployment), each block's own timings then refine it, and the
acceptance chain ``a_k`` is counted from every block. Until a few blocks were
seen the drafter's trained block size is used. A position short blocks never
reach takes the rate of the position before it as its prior (not the pooled
rate, which the first positions dominate: a drafter whose later positions
accept as well as its first would otherwise look worse the longer its blocks,
and the sizer would talk itself into short ones), and now and then one block
is drafted at full length so that prior keeps being tested. How often is set
by what it costs: a full-length block is due once the blocks since the last
one have taken ``1 / explore_share`` times its extra cost over the size the
model chose, so exploring takes about ``explore_share`` of the decode time on
every backend. (A fixed every-16th-block spent 1 % of the time where a block of
16 costs about one of 8, torch on a CPU, and 10 % on MLX's CPU backend, where
it costs 2.7 blocks of 4.)

Blocks the loop drafts by copy (``ngram.py``) accept by a law of their own
(a repeat runs to its end or breaks at once), so they keep their own chain and
their size is chosen from it; they are costed as drafted blocks, an upper bound
(a copy's drafter call only extends the context).

Only token counts and timings go in, so this knows no backend and changes no
token: the loop is lossless at every block size, whichever is chosen.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

from kakeya.core.contract import MAX_BLOCK_SIZE, Block, Draft

PRIOR_STRENGTH = 4.0  # pseudo-observations behind each position's prior (the pooled rate)
COST_EMA = 0.2  # weight of a new timing in the machine's running pace (every size's cost alike)
SHAPE_EMA = 0.05  # weight of a new timing in its size's cost relative to the others
SPIKE_CAP = 2.0  # a new timing counts as at most this many times the running cost
WARM_BLOCKS = 4  # blocks drafted at the trained size before the model of E(L)/t(L) takes over
EXPLORE_SHARE = 0.02  # the share of decode time full-length blocks may take beyond the chosen size's cost


@dataclass
class CostCurve:
    """Seconds per block by block size: measured points, linear in between and beyond.

    A block's timing moves every size's cost (the machine's pace: another process on a shared CPU
    slows a block of 16 as it slows a block of 4) and, twenty times more slowly, its own size's
    cost relative to the others (what calibration got wrong). Moving only the timed size let one
    slow minute price the sizes then chosen at twice the others, which were not re-timed: MLX on
    a shared CPU learnt a block of 4 at 27.5 ms against 15 in quiet runs, and chose 8, 0.78x the
    throughput of 4 (``benchmarks/results/adaptive.json`` before this)."""

    seconds: dict[int, float] = field(default_factory=dict)

    def observe(self, size: int, seconds: float) -> None:
        old = self.seconds.get(size)
        if old is None:
            self.seconds[size] = seconds
            return
        # one block stalled by the machine (a GC pause, a neighbour's burst) counts as at most twice the estimate
        ratio = min(seconds, SPIKE_CAP * old) / old
        pace = 1 + COST_EMA * (ratio - 1)  # the machine's speed: every size alike
        own = 1 + SHAPE_EMA * (ratio / pace - 1)  # what is left is this size's own
        for s in self.seconds:
            self.seconds[s] *= pace
        self.seconds[size] *= own

    def __call__(self, size: int) -> float:
        pts = sorted(self.seconds.items())
        if not pts:
            return float(size)  # nothing measured yet: cost grows with the block
        if size in self.seconds:
            return self.seconds[size]
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

    def observe(self, drafted: int, accepted: int) -> None:
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

    def expected_tokens(self, size: int) -> float:
        total, run = 1.0, 1.0
        for a in self.rates()[: size - 1]:
            run *= a
            total += run
        return total

    def merged(self, other: "AcceptanceChain", cap: float) -> "AcceptanceChain":
        """``self`` + ``other``, scaled so no position holds more than ``cap`` observations."""
        r = [x + y for x, y in zip(self.reached, other.reached)]
        a = [x + y for x, y in zip(self.accepted, other.accepted)]
        scale = min(1.0, cap / max(max(r), 1.0))
        return AcceptanceChain([x * scale for x in r], [x * scale for x in a])


class BlockSizer:
    """One generation's block-size choice; ``choose`` before a block, ``observe`` after it."""

    def __init__(self, costs: CostCurve, chain: AcceptanceChain | None = None, max_size: int = MAX_BLOCK_SIZE,
                 explore_share: float = EXPLORE_SHARE, initial: int = 0, copies: AcceptanceChain | None = None):
        self.costs, self.chain = costs, chain or AcceptanceChain()
        self.copies = copies or AcceptanceChain()  # the blocks drafted by copy (``Block.copied``)
        self.max_size, self.explore_share = max_size, explore_share  # 0: never explore
        self.initial = initial  # the size to use until a few blocks were seen (0: the model's choice from the start)
        self.since_explore = 0.0  # the cost curve's seconds of the blocks since the last full-length one

    def throughput(self, size: int) -> float:
        return self.chain.expected_tokens(size) / self.costs(size)

    def candidates(self) -> list[int]:
        """The sizes to choose from: those with a measured cost (calibration timed them on warm
        shapes, every chosen size refines its own), and the largest allowed. An in-between size is
        only ever interpolated, and its first forward in a process pays for a shape no one warmed."""
        measured = [s for s in self.costs.seconds if s < self.max_size]
        return sorted(set(measured) | {self.max_size}) if measured else list(range(1, self.max_size + 1))

    def choose(self, copy: bool = False) -> int:
        """The next block's size; ``copy``: it will be drafted by copy, so the copies' chain decides."""
        chain = self.copies if copy else self.chain
        if self.initial and chain.reached[0] < WARM_BLOCKS:
            return min(self.initial, self.max_size)  # no acceptance seen yet: trust the drafter's training
        rates = chain.rates()  # once per block: E(L) for every L is one running product
        expected, run, total = {}, 1.0, 1.0
        for size in range(1, self.max_size + 1):
            expected[size] = total
            if size - 1 < len(rates):
                run *= rates[size - 1]
                total += run
        best = max(self.candidates(), key=lambda size: expected[size] / self.costs(size))
        if copy:  # a copy's later positions take the rate before them, and copies rarely stop midway: no exploring
            return best
        extra = self.costs(self.max_size) - self.costs(best)  # what one full-length block costs beyond it
        if self.explore_share and best != self.max_size and self.since_explore * self.explore_share >= extra:
            return self.max_size
        return best

    def observe(self, block: Block) -> None:
        size = block.drafted + 1
        self.since_explore = 0.0 if size == self.max_size else self.since_explore + self.costs(size)
        if block.copied:  # its own chain; and its timing lacks the drafted block's forward, so it times no size
            self.copies.observe(block.drafted, block.accepted)
            return
        self.chain.observe(block.drafted, block.accepted)
        if block.total_s > 0 and (size in self.costs.seconds or size == self.max_size or not self.costs.seconds):
            # only the sizes it chooses from: a block cut short by max_tokens would add a size the
            # sizer then picks on one lucky timing
            self.costs.observe(size, block.draft_s + block.verify_s)


class AdaptivePolicy:
    """An engine's shared state: the cost curve and the acceptance seen so far, across requests.

    Each request starts from a copy (so concurrent requests never race on it)
    whose acceptance weighs at most ``carry`` blocks, enough to start well and
    little enough that the request's own text takes over within a few blocks.
    """

    def __init__(self, costs: CostCurve | None = None, max_size: int = MAX_BLOCK_SIZE, carry: float = 32.0, initial: int = 0):
        self.costs = costs or CostCurve()
        self.chain, self.copies = AcceptanceChain(), AcceptanceChain()
        self.max_size, self.carry, self.initial = max_size, carry, initial
        self._lock = threading.Lock()

    def sizer(self) -> BlockSizer:
        with self._lock:
            chain = AcceptanceChain().merged(self.chain, self.carry)
            copies = AcceptanceChain().merged(self.copies, self.carry)
            costs = CostCurve(dict(self.costs.seconds))
        return BlockSizer(costs, chain, self.max_size, initial=self.initial, copies=copies)

    def learn(self, sizer: BlockSizer) -> None:
        """Fold a finished request's timings and acceptance back in."""
        with self._lock:
            self.costs = CostCurve(dict(sizer.costs.seconds))
            self.chain = self.chain.merged(sizer.chain, 4 * self.carry)
            self.copies = self.copies.merged(sizer.copies, 4 * self.carry)


def measure_costs(verifier, drafter, sizes: Sequence[int] = (1, 2, 4, 8, 16), repeats: int = 3, prompt_len: int = 32,
                  clock=time.perf_counter) -> CostCurve:
    """Time one block (draft + verify) at each size on live sessions; the fastest of ``repeats``.

    Runs through the same session API as a generation, so a remote endpoint's
    wire time is part of its cost, as it is in every real block. Every size
    is run once untimed first: a fresh process's first forward at a shape pays
    for allocations, kernel selection and (MLX) graph building, and timing that
    made AR look 10x dearer than it is, so a first request chose its blocks on
    a wrong curve. The fastest repeat, not the median, because on a shared
    machine the noise only ever adds time.
    """
    vocab = verifier.info.vocab_size
    prompt = [(7 * i + 3) % vocab for i in range(prompt_len)]
    vs = verifier.open_session()
    ds = drafter.open_session() if drafter is not None else None
    curve = CostCurve()
    timed: set[int] = set()  # sizes run once untimed (first pass), then measured (second)
    try:
        last, aux = vs.prefill(prompt)
        for size in [s for s in sizes if s == 1 or ds is not None] * 2:
            times = []
            for _ in range(repeats if size in timed else 1):
                t0 = clock()
                draft = ds.draft(aux, last, size) if ds is not None else Draft(())  # size 1: the context still grows
                verdict = vs.decide(last, draft)
                times.append(clock() - t0)
                aux, last = verdict.aux, verdict.next_token
            if size in timed:
                curve.seconds[size] = min(times)
            timed.add(size)
    finally:
        vs.close()
        if ds is not None:
            ds.close()
    return curve
