"""Incremental context K/V cache == context recomputed from scratch; session behaviour."""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest

from kakeya.core.request import MAX_BLOCK_SIZE
from kakeya.drafter.backend import extend
from kakeya.drafter.context import BlockView, block_mask
from kakeya.drafter.local import MLXDrafter
from kakeya.drafter.mlx_backend.model import load_dflash_mlx

from .conftest import random_aux


@pytest.fixture
def model(pair):
    return load_dflash_mlx(pair.draft, pair.target)


def _block(model, last, size):
    return mx.array([last] + [model.config.mask_token_id] * (size - 1), dtype=mx.int32)


@pytest.mark.parametrize("step", [4, 256])
def test_incremental_equals_scratch(model, step):
    sizes = [int(s) for s in np.random.default_rng(7).integers(1, 20, size=24)]
    sizes[3:6] = [1, 1, 1]
    aux = random_aux(sum(sizes), model.config.aux_width, seed=8)
    cache, pos = model.make_cache(step=step), 0
    for i, n in enumerate(sizes):
        extend(model, [cache], [aux[pos : pos + n]])
        pos += n
        block = _block(model, (31 * i) % 1000 + 5, 2 + i % 7)
        scratch = model.make_cache()
        extend(model, [scratch], [aux[:pos]])
        a, b = model.block_logits([(cache, block.tolist())]), model.block_logits([(scratch, block.tolist())])
        assert float(mx.abs(a - b).max()) < 1e-5, f"step {i}"
        assert mx.array_equal(mx.argmax(a, -1), mx.argmax(b, -1)).item()
        assert cache.length == scratch.length == pos


def test_sliding_buffers_stay_bounded(pairs):
    pair = pairs["mixed"]
    model = load_dflash_mlx(pair.draft, pair.target)
    keep = model.config.sliding_window - 1
    cache = model.make_cache(step=16)
    aux = random_aux(300, model.config.aux_width, seed=9)
    for i in range(0, 300, 3):
        extend(model, [cache], [aux[i : i + 3]])
    mx.eval(cache.state)
    for t, layer in zip(model.config.layer_types, cache.layers):
        k, _ = layer.visible()
        if t == "sliding_attention":
            assert k.shape[2] == keep and layer.keys.shape[2] <= keep + max(16, MAX_BLOCK_SIZE)
        else:
            assert k.shape[2] == 300
    # a sliding layer's visible keys are exactly the last `keep` positions' keys
    full = model.context_kv([aux], [0])[0]
    for (k_full, v_full), t, i in zip(full, model.config.layer_types, itertools.count()):
        if t == "sliding_attention":
            k, v = cache.view(i)
            assert mx.allclose(k, k_full[..., -keep:, :], atol=1e-6).item()
            assert mx.allclose(v, v_full[..., -keep:, :], atol=1e-6).item()


def test_session_draft_matches_model(pair):
    drafter = MLXDrafter(pair.draft, pair.target)
    assert drafter.block_size == pair.variant.block_size
    model = drafter.model
    s = drafter.open_session()
    aux = random_aux(60, model.config.aux_width, seed=10)
    pos = 0
    for i, (n, bs) in enumerate([(20, 8), (3, 8), (1, 4), (5, 1), (2, 16), (4, 2), (25, 8)]):
        out = s.draft(aux[pos : pos + n], 50 + i, bs)
        pos += n
        scratch = model.make_cache()
        extend(model, [scratch], [aux[:pos]])
        assert out.proposal is None
        if bs == 1:
            assert out.tokens == ()  # but the context still grew
        else:
            want = mx.argmax(model.block_logits([(scratch, _block(model, 50 + i, bs).tolist())]), axis=-1).tolist()
            assert list(out.tokens) == want and len(out.tokens) == bs - 1
            assert all(isinstance(t, int) for t in out.tokens)
        st = s.stats()
        assert st.context_len == pos
        assert st.cache_bytes > 0
    s.close()
    with pytest.raises(RuntimeError):
        s.draft(aux[:1], 1, 4)


def test_sessions_are_independent(pairs):
    pair = pairs["full"]
    drafter = MLXDrafter(pair.draft, pair.target)
    aux = random_aux(30, drafter.model.config.aux_width, seed=11)
    a, b = drafter.open_session(), drafter.open_session()
    first = a.draft(aux[:10], 7, 8)
    b.draft(aux[10:30], 9, 8)
    again = drafter.open_session().draft(aux[:10], 7, 8)
    assert first == again
    assert a.stats().context_len == 10 and b.stats().context_len == 20


def _rule(n_ctx, n_block, is_causal, window):
    """Brute force over absolute positions (context at C-n_ctx.., block at C..)."""
    C = 1000
    keys = [C - n_ctx + j for j in range(n_ctx)] + [C + j for j in range(n_block)]
    m = np.zeros((n_block, n_ctx + n_block), bool)
    for i in range(n_block):
        q = C + i
        for j, k in enumerate(keys):
            ok = True
            if j >= n_ctx and is_causal:
                ok &= k <= q
            if window is not None:
                ok &= abs(q - k) < window
            m[i, j] = ok
    return m


@pytest.mark.parametrize(
    "n_ctx,n_block,is_causal,window",
    [
        (0, 8, False, None),
        (5, 8, True, None),
        (7, 8, True, 8),
        (3, 8, False, 8),
        (7, 16, False, 8),
        (7, 16, True, 8),
        (20, 4, False, 32),
        (31, 8, True, 32),
    ],
)
def test_block_mask_rule(n_ctx, n_block, is_causal, window):
    view = BlockView(None, n_ctx, 0, n_ctx)
    m = block_mask(view, n_block, is_causal=is_causal, window=window)
    want = _rule(n_ctx, n_block, is_causal, window)
    got = np.ones_like(want) if m is None else np.array(m)
    assert (got == want).all()


def test_local_drafter_endpoint(pairs):
    from kakeya.drafter.loader import local_drafter

    p = pairs["full"]
    d = local_drafter(p.draft, p.target, "mlx")
    assert d.block_size == p.variant.block_size
    assert isinstance(MLXDrafter(d.model), MLXDrafter)
    s = d.open_session()
    assert len(s.draft(random_aux(5, d.model.config.aux_width), 3, d.block_size).tokens) == d.block_size - 1
