"""Parity with the dflash reference (``dflash.model_mlx.DFlashDraftModel``), float32."""

from __future__ import annotations

import math

import mlx.core as mx
import pytest
from mlx import nn

from kakeya.drafter.backend import extend
from kakeya.drafter.mlx_backend.model import load_dflash_mlx

from .conftest import HIDDEN, VOCAB, random_aux, target_config

ATOL = 1e-4


class _FakeTarget:
    """Just what the reference's ``bind`` looks up: ``embed_tokens`` and ``lm_head``."""

    def __init__(self, model):
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.embed_tokens.weight = model.target.embed["weight"]
        self.lm_head = None
        if not model.target.tied:
            self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
            self.lm_head.weight = model.target.head["weight"]


def _reference(ref_loader, pair, ours):
    ref = ref_loader(str(pair.draft))
    ref.bind(_FakeTarget(ours))
    # Our convention (Gap-B): raw embedding x input_embedding_scale.
    ref.embed_scale = pair.variant.input_embedding_scale
    return ref


def _block(v, last_token, size=None):
    size = size or v.block_size
    return mx.array([last_token] + [v.mask_token_id] * (size - 1), dtype=mx.int32)


def _assert_close(ours, theirs, where):
    assert ours.shape == theirs.shape, where
    err = float(mx.abs(ours - theirs).max())
    assert err <= ATOL, f"{where}: max |diff| {err}"
    assert mx.array_equal(mx.argmax(ours, -1), mx.argmax(theirs, -1)).item(), where


# Chunk sizes per extend step. Sliding layers avoid 1-position updates after the
# first: see test_reference_rotating_cache_quirk.
STEPS = {
    "full": [13, 1, 5, 2, 1, 8, 3, 30, 1, 1, 4, 7],
    "mixed": [13, 2, 5, 3, 8, 2, 30, 2, 4, 7, 2, 3],
}


def test_parity_with_reference_cache(pair, ref_loader):
    """Our incremental cache + block forward == reference ``__call__`` on its own cache."""
    v = pair.variant
    ours = load_dflash_mlx(pair.draft, pair.target)
    ref = _reference(ref_loader, pair, ours)
    steps = STEPS[v.name]
    aux = random_aux(sum(steps), ours.config.aux_width, seed=1)
    ref_cache, cache = ref.make_cache(), ours.make_cache()
    pos = 0
    for i, n in enumerate(steps):
        new = aux[pos : pos + n]
        pos += n
        block = _block(v, 100 + 37 * i)
        theirs = ref(block[None], new[None], ref_cache, logits_start=1)[0]
        extend(ours, [cache], [new])
        mine = ours.block_logits([(cache, block.tolist())])
        _assert_close(mine, theirs, f"step {i} (ctx {pos})")
    assert cache.length == pos


@pytest.mark.parametrize("block_size", [2, 5, 8])
def test_parity_with_reference_from_scratch(pair, ref_loader, block_size):
    """Any extend sizes (1 included) == the reference run over the whole context at once."""
    v = pair.variant
    ours = load_dflash_mlx(pair.draft, pair.target)
    ref = _reference(ref_loader, pair, ours)
    steps = [9, 1, 1, 3, 1, 12, 1, 2]
    aux = random_aux(sum(steps), ours.config.aux_width, seed=2)
    cache, pos = ours.make_cache(), 0
    for i, n in enumerate(steps):
        extend(ours, [cache], [aux[pos : pos + n]])
        pos += n
        block = _block(v, 11 * i + 5, block_size)
        theirs = ref(block[None], aux[None, :pos], ref.make_cache(), logits_start=1)[0]
        _assert_close(ours.block_logits([(cache, block.tolist())]), theirs, f"step {i} (ctx {pos})")


