"""Adaptive block size: the model of tokens per second, the choice it makes, and that it stays lossless."""

import pytest

from kakeya.core.contract import Draft, Verdict
from kakeya.core.generation import Block
from kakeya.orchestrator.decode.block_sizing import AcceptanceChain, AdaptivePolicy, BlockSizer, CostCurve
from kakeya.orchestrator.decode.loop import run

from .test_loop import CONT, ScriptedDrafter, ScriptedVerifier


def test_cost_curve_interpolates_and_extrapolates_linearly():
    c = CostCurve({1: 1.0, 4: 4.0, 8: 6.0})
    assert c(4) == 4.0
    assert c(2) == pytest.approx(2.0)
    assert c(6) == pytest.approx(5.0)
    assert c(16) == pytest.approx(10.0)  # beyond the last point: the last segment's slope


def test_a_timing_moves_every_size_by_the_machines_pace_and_its_own_size_slowly():
    c = CostCurve({1: 1.0, 4: 4.0, 8: 6.0})
    c.observe(4, 2.0)  # twice as fast as thought: the machine is faster, every size alike ...
    pace = 0.5**0.2  # a geometric step: a timing's ratio counts by its log
    assert c(1) == pytest.approx(pace) and c(8) == pytest.approx(6.0 * pace)
    assert c(4) == pytest.approx(4.0 * pace * (0.5 / pace) ** 0.05)  # ... and 4 a little on its own
    c = CostCurve({1: 1.0, 4: 4.0})
    c.observe(1, 50.0)  # a stalled block: counted as twice the estimate, not fifty times
    assert c(4) == pytest.approx(4.0 * 2**0.2)
    c.observe(1, 0.0)  # nor a block timed at nothing (as little as half the estimate)
    assert c(4) == pytest.approx(4.0)


def test_a_slow_spell_while_one_size_is_chosen_does_not_price_it_out_for_good():
    c = CostCurve({2: 1.0, 4: 1.3, 8: 2.0})
    for _ in range(30):  # the machine runs at half speed while only 4 is chosen
        c.observe(4, 2.6)
    # the shape holds within the few blocks the pace takes to catch up (0.65 -> 0.73), where moving 4 alone
    # priced it at 2.6 against 8's 2.0 and the sizer would have left it for good
    assert 0.65 < c(4) / c(8) < 0.75
    for _ in range(300):  # a lasting difference of 4's own (calibration had it 30 % too cheap) is learnt
        c.observe(4, 1.69 * c(8) / 2.0)
    assert c(4) / c(8) == pytest.approx(1.69 / 2.0, rel=0.05)


def test_acceptance_chain_counts_each_position_reached():
    chain = AcceptanceChain()
    chain.observe(drafted=7, accepted=2)  # positions 1, 2 accepted, 3 rejected, 4.. never reached
    assert chain.reached[:4] == [1, 1, 1, 0] and chain.accepted[:4] == [1, 1, 0, 0]
    chain.observe(drafted=3, accepted=3)  # all accepted: the bonus follows, no position 4 drafted
    assert chain.reached[:4] == [2, 2, 2, 0] and chain.accepted[:4] == [2, 2, 1, 0]


def test_expected_tokens_is_the_geometric_sum_for_a_constant_rate():
    chain = AcceptanceChain()
    for _ in range(4000):  # a rate of 0.75 at every position, well measured
        chain.observe(drafted=15, accepted=15)
        chain.observe(drafted=15, accepted=0)
        chain.observe(drafted=15, accepted=15)
        chain.observe(drafted=15, accepted=15)
    rates = chain.rates()
    assert rates[0] == pytest.approx(0.75, abs=0.01)
    assert chain.expected_tokens(1) == [1.0]
    assert chain.expected_tokens(3) == pytest.approx([1, 1 + rates[0], 1 + rates[0] + rates[0] * rates[1]])
    longest = chain.expected_tokens(len(rates) + 2)  # a block of len(rates) + 1 uses every rate the chain holds
    assert longest[-3] < longest[-2] == longest[-1]  # past them a longer block adds nothing


def _sizer(rate_accepted: int, costs: dict) -> BlockSizer:
    chain = AcceptanceChain()
    for _ in range(200):
        chain.observe(drafted=15, accepted=rate_accepted)
    return BlockSizer(CostCurve(costs), chain, explore_share=0)


