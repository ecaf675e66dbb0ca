"""Batched rounds price a block by what rounds cost (``block_sizing.RoundCosts``), and the sizer uses that price."""

from __future__ import annotations

import random

import pytest

from kakeya.orchestrator.decode.block_sizing import AcceptanceChain, AdaptivePolicy, BlockSizer, CostCurve, RoundCosts

from .test_loop import CONT, ScriptedDrafter, ScriptedVerifier


def _rounds(g: float, f: float, s: float, noise: float = 0.0, seed: int = 0) -> RoundCosts:
    """Rounds of 8 and 16 sessions at mixed block sizes, timed by ``g + f n + s R`` (plus noise)."""
    rng, costs = random.Random(seed), RoundCosts()
    costs.prime({size: g + f + s * size for size in (1, 2, 4, 8, 16)})  # the alone curve
    for _ in range(300):
        n = rng.choice([8, 16])
        rows = sum(rng.choice([2, 3, 4, 8]) for _ in range(n))
        costs.observe(n, rows, (g + f * n + s * rows) * (1 + noise * rng.uniform(-1, 1)))
    return costs


def test_the_fit_recovers_the_rounds_fixed_per_session_and_per_row_costs():
    g, f, s = 0.010, 0.0015, 0.0004
    fitted = _rounds(g, f, s).params
    assert fitted == pytest.approx((g, f, s), rel=1e-3)
    noisy = _rounds(g, f, s, noise=0.1).params
    assert noisy == pytest.approx((g, f, s), rel=0.25)
    assert _rounds(g, f, s).price(16, 4) == pytest.approx(g / 16 + f + 4 * s, rel=1e-3)


def test_nothing_is_priced_before_a_batched_round_was_seen():
    costs = RoundCosts()
    assert costs.price(16, 4) is None
    costs.prime({1: 0.01, 16: 0.02})
    costs.observe(1, 4, 0.012)  # a round of one session is the alone curve's business
    assert costs.price(16, 4) is None
    costs.observe(2, 8, 0.014)
    assert costs.price(16, 4) is not None


def _sizer(rounds: RoundCosts, alone: dict, sharing: int) -> BlockSizer:
    chain = AcceptanceChain()
    for _ in range(200):  # the first candidate always accepted, the second half the time, none after
        chain.observe(drafted=15, accepted=1)
        chain.observe(drafted=15, accepted=2)
    sizer = BlockSizer(CostCurve(alone), chain, explore_share=0, rounds=rounds)
    sizer.sharing = sharing
    return sizer


def test_rows_that_cost_make_a_shared_round_draft_shorter_blocks_and_free_rows_do_not():
    g, f = 0.010, 0.0003
    alone = {size: g + f + 0.0001 * size for size in (1, 2, 4, 8, 16)}  # alone: candidates look nearly free
    row_costly = _rounds(g, f, 0.0004)  # a CPU: a batched row costs (measured ~0.3-0.4 ms on the demo pair)
    row_free = _rounds(g, f, 0.00001)  # a GPU below its compute bound
    assert _sizer(row_costly, alone, 1).choose() == 4  # alone: the alone curve decides, long enough for 3 tokens
    assert _sizer(row_costly, alone, 16).choose() == 2  # shared: the rejected candidates' rows do not pay
    assert _sizer(row_free, alone, 16).choose() == 4  # free rows: what alone would choose


def test_a_batched_rounds_timing_refines_no_size_of_the_alone_curve():
    from kakeya.core.generation import Block

    sizer = _sizer(_rounds(0.01, 0.0003, 0.0004), {1: 0.01, 2: 0.011, 4: 0.012}, 16)
    before = dict(sizer.costs.seconds)
    sizer.observe(Block([0, 0], drafted=1, accepted=1, draft_s=0.05, verify_s=0.05, total_s=0.1))
    assert sizer.costs.seconds == before
    sizer.sharing = 1
    sizer.observe(Block([0, 0], drafted=1, accepted=1, draft_s=0.05, verify_s=0.05, total_s=0.1))
    assert sizer.costs.seconds != before


def test_the_scheduler_reports_each_round_and_the_loop_tells_each_sizer_its_company():
    from kakeya.orchestrator.decode.loop import Decode, DecodeOptions, one_by_one_drafts, one_by_one_verdicts
    from kakeya.orchestrator.decode.scheduler import Scheduler

    seen, policy = [], AdaptivePolicy(CostCurve({1: 1.0, 2: 1.1, 4: 1.2}), initial=4)
    decodes = []
    for _ in range(3):
        v = ScriptedVerifier(3, CONT)
        decode = Decode(v, ScriptedDrafter(v, 3), [1, 2, 3], DecodeOptions(12, policy.sizer()))
        decode.prefilled(*v.prefill([1, 2, 3]), 0.0)
        decodes.append(decode)
    scheduler = Scheduler(one_by_one_drafts, one_by_one_verdicts, on_round=lambda *r: seen.append(r))
    for d in decodes:
        scheduler.join(d)
    block = scheduler.next_block(decodes[0])
    assert block is not None and len(seen) == 1
    n, rows, seconds = seen[0]
    assert n == 3 and rows == 3 * 4 and seconds == block.draft_s + block.verify_s  # three blocks of 4 (warm size)
    assert all(d.sizer.sharing == 3 for d in decodes)


def test_a_decode_the_round_in_flight_finishes_still_gets_that_rounds_block():
    """The round that commits a decode's last block makes it ``done`` before the round hands the block over: its
    request asking for a block meanwhile must wait for it, not end without it (the last block's text was lost:
    a streamed answer ended short with finish reason "length", benchmarks/isolation.py)."""
    import threading
    import time

    from kakeya.orchestrator.decode.loop import Decode, DecodeOptions, one_by_one_drafts, one_by_one_verdicts
    from kakeya.orchestrator.decode.scheduler import Scheduler

    decodes = []
    for max_tokens in (20, 5):  # the second one's next round (a block of 4, every candidate right) is its last
        v = ScriptedVerifier(3, CONT)
        decode = Decode(v, ScriptedDrafter(v, 0), [1, 2, 3], DecodeOptions(max_tokens, 4))
        decode.prefilled(*v.prefill([1, 2, 3]), 0.0)
        decodes.append(decode)
    driver, finishing = decodes
    in_round = threading.Event()

    def step(fn, *args):  # the round has committed every block; its driver has not handed them over yet
        out = fn(*args)
        in_round.set()
        time.sleep(0.3)
        return out

    scheduler = Scheduler(one_by_one_drafts, one_by_one_verdicts, step)
    for d in decodes:
        scheduler.join(d)
    got = []
    t = threading.Thread(target=lambda: got.append(scheduler.next_block(driver)))
    t.start()
    assert in_round.wait(10)
    assert finishing.done  # the round in flight finished it
    block = scheduler.next_block(finishing)
    t.join()
    assert block is not None and block.tokens == CONT[1:5]
    assert finishing.generation.token_ids == CONT[:5] and got[0] is not None
    assert scheduler.next_block(finishing) is None  # and then it is over
