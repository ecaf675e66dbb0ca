"""The torch drafter's pooled context (drafter/torch_backend/batch_step.py): pages of one pool per layer kind,
grown by chunks without moving a session's rows, sliding rings of fixed pages, blocks in scratch rows."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from kakeya.backends.torch.graphs import BUCKETS, GraphOptions
from kakeya.drafter.backend import extend
from kakeya.drafter.local import TorchDrafter
from kakeya.drafter.session import WARM_BLOCK_SIZES
from kakeya.drafter.torch_backend.batch_step import DraftPool, PooledContext
from kakeya.drafter.torch_backend.load import load_dflash_torch

STATIC_CPU = GraphOptions(capture=False, buckets=BUCKETS, static_extent=True)

STEPS = [13, 1, 5, 0, 2, 1, 8, 3, 30, 1, 4, 7, 50, 2]


@pytest.fixture(scope="module")
def mixed_dir(tiny, tmp_path_factory):
    """The tiny draft with a sliding layer (window 8) in front of a full one, causal blocks."""
    d = tmp_path_factory.mktemp("torch_ctx_mixed") / "draft"
    shutil.copytree(tiny.draft, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(layer_types=["sliding_attention", "full_attention"], sliding_window=8, use_sliding_window=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture
def mixed(mixed_dir, tiny):
    return load_dflash_torch(mixed_dir, tiny.target, "cpu", "float32")


def _aux(model, seed=0):
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.standard_normal((sum(STEPS), model.config.aux_width)).astype(np.float32))


def _expected_view(model, aux, j: int):
    """Layer ``j``'s visible context K/V of ``aux``'s rows at positions 0..: the projection alone."""
    (kv,) = model.context_kv([aux], [0])
    k, v = kv[j]
    if model.config.layer_types[j] == "sliding_attention":
        keep = model.config.sliding_window - 1
        k, v = k[:, :, -keep:], v[:, :, -keep:]
    return k, v


def test_pool_growth_keeps_every_row_and_the_ring_keeps_its_pages(mixed):
    """A pool that grows (chunks of one page here) moves its tensors, never a session's rows; the
    sliding ring keeps its pages however long the context (rows a window hides are overwritten)."""
    mixed._pool = DraftPool(mixed.config, mixed.device, mixed.dtype, chunk=1)
    aux = _aux(mixed)
    cache, other = mixed.make_cache(), DraftPool(mixed.config, mixed.device, mixed.dtype).sliding
    ring, generations, pos = list(cache.ring_pages), set(), 0
    reference = PooledContext(DraftPool(mixed.config, mixed.device, mixed.dtype))  # a pool that never grows
    for i, n in enumerate(STEPS):
        extend(mixed, [cache], [aux[pos : pos + n]])
        extend(mixed, [reference], [aux[pos : pos + n]])
        pos += n
        if not n and not pos:
            continue
        for j in range(len(mixed.layers)):
            k, v = cache.view(j)
            ek, ev = _expected_view(mixed, aux[:pos], j)
            torch.testing.assert_close(k, ek, rtol=0, atol=1e-5)
            torch.testing.assert_close(v, ev, rtol=0, atol=1e-5)
        block = [5 + i] + [mixed.config.mask_token_id] * (2 + i % 14)
        a = mixed.block_logits([(cache, block)])
        with mixed.pool.stepping():  # the same block through the reference pool's tables
            b = _logits_in(mixed, reference, block)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        generations.add(mixed.pool.full.generation)
    assert cache.ring_pages == ring and len(ring) * 16 == mixed.pool.ring < pos
    assert len(generations) > 2 and mixed.pool.full.growths > 2  # the full pool grew while sessions drafted
    assert other.generation == 1


def _logits_in(model, cache, block):
    saved = model._pool
    model._pool = cache.pool
    try:
        return model.block_logits([(cache, block)])
    finally:
        model._pool = saved


@torch.inference_mode()
def test_blocks_never_write_a_sessions_context_and_blocks_of_one_cache_draft_apart(mixed):
    """A block's K/V go to the pool's scratch rows: the context shows committed positions only, so
    several blocks of one cache (a pre-draft's) draft in one step each as it does alone."""
    aux, cache = _aux(mixed, 1), mixed.make_cache()
    extend(mixed, [cache], [aux[:21]])
    before = [cache.view(j) for j in range(len(mixed.layers))]
    mask = mixed.config.mask_token_id
    blocks = [[7, mask, mask], [7, 30, 31, mask, mask, mask], [9] + [mask] * 15]
    together = mixed.block_logits([(cache, b) for b in blocks])
    alone = torch.cat([mixed.block_logits([(cache, b)]) for b in blocks])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)  # GEMMs over more rows round apart
    for j, (k, v) in enumerate(before):
        assert torch.equal(cache.view(j)[0], k) and torch.equal(cache.view(j)[1], v)
    assert cache.length == 21


def test_static_shapes_draft_the_same(mixed_dir, tiny, mixed):
    """Padded to buckets and a doubling extent (the CUDA-graph layout), blocks draft the same tokens."""
    static = load_dflash_torch(mixed_dir, tiny.target, "cpu", "float32").use_graphs(STATIC_CPU)
    aux = _aux(mixed, 2)
    a_cache, b_cache, pos = mixed.make_cache(), static.make_cache(), 0
    for i, n in enumerate(STEPS):
        block = [7 + i] + [mixed.config.mask_token_id] * 7
        ta, la = mixed.draft_step([(a_cache, aux[pos : pos + n])], [(a_cache, block)], True, True)
        tb, lb = static.draft_step([(b_cache, aux[pos : pos + n])], [(b_cache, block)], True, True)
        pos += n
        assert ta == tb and la.shape == lb.shape
        assert float((la - lb).abs().max()) < 1e-4  # the parity tolerance: summed in another order


def test_torch_warm_up_drafts_every_block_size(tiny):
    drafter = TorchDrafter(tiny.draft, tiny.target, "cpu", "float32")
    seen = []
    step = drafter.model.draft_step
    drafter.model.draft_step = lambda ext, blocks, *a, **k: (
        seen.extend(len(b) for _, b in blocks) or step(ext, blocks, *a, **k)
    )
    assert drafter.warm_up(ctx=16) > 0
    assert seen == list(WARM_BLOCK_SIZES)