def test_choice_follows_cost_and_acceptance():
    flat = {1: 1.0, 16: 1.1}  # a GPU-like verifier: 16 positions cost about one
    linear = {1: 1.0, 16: 16.0}  # cost grows as fast as the tokens a block can commit
    assert _sizer(15, flat).choose() == 16  # everything accepted, cost flat: longest block
    assert _sizer(0, flat).choose() == 1  # nothing accepted: drafting only costs
    assert _sizer(15, linear).choose() == 1  # E(L) < L whenever a miss is possible: AR wins
    assert _sizer(15, {1: 1.0, 16: 8.0}).choose() == 16
    mid = _sizer(3, {1: 1.0, 2: 1.2, 4: 1.5, 8: 2.5, 16: 5.0})  # 3 accepted then a miss, every time
    assert mid.choose() == 4


def _explored(sizer, blocks: int, share: float = 0.02) -> list[int]:
    """The sizes ``sizer`` chooses for ``blocks`` blocks, each observed at its curve's cost, nothing accepted."""
    sizer.explore_share = share
    return _timed(sizer, sizer.costs, accepts=0, blocks=blocks)


def test_probing_takes_its_share_of_time_whatever_a_longer_block_costs():
    cheap_sizer, dear_sizer = _sizer(0, {1: 1.0, 16: 1.1}), _sizer(0, {1: 1.0, 16: 16.0})
    cheap = _explored(cheap_sizer, 200)  # a full block costs 0.1 more than the choice
    dear = _explored(dear_sizer, 200)  # ... 15 more
    for sizer, sizes, extra in ((cheap_sizer, cheap, 0.1), (dear_sizer, dear, 15.0)):
        spent = sum(1.0 + (extra if s == 16 else 0.0) for s in sizes)
        worth = sizer.chain.expected_tokens(16)[15] - 1.0  # the tokens a probe is expected to add, in blocks of 1
        assert sizes.count(16) * (extra - worth) <= 0.02 * spent + extra  # at most its share, give or take one block
    assert cheap.count(16) >= 20 and dear.count(16) == 0  # where it is cheap it explores often; never at 15x
    assert _explored(_sizer(0, {1: 1.0, 16: 16.0}), 1000).count(16) == 1  # ... until 750 blocks paid for one
    assert 16 not in _explored(_sizer(0, {1: 1.0, 16: 1.1}), 200, share=0)  # 0: never


def test_a_probe_from_the_shortest_choice_is_one_measured_size_longer():
    sizes = _explored(_sizer(0, {1: 1.0, 2: 1.2, 4: 1.5, 8: 2.5, 16: 5.0}), 300)
    assert set(sizes) == {1, 2}  # nothing accepts: blocks of 1, and now and then a block of 2, never longer
    assert 5 <= sizes.count(2) <= 40


def _replay(sizer, accepts_from: int, blocks: int) -> list[int]:
    """The sizes ``sizer`` chooses when nothing is accepted before block ``accepts_from`` and every
    candidate is after it (blocks timed at the curve's cost)."""
    sizes = []
    for i in range(blocks):
        size = sizer.choose()
        accepted = size - 1 if i >= accepts_from else 0
        sizer.observe(
            Block(
                [0] * size, drafted=size - 1, accepted=accepted, verify_s=sizer.costs(size), total_s=sizer.costs(size)
            )
        )
        sizes.append(size)
    return sizes


def test_a_hard_opening_does_not_keep_a_request_autoregressive():
    # MLX's CPU costs: a block of 1 is the best choice while nothing is accepted, and one of 1 drafts
    # nothing, so only probes and forgetting the opening can bring the drafter back
    costs = {1: 7.8, 2: 10.35, 4: 14.0, 8: 22.5, 16: 38.5}
    sizes = _replay(BlockSizer(CostCurve(dict(costs)), initial=8), accepts_from=20, blocks=120)
    assert sizes[:4] == [8] * 4 and 1 in sizes[4:20]  # the trained size first, then the opening's misses
    # back to long blocks once they accept; a block in five re-times 8 (a probe one size shorter: its 8 tokens are
    # worth 19.25 of 16's 38.5 ms, so at 22.5 ms it costs 3.25, and 2 % of four blocks of 16 pays for one)
    assert max(sizes[20:]) == 16 and sizes[-20:].count(16) == 16 and set(sizes[-20:]) == {8, 16}
    assert sizes.index(16) < 45  # a probe accepted whole is followed by another: the climb takes a few blocks


