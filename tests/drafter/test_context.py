"""The context-cache plan (``context.py``): rows kept across growth, masks, and the MLX arrays that follow it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kakeya.core.request import MAX_BLOCK_SIZE
from kakeya.drafter.backend import extend
from kakeya.drafter.context import ContextLayout, block_mask
from kakeya.drafter.local import MLXDrafter
from kakeya.drafter.mlx_backend.model import load_dflash_mlx
from kakeya.drafter.session import WARM_BLOCK_SIZES

from .conftest import random_aux


class Rows:
    """A host model of one layer buffer: which absolute position each row holds (-1: nothing)."""

    def __init__(self):
        self.pos = np.full(0, -1)

    def resize(self, r):
        if r is None:
            return
        new = np.full(r.capacity, -1)
        new[: r.count] = self.pos[r.src : r.src + r.count]
        self.pos = new

    def append(self, plan, first_pos, n_new):
        self.resize(plan.resize)
        self.pos[plan.dst : plan.dst + plan.n] = np.arange(first_pos, first_pos + n_new)[plan.skip :]

    def block(self, view, n_block):
        self.resize(view.resize)
        self.pos[view.stop : view.stop + n_block] = -7  # block K/V: scratch, never context


@pytest.mark.parametrize("keep,step", [(None, 1), (None, 4), (7, 1), (7, 3), (31, 16)])
def test_growth_keeps_the_visible_positions(keep, step):
    layout, rows, length = ContextLayout(keep, step), Rows(), 0
    caps = []
    rng = np.random.default_rng(0)
    for i in range(120):
        n = int(rng.choice([0, 1, 1, 2, 3, 5, 8, 13, 40]))
        rows.append(layout.append(n), length, n)
        length += n
        if i % 3 == 0 and length:
            B = int(rng.integers(2, 17))
            rows.block(layout.block(B, scratch=True), B)
        caps.append(layout.capacity)
        assert len(rows.pos) == layout.capacity
        want = np.arange(max(0, length - (keep or length)), length)
        assert rows.pos[layout.start : layout.stop].tolist() == want.tolist(), i
    if keep is None:  # geometric: step * 2**k, O(log n) reallocations
        assert all(c // step & (c // step - 1) == 0 for c in caps if c)
        assert len(set(caps)) <= 2 + int(np.log2(max(caps) / step))
    else:  # fixed once the window is full: compaction happens in place
        assert len(set(caps[caps.index(max(caps)) :])) == 1 and max(caps) == keep + max(step, MAX_BLOCK_SIZE)


def _old_rule(n_ctx, n_block, is_causal, window):
    """The mask the backends built before the plan existed (block_mask of dflash_mlx / dflash_torch)."""
    need_ctx = window is not None and n_ctx + n_block - 1 >= window
    need_block = is_causal or (window is not None and n_block > window)
    if not (need_ctx or need_block):
        return None
    qi, kj, kb = np.arange(n_block)[:, None], np.arange(n_ctx)[None], np.arange(n_block)[None]
    ctx = (qi + n_ctx - kj) < window if window is not None else np.ones((n_block, n_ctx), bool)
    vis = np.ones((n_block, n_block), bool)
    if is_causal:
        vis &= kb <= qi
    if window is not None:
        vis &= np.abs(qi - kb) < window
    return np.concatenate([ctx, vis], axis=1)


@pytest.mark.parametrize("keep,is_causal", [(None, False), (None, True), (7, True), (7, False), (3, True)])
def test_masks_match_the_concatenation(keep, is_causal):
    window = None if keep is None else keep + 1
    layout = ContextLayout(keep, step=4)
    for n, B in [(1, 2), (2, 8), (5, 16), (1, 4), (9, 3), (30, 16), (2, 2)]:
        layout.append(n)
        valid = layout.block(B, scratch=True)
        m = block_mask(valid, B, is_causal=is_causal, window=window)
        old = _old_rule(valid.n_ctx, B, is_causal, window)
        assert (m is None and old is None) or (m == old).all()
        assert valid.stop - valid.start == valid.n_ctx


def test_bad_plans_raise_value_error():
    with pytest.raises(ValueError, match="step"):
        ContextLayout(None, step=0)


@pytest.mark.parametrize("name", ["full", "mixed"])
def test_mlx_growth_keeps_contents(pairs, name):
    """A cache that reallocates and compacts often holds the same visible K/V, bit for bit."""
    model = load_dflash_mlx(pairs[name].draft, pairs[name].target)
    small, big = model.make_cache(step=1), model.make_cache(step=4096)
    aux = random_aux(200, model.config.aux_width, seed=3)
    pos = 0
    for n in [3, 1, 0, 17, 2, 9, 40, 1, 5, 60, 2]:
        extend(model, [small], [aux[pos : pos + n]])
        extend(model, [big], [aux[pos : pos + n]])
        pos += n
        for i in range(len(model.layers)):
            (a, av), (b, bv) = small.view(i), big.view(i)
            assert mx.array_equal(a, b).item() and mx.array_equal(av, bv).item()
        block = mx.array([9 + pos] + [model.config.mask_token_id] * 7)
        assert mx.array_equal(
            model.block_logits([(small, block.tolist())]), model.block_logits([(big, block.tolist())])
        ).item()
    assert small.length == big.length == pos


def test_mlx_warm_up_drafts_every_block_size(pairs):
    drafter = MLXDrafter(pairs["mixed"].draft, pairs["mixed"].target)
    seen = []
    block_logits = drafter.model.block_logits
    drafter.model.block_logits = lambda blocks: seen.extend(len(b) for _, b in blocks) or block_logits(blocks)
    try:
        assert drafter.warm_up() > 0
    finally:
        del drafter.model.block_logits
    assert seen == list(WARM_BLOCK_SIZES)
