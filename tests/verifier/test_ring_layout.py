"""The ring layout against a brute-force model of what each query must see."""

import numpy as np
import pytest

from kakeya.core.request import CachePolicy
from kakeya.verifier.layout import RingLayout


def expected_visible(q: int, sink: int, window: int) -> set[int]:
    return {p for p in range(q + 1) if p < sink or p > q - window}


def simulate(layout: RingLayout, steps, seed=0):
    """Drive plan/apply/trim like a session would; check every query's visible set."""
    # slots -> position the brute-force model says is stored (None: empty)
    for n_new, n_trim in steps:
        start = layout.offset
        plan = layout.plan(n_new)
        if plan.in_place:
            key_pos = layout._after[: plan.used]
        else:
            key_pos = np.concatenate([layout.positions[: plan.used], np.arange(start, start + n_new)])
        for row, q in enumerate(range(start, start + n_new)):
            seen = sorted(int(p) for p in key_pos[plan.mask[row]])
            assert seen == sorted(expected_visible(q, layout.sink, layout.window)), (q, seen)
        layout.applied()
        layout.trim(n_trim)
        assert layout.offset == start + n_new - n_trim


@pytest.mark.parametrize("sink,window,slack", [(0, 8, 4), (0, 32, 16), (2, 8, 3), (4, 5, 16)])
def test_every_query_sees_exactly_its_window_through_wraps_and_trims(sink, window, slack):
    rng = np.random.default_rng(sink * 100 + window)
    steps = [(int(rng.integers(window, 3 * window)), 0)]  # prefill longer than the window
    for _ in range(300):
        n = int(rng.integers(1, slack + 1))
        steps.append((n, int(rng.integers(0, n + 1))))  # verify a block, trim a suffix of it
    layout = RingLayout(sink, window, slack)
    simulate(layout, steps)
    assert layout.offset > 10 * (window + slack)  # wrapped many times


def test_short_prompt_then_blocks():
    simulate(RingLayout(0, 16, 8), [(3, 0), (8, 7), (8, 0), (1, 0), (5, 5), (40, 0), (8, 3)])


def test_memory_is_bounded_by_window_plus_slack():
    layout = RingLayout(4, 32, 16)
    for _ in range(200):
        layout.plan(16)
        layout.applied()
        layout.trim(9)
    assert layout.capacity == 4 + 32 - 1 + 16
    assert layout.used <= layout.capacity


def test_trim_beyond_slack_is_refused():
    layout = RingLayout(0, 8, 4)
    layout.plan(10)
    layout.applied()
    with pytest.raises(ValueError, match="slack"):
        layout.trim(5)


def test_policy_resolution_and_errors():
    assert CachePolicy().resolve(512).window == 512
    p = CachePolicy("sink-window", sink=4, window=64).resolve(512)
    assert (p.sink, p.window) == (4, 64)
    with pytest.raises(ValueError, match="kind"):
        CachePolicy("bogus").resolve(8)


def test_trims_in_a_row_count_from_the_newest_position_written():
    """A rejected block's positions were written into the ring: trimming further back after its commit is
    exact only while everything written stays within the slack (what a prefix snapshot's trim relies on)."""
    layout = RingLayout(0, 8, 4)
    for n in (20, 4):
        layout.plan(n)
        layout.applied()
    layout.trim(3)  # a block of 4 with one kept
    assert layout.offset == 21 and layout.written == 24
    assert layout.can_trim(1) and not layout.can_trim(2)
    with pytest.raises(ValueError, match="slack"):
        layout.trim(2)
    layout.plan(2)
    layout.applied()  # the newest position written is now 22: a trim of 3 reaches 20, 4 back from 24
    assert layout.written == 24 and layout.can_trim(3) and not layout.can_trim(4)