def test_old_blocks_weigh_less_but_never_melt_to_the_prior():
    chain = AcceptanceChain()
    for _ in range(100):
        chain.observe(drafted=3, accepted=0, forget=0.95, floor=8.0)
    assert chain.reached[0] == pytest.approx(20.0, abs=0.2)  # 1 / (1 - 0.95) blocks' worth
    for _ in range(200):  # blocks of 1 observe nothing: the evidence shrinks to the floor and stays
        chain.observe(drafted=0, accepted=0, forget=0.95, floor=8.0)
    assert 8.0 <= chain.reached[0] < 8.5 and chain.rates()[0] < 0.1


def test_observe_learns_cost_and_acceptance_from_blocks():
    s = BlockSizer(CostCurve({4: 1.0}), explore_share=0)
    s.observe(Block([1, 2, 3, 4], drafted=3, accepted=3, draft_s=0.5, verify_s=0.5, total_s=1.0))
    assert s.chain.reached[:3] == [1, 1, 1]
    assert s.costs(4) == pytest.approx(1.0)
    s.observe(
        Block([1, 2, 3], drafted=2, accepted=2, draft_s=0.1, verify_s=0.1, total_s=0.2)
    )  # cut short by max_tokens
    assert 3 not in s.costs.seconds and s.chain.reached[:3] == [
        2,
        2,
        1,
    ]  # its acceptance counts, its size is not a choice


@pytest.mark.parametrize("wrong_every", [None, 2, 5])
def test_adaptive_blocks_are_lossless_and_vary(wrong_every):
    v = ScriptedVerifier(3, CONT)
    sizer = BlockSizer(CostCurve({1: 1.0, 2: 1.05, 4: 1.1, 8: 1.2, 16: 1.4}), explore_share=0.5)
    g = run(v, ScriptedDrafter(v, wrong_every=wrong_every), [1, 2, 3], max_tokens=150, block_size=sizer)
    assert g.token_ids == CONT[:150]
    sizes = {b.drafted + 1 for b in g.blocks[1:]}
    assert len(sizes) > 1 and max(sizes) <= 16


def test_policy_carries_acceptance_across_requests_but_caps_its_weight():
    policy = AdaptivePolicy(CostCurve({1: 1.0, 16: 1.2}), carry=8)
    first = policy.sizer()
    for _ in range(100):
        first.observe(Block([0] * 16, drafted=15, accepted=15, total_s=1.0))
    policy.learn(first)
    second = policy.sizer()
    assert max(second.chain.reached) == pytest.approx(8)  # carried, capped at `carry` blocks
    assert second.chain.rates()[0] > 0.8


def test_unreached_positions_inherit_the_rate_before_them_not_the_pooled_one():
    chain = AcceptanceChain()
    for _ in range(100):  # blocks of 4: the first candidate is a coin flip, once past it everything accepts
        chain.observe(drafted=3, accepted=3)
        chain.observe(drafted=3, accepted=0)
    rates = chain.rates()
    assert rates[0] == pytest.approx(0.5, abs=0.02) and rates[2] > 0.95
    assert rates[3] == rates[2] == rates[15]  # never reached: the last reached position's rate
    assert rates[15] > chain.pooled() + 0.15  # the pooled rate would have said longer blocks don't pay
    sizer = BlockSizer(CostCurve({1: 1.0, 4: 1.2, 16: 2.0}), chain, explore_share=0)
    assert sizer.choose() == 16


class _ColdFirstCall:
    """A session whose first verify at each size is slow (a cold shape), every later one fast."""

    def __init__(self, clock):
        self.clock, self.seen = clock, set()

    def prefill(self, prompt):
        return 1, None

    def decide(self, last, draft):
        size = len(draft.tokens) + 1
        self.clock.t += (1.0 if size not in self.seen else 0.0) + 0.01 * size
        self.seen.add(size)
        return Verdict(accepted=0, next_token=2, aux=None)

    def close(self):
        pass


def test_measure_costs_times_warm_shapes():
    import types

    from kakeya.orchestrator.decode import block_sizing as adaptive

    clock = types.SimpleNamespace(t=0.0)
    session = _ColdFirstCall(clock)
    verifier = types.SimpleNamespace(info=types.SimpleNamespace(vocab_size=100), open_session=lambda *_: session)
    drafter_session = types.SimpleNamespace(draft=lambda aux, last, n: Draft(tuple([3] * (n - 1))), close=lambda: None)
    drafter = types.SimpleNamespace(open_session=lambda *_: drafter_session)
    curve = adaptive.measure_costs(verifier, drafter, sizes=(1, 4, 16), repeats=1, clock=lambda: clock.t)
    assert curve.seconds == pytest.approx({1: 0.01, 4: 0.04, 16: 0.16})  # no first-call second in any size


