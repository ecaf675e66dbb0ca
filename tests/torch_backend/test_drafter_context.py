"""The torch drafter's context buffers: preallocated, grown geometrically, block K/V written in place."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from kakeya.drafter.backend import extend
from kakeya.drafter.session import WARM_BLOCK_SIZES, TorchDrafter
from kakeya.drafter.torch_backend.load import load_dflash_torch

STEPS = [13, 1, 5, 0, 2, 1, 8, 3, 30, 1, 4, 7, 50, 2]


@pytest.fixture(scope="module")
def mixed(tiny, tmp_path_factory):
    """The tiny draft with a sliding layer (window 8) in front of a full one, causal blocks."""
    d = tmp_path_factory.mktemp("torch_ctx_mixed") / "draft"
    shutil.copytree(tiny.draft, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(layer_types=["sliding_attention", "full_attention"], sliding_window=8, use_sliding_window=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return load_dflash_torch(d, tiny.target, "cpu", "float32")


def _aux(model, seed=0):
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.standard_normal((sum(STEPS), model.config.aux_width)).astype(np.float32))


def test_growth_keeps_contents_and_the_sliding_buffer_keeps_its_storage(mixed):
    aux = _aux(mixed)
    small, big = mixed.make_cache(step=2), mixed.make_cache(step=4096)
    caps, ptrs, pos = set(), set(), 0
    for i, n in enumerate(STEPS):
        extend(mixed, [small], [aux[pos : pos + n]])
        extend(mixed, [big], [aux[pos : pos + n]])
        pos += n
        block = torch.tensor([5 + i] + [mixed.config.mask_token_id] * (2 + i % 14))
        assert torch.equal(
            mixed.block_logits([(small, block.tolist())]), mixed.block_logits([(big, block.tolist())])
        ), i
        for j in range(len(mixed.layers)):
            (a, av), (b, bv) = small.view(j), big.view(j)
            assert torch.equal(a, b) and torch.equal(av, bv)
        sliding, full = small.layers
        caps.add(full.keys.shape[2])
        ptrs.add(sliding.keys.data_ptr())
    assert all(c & (c - 1) == 0 for c in caps) and len(caps) <= 1 + int(np.log2(max(caps)))  # step 2 * 2**k
    assert len(ptrs) == 1  # compacted in place: a fixed-capacity buffer a captured graph can keep
    assert small.view(0)[0].shape[2] == 7 and small.view(1)[0].shape[2] == pos


@torch.inference_mode()
def test_block_attends_over_the_same_keys_as_the_concatenation(mixed):
    aux, cache = _aux(mixed, 1), mixed.make_cache(step=4)
    extend(mixed, [cache], [aux[:21]])
    B = 8
    views = cache.plan.block(B, scratch=True)
    for layer in cache.layers:
        ck, cv = layer.visible()
        ck, cv = ck.clone(), cv.clone()
        k, v = torch.randn(1, ck.shape[1], B, ck.shape[3]), torch.randn(1, cv.shape[1], B, cv.shape[3])
        keys, values = layer.with_block(views[layer.layout], k, v)
        assert torch.equal(keys, torch.cat([ck, k], dim=2)) and torch.equal(values, torch.cat([cv, v], dim=2))
    assert cache.length == 21


def test_capacity_span_drafts_the_same(mixed):
    """A fixed-shape forward over the whole buffer plus a mask (the CUDA-graph layout) drafts the same tokens."""
    aux = _aux(mixed, 2)
    cache, pos = mixed.make_cache(step=8), 0
    for i, n in enumerate(STEPS):
        extend(mixed, [cache], [aux[pos : pos + n]])
        pos += n
        block = torch.tensor([7 + i] + [mixed.config.mask_token_id] * 7)
        a = mixed.block_logits([(cache, block.tolist())])
        b = mixed.block_logits([(cache, block.tolist())], span="capacity")
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        assert float((a - b).abs().max()) < 1e-4  # the parity tolerance: summed in another order


def test_torch_warm_up_drafts_every_block_size(tiny):
    drafter = TorchDrafter(tiny.draft, tiny.target, "cpu", "float32")
    seen = []
    block_logits = drafter.model.block_logits
    drafter.model.block_logits = lambda blocks: seen.extend(len(b) for _, b in blocks) or block_logits(blocks)
    assert drafter.warm_up(ctx=16) > 0
    assert seen == list(WARM_BLOCK_SIZES)
