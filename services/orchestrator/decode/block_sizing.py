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
acceptance chain ``a_k`` is counted from every block, the older blocks
weighing less (``FORGET`` per block: text changes, and a hard opening must not
price the easy rest of a request). Until a few blocks were seen the drafter's
trained block size is used. A position short blocks never reach takes the rate
of the position before it as its prior (not the pooled rate, which the first
positions dominate: a drafter whose later positions accept as well as its
first would otherwise look worse the longer its blocks, and the sizer would
talk itself into short ones).

Now and then one block is drafted one size longer than the model chose (a
probe), so the positions just beyond its choice keep being tested: a choice of
1 drafts nothing and so learns nothing, and without probes a request whose
first blocks accepted little would stay autoregressive to its end. How often is
set by what a probe costs: one is due once the blocks since the last have taken
``1 / explore_share`` times its extra cost over the choice, so probing takes
about ``explore_share`` of the decode time on every backend; a probe accepted
whole paid for itself, and the next block probes again.

Blocks the loop drafts by copy (``proposers/ngram.py``) accept by a law of their own
(a repeat runs to its end or breaks at once), so they keep their own chain and
their size is chosen from it; they are costed as drafted blocks, an upper bound
(a copy's drafter call only extends the context). The first few are tried at
the size a draft would have (at least 2); after that at the size their own
chain prices best, and where that is 1 (copies here break at once) the block
is drafted instead. Whether to copy is never decided by comparing a copy's price
with the drafter's: priced as a drafted block, a copy looks dearer than it is.

Batched rounds change the price (``BlockSizer.sharing``): when several sessions share a round, its
fixed cost is paid once for all of them while each candidate is a row every batched forward pays for,
so a block is priced by what rounds are measured to cost (``decode/round_costs.py``), not by the alone curve.
A batched round's timing is the whole round's, not this block's, so it refines no size's cost.

Only token counts and timings go in, so this knows no backend and changes no
token: the loop is lossless at every block size, whichever is chosen. What these
choices were measured to buy: ``docs/benchmarks.md`` (the sizer's paragraphs
under "The demo pair as a user meets it").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kakeya.core.contract import Draft
from kakeya.core.generation import Block
from kakeya.core.request import MAX_BLOCK_SIZE
from kakeya.orchestrator.decode.round_costs import RoundCosts

PRIOR_STRENGTH = 4.0  # pseudo-observations behind each position's prior (the pooled rate)
COST_EMA = 0.2  # weight of a new timing in the machine's running pace (every size's cost alike)
SHAPE_EMA = 0.05  # weight of a new timing in its size's cost relative to the others
SPIKE_CAP = 2.0  # a new timing counts as at most this many times the running cost
WARM_BLOCKS = 4  # blocks drafted at the trained size before the model of E(L)/t(L) takes over
EXPLORE_SHARE = 0.02  # the share of decode time probes (one size longer) may take beyond the chosen size's cost
FORGET = 0.95  # each block scales the acceptance seen before it by this: about the last 20 blocks count ...
FORGET_FLOOR = 8.0  # ... but never below this many first positions, so a run of blocks of 1 (which observe
# nothing) does not melt the evidence back to the 0.5 prior and retry, unbudgeted, a drafter known to miss


@dataclass
class CostCurve:
    """Seconds per block by block size: measured points, linear in between and beyond.

    A block's timing moves every size's cost (the machine's pace: another process on a shared CPU
    slows a block of 16 as it slows a block of 4) and, twenty times more slowly, its own size's
    cost relative to the others (what calibration got wrong). Moving only the timed size would let
    one slow spell price the sizes then chosen above the others, which are not re-timed while
    they are not chosen, so the sizer would never learn otherwise."""

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

    def observe(self, drafted: int, accepted: int, forget: float = 1.0, floor: float = 0.0) -> None:
        """Count one block; ``forget`` first scales what was counted before it, while the first
        position keeps at least ``floor`` observations."""
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

    def expected_tokens(self, size: int) -> float:
        total, run = 1.0, 1.0
        for a in self.rates()[: size - 1]:
            run *= a
            total += run
        return total

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
        self.probing = 0  # the size of the probe in flight (0: none)
        self.sharing = 1  # sessions in the round its next block runs in (``loop.advance`` sets it each round)

    def cost(self, size: int) -> float:
        """A block of ``size``'s seconds: alone, the cost curve's; in a round shared by ``sharing`` sessions,
        its price in such a round (``decode/round_costs.py``) once batched rounds were seen."""
        if self.sharing > 1 and self.rounds is not None:
            price = self.rounds.price(self.sharing, size)
            if price is not None:
                return price
        return self.costs(size)

    def candidates(self) -> list[int]:
        """The sizes to choose from: those with a measured cost (calibration timed them on warm
        shapes, every chosen size refines its own), and the largest allowed. An in-between size is
        only ever interpolated, and its first forward in a process pays for a shape no one warmed."""
        measured = [s for s in self.costs.seconds if s < self.max_size]
        return sorted(set(measured) | {self.max_size}) if measured else list(range(1, self.max_size + 1))

    def _best(self, chain: AcceptanceChain) -> int:
        """The candidate size with the most expected tokens a second under ``chain``."""
        rates = chain.rates()  # once per block: E(L) for every L is one running product
        expected, run, total = {}, 1.0, 1.0
        for size in range(1, self.max_size + 1):
            expected[size] = total
            if size - 1 < len(rates):
                run *= rates[size - 1]
                total += run
        return max(self.candidates(), key=lambda size: expected[size] / self.cost(size))

    def choose(self, copy: bool = False) -> int:
        """The next block's size. ``copy``: the size for a block drafted by copy, the copies' chain
        deciding (1: not worth copying, the loop drafts instead)."""
        best = min(self.initial, self.max_size) if self.warm else self._best(self.chain)
        if copy:  # no probing: a copy's later positions take the rate before them, and copies rarely stop midway
            if self.copies.reached[0] < WARM_BLOCKS:  # too few copies seen to judge: the size a draft would have
                return min(max(best, 2), self.max_size)
            return self._best(self.copies)  # 1: copies here break at once; the loop drafts this block instead
        if self.warm:  # no acceptance seen yet: trust the drafter's training
            return best
        longer = [s for s in self.candidates() if s > best]
        if (
            self.explore_share
            and longer
            and self.since_probe * self.explore_share >= self.cost(longer[0]) - self.cost(best)
        ):
            self.since_probe, self.probing = 0.0, longer[0]
            return longer[0]
        return best

    def observe(self, block: Block) -> None:
        size = block.drafted + 1
        self.since_probe += self.cost(size)
        if self.probing == size and block.accepted == block.drafted:
            self.since_probe = float("inf")  # a probe accepted whole paid for itself: probe again at once
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
    """An engine's shared state: the cost curve and the acceptance seen so far, across requests.

    Each request starts from a copy (so concurrent requests never race on it)
    whose acceptance weighs at most ``carry`` blocks, enough to start well and
    little enough that the request's own text takes over within a few blocks.
    """

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
        """A request's sizer, primed with what this policy has seen; ``max_size``: the request's own cap
        (its ``max_block_size`` and its cache policy's), at most the policy's."""
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
    prompt_len: int = 32,
    clock=time.perf_counter,
) -> CostCurve:
    """Time one block (draft + verify) at each size on live sessions; the fastest of ``repeats``.

    Runs through the same session API as a generation, so a remote endpoint's
    wire time is part of its cost, as it is in every real block. Every size
    is run once untimed first: a fresh process's first forward at a shape pays
    for allocations, kernel selection and (MLX) graph building, and timing that
    would price the sizes many times dearer than they are, so a first request
    would choose its blocks on a wrong curve. The fastest repeat, not the median,
    because on a shared machine the noise only ever adds time.
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