def test_choice_is_among_measured_sizes_and_the_largest_allowed():
    s = _sizer(15, {1: 1.0, 4: 1.5, 8: 1.6})  # everything accepted: longer is better, 16 interpolated (2.0)
    assert s.candidates() == [1, 4, 8, 16]
    s.max_size = 12
    assert s.candidates() == [1, 4, 8, 12] and s.choose() == 12
    assert BlockSizer(CostCurve(), explore_share=0, max_size=4).candidates() == [1, 2, 3, 4]  # nothing measured yet


def test_noisy_timings_of_the_chosen_size_leave_the_others_relative_cost_alone():
    import random

    noise = random.Random(1)
    c = CostCurve({8: 14.5, 16: 16.0})
    for _ in range(600):  # a busy machine: only 16 is chosen, its timings spread 30 % either way around 16.0
        c.observe(16, 16.0 * noise.lognormvariate(0, 0.3))
    # nothing was learnt about 8 relative to 16: the ratio holds (it drifted to 1.17, 16 priced below 8, when
    # each timing multiplied the curve by its ratio: noise alone made the chosen size look cheaper for good)
    assert c(8) / c(16) == pytest.approx(14.5 / 16.0, rel=0.04)


def _timed(sizer, true_cost, accepts: int, blocks: int) -> list[int]:
    """The sizes ``sizer`` chooses when each block accepts ``accepts`` candidates (or all of a shorter one) and is
    timed at ``true_cost(size)`` (which its curve may have wrong)."""
    sizes = []
    for _ in range(blocks):
        size = sizer.choose()
        sizer.observe(
            Block(
                [0] * size,
                drafted=size - 1,
                accepted=min(accepts, size - 1),
                verify_s=true_cost(size),
                total_s=true_cost(size),
            )
        )
        sizes.append(size)
    return sizes


def test_a_size_calibrated_too_dear_is_retimed_and_chosen_once_its_cost_shows():
    true_costs = {4: 1.0, 8: 1.2, 16: 1.6}  # 7 candidates accepted, then a miss: 8 commits as much as 16, cheaper
    chain = AcceptanceChain()
    for _ in range(50):
        chain.observe(drafted=15, accepted=7)
    sizer = BlockSizer(CostCurve({4: 1.0, 8: 1.8, 16: 1.6}), chain)  # start-up calibration priced 8 50 % too dear
    sizes = _timed(sizer, true_costs.__getitem__, accepts=7, blocks=400)
    assert sizes[:5] == [16] * 5  # the curve's choice first ...
    assert sizes[-50:].count(8) > 40  # ... until probes one size shorter re-timed 8 (never re-timed before: 16 stuck)
    assert {4, 16} < set(sizes[-100:])  # from 8, probes take turns: one size longer, one shorter


def test_measure_costs_spreads_a_burst_over_every_size():
    import types

    from kakeya.orchestrator.decode import block_sizing as adaptive

    clock = types.SimpleNamespace(t=0.0, calls=0)

    class Session(_ColdFirstCall):
        def decide(self, last, draft):
            clock.calls += 1
            clock.t += 0.01 * (len(draft.tokens) + 1) + (1.0 if 7 <= clock.calls <= 9 else 0.0)  # a neighbour's burst
            return Verdict(accepted=0, next_token=2, aux=None)

    session = Session(clock)
    verifier = types.SimpleNamespace(info=types.SimpleNamespace(vocab_size=100), open_session=lambda *_: session)
    drafter_session = types.SimpleNamespace(draft=lambda aux, last, n: Draft(tuple([3] * (n - 1))), close=lambda: None)
    drafter = types.SimpleNamespace(open_session=lambda *_: drafter_session)
    curve = adaptive.measure_costs(verifier, drafter, sizes=(1, 4, 16), repeats=3, clock=lambda: clock.t)
    # the burst lasts three forwards: timing each size's repeats in a row put all three on 4 (priced at 1.04)
    assert curve.seconds == pytest.approx({1: 0.01, 4: 0.04, 16: 0.16})