def test_reference_rotating_cache_quirk(pairs, ref_loader):
    """Pins a reference divergence on sliding layers (and that we follow the clean rule).

    The reference keeps sliding-layer context in a ``RotatingKVCache``; once it has
    wrapped, a 1-position update returns the keys in ROTATED order while its mask is
    built on slot indices, so block queries 1.. see the wrong context keys. Its
    from-scratch result (and ours, incremental or not) is the window rule.
    """
    pair = pairs["mixed"]
    v = pair.variant
    ours = load_dflash_mlx(pair.draft, pair.target)
    ref = _reference(ref_loader, pair, ours)
    aux = random_aux(21, ours.config.aux_width, seed=3)
    ref_cache, cache = ref.make_cache(), ours.make_cache()
    block = _block(v, 321)
    for a, b in [(0, 13), (13, 20), (20, 21)]:
        ref_incr = ref(block[None], aux[None, a:b], ref_cache, logits_start=1)[0]
        extend(ours, [cache], [aux[a:b]])
    ref_scratch = ref(block[None], aux[None, :21], ref.make_cache(), logits_start=1)[0]
    mine = ours.block_logits([(cache, block.tolist())])
    _assert_close(mine, ref_scratch, "vs reference from scratch")
    assert float(mx.abs(ref_incr - ref_scratch).max()) > 1e-2  # the reference quirk


def _gemma_target(pair):
    """A real mlx-lm gemma4_text model carrying the fixture's embed / LM head."""
    from mlx_lm.models import gemma4_text

    cfg = target_config(pair.variant.tied)
    model = gemma4_text.Model(gemma4_text.ModelArgs.from_dict(cfg))
    ours = load_dflash_mlx(pair.draft, pair.target)
    weights = [("model.embed_tokens.weight", ours.target.embed["weight"])]
    if not ours.target.tied:
        weights.append(("lm_head.weight", ours.target.head["weight"]))
    model.load_weights(weights, strict=False)
    return model, ours


def test_gap_b_embedding_convention(pair, ref_loader):
    """Gap-B: block embedding = RAW target lookup x input_embedding_scale (no sqrt(hidden)).

    The reference's MLX ``bind`` on a Gemma target multiplies by the target's
    embed_scale (sqrt(hidden)); we must not.
    """
    v = pair.variant
    target, ours = _gemma_target(pair)
    ref = ref_loader(str(pair.draft))
    ref.bind(target)
    assert math.isclose(ref.embed_scale, math.sqrt(HIDDEN) * v.input_embedding_scale, rel_tol=1e-6)

    aux = random_aux(20, ours.config.aux_width, seed=4)
    block = _block(v, 77)
    cache = ours.make_cache()
    extend(ours, [cache], [aux])
    mine = ours.block_logits([(cache, block.tolist())])
    # Our block input really is the raw row x input_embedding_scale.
    raw = ours.target.embed["weight"][block]
    assert mx.allclose(ours.target.embed_rows(block), raw).item()

    ref_bound = ref(block[None], aux[None], ref.make_cache(), logits_start=1)[0]
    assert float(mx.abs(mine - ref_bound).max()) > 1e-2  # the known divergence

    ref.embed_scale = v.input_embedding_scale  # our convention
    theirs = ref(block[None], aux[None], ref.make_cache(), logits_start=1)[0]
    _assert_close(mine, theirs, "reference with embed_scale = input_embedding_scale")


def test_parity_on_shipped_tiny_pair(ref_loader):
    """The embedded tiny checkpoint pair matches the reference too."""
    from kakeya.checkpoints.tiny import default_pair

    tiny = default_pair()
    ours = load_dflash_mlx(tiny.draft, tiny.target)
    ref = ref_loader(str(tiny.draft))

    class T:
        pass

    t = T()
    t.embed_tokens = nn.Embedding(*ours.target.embed["weight"].shape)
    t.embed_tokens.weight = ours.target.embed["weight"]
    t.lm_head = None
    if not ours.target.tied:
        t.lm_head = nn.Linear(ours.config.hidden_size, ours.target.vocab_size, bias=False)
        t.lm_head.weight = ours.target.head["weight"]
    ref.bind(t)
    ref.embed_scale = ours.config.input_embedding_scale
    aux = random_aux(40, ours.config.aux_width, seed=5)
    cache, ref_cache, pos = ours.make_cache(), ref.make_cache(), 0
    for i, n in enumerate([17, 3, 6, 2, 12]):
        block = mx.array([9 + i] + [ours.config.mask_token_id] * (ours.config.block_size - 1))
        theirs = ref(block[None], aux[None, pos : pos + n], ref_cache, logits_start=1)[0]
        extend(ours, [cache], [aux[pos : pos + n]])
        pos += n
        _assert_close(ours.block_logits([(cache, block.tolist())]), theirs, f"tiny step {i}")
