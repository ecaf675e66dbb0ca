"""A grammar's masks cross to the device packed (llguidance's int32 words, 32 tokens each) and are expanded
there: each backend's ``restrict`` keeps exactly the allowed tokens' logits and sets the rest to -inf."""

from __future__ import annotations

import numpy as np
import pytest

from kakeya.core.constraints import Constraint, Grammar, tokenizer, unpack


def _packed(allowed: np.ndarray) -> np.ndarray:
    words = (allowed.shape[1] + 31) // 32
    padded = np.zeros((allowed.shape[0], words * 32), bool)
    padded[:, : allowed.shape[1]] = allowed
    return np.packbits(padded, axis=-1, bitorder="little").view(np.int32)


def _cases():
    rng = np.random.default_rng(3)
    vocab = 1026  # not a multiple of 32: the last word is partly padding
    allowed = rng.random((4, vocab)) < 0.3
    allowed[1] = False
    allowed[1, [0, 31, 32, 1025]] = True  # word edges, the sign bit
    allowed[2] = True
    logits = rng.standard_normal((4, vocab)).astype(np.float32)
    return allowed, logits


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_restrict_expands_the_packed_rows_on_the_device(backend):
    allowed, logits = _cases()
    bits = _packed(allowed)
    assert (unpack(bits, allowed.shape[1]) == allowed).all()
    if backend == "torch":
        import torch

        from kakeya.backends.torch import sampling

        got = sampling.restrict(torch.from_numpy(logits), bits).numpy()
    else:
        mx = pytest.importorskip("mlx.core")
        from kakeya.backends.mlx import sampling

        got = np.array(sampling.restrict(mx.array(logits), bits))
    assert (got == np.where(allowed, logits, -np.inf)).all()


def test_a_grammars_bitmask_is_its_masks_packed(engine):
    info = engine.verifier.info
    tok = tokenizer(engine.codec.tokenizer_json, info.vocab_size, info.eos_token_ids[:1])
    g = Grammar(Constraint("regex", "[0-9]+x").grammar(), tok)
    one = engine.codec.encode("1")[-1]
    bits = g.bitmask([one, one])
    assert bits.dtype == np.int32 and bits.shape == (3, (info.vocab_size + 31) // 32)
    rows = unpack(bits, info.vocab_size)
    assert (g.bitmask([one, one]) == bits).all() and 0 < rows[0].sum() < info.vocab_size  # the state left as it was
