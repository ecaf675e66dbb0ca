"""Torch verifier logits == transformers' Gemma4ForCausalLM and == the MLX verifier (float32).

Every comparison goes through a real :class:`LocalVerifierSession`: chunked prefill,
then blocks of 1..16 positions of which only a prefix is kept (the rest is
garbage and gets trimmed), for ~200 positions -- the 32-window sliding ring
wraps more than 4 times and rolls back after most blocks. The logits the
session's ``greedy`` sees at every kept position must equal the reference's
logits for the same committed sequence.
"""

from __future__ import annotations

import numpy as np
import pytest

from kakeya.core.request import CachePolicy
from kakeya.verifier.session import LocalVerifierSession

from .conftest import AUX_LAYERS

HF_ATOL = 5e-4  # observed <= ~2e-4 on logits of magnitude ~15-30: float32 reduction order only
MLX_ATOL = 5e-4  # observed ~1e-4: different kernels (fast.rope, fused SDPA)
SEQ_LEN = 200


class Recording:
    """A backend target whose ``greedy`` also records the logits it decided on."""

    def __init__(self, target):
        self.target = target
        self.rows: list[np.ndarray] = []

    def __getattr__(self, name):
        attr = getattr(self.target, name)
        if name == "verify_static":  # torch: the static verify step decides without calling greedy

            def verify_static(ids, cache, aux_layers, plan):
                out = attr(ids, cache, aux_layers, plan)
                self.rows.append(to_numpy(cache.last_logits[: len(ids)]))
                return out

            return verify_static
        return attr

    def greedy(self, hidden):
        self.rows.append(to_numpy(self.target.logits(hidden)[0]))
        return self.target.greedy(hidden)


def to_numpy(x) -> np.ndarray:
    if hasattr(x, "detach"):
        return x.detach().float().cpu().numpy()
    return np.asarray(x).astype(np.float32)


def sequence(vocab: int, n: int = SEQ_LEN, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return [2] + [int(t) for t in rng.integers(5, vocab, n - 1)]


def session_logits(target, seq, prefill: int, policy=CachePolicy(), seed: int = 0) -> np.ndarray:
    """Logits after positions ``prefill-1 .. len(seq)-1``, decoded through verify/commit with trims."""
    rec = Recording(target)
    s = LocalVerifierSession(rec, AUX_LAYERS, policy)
    s.prefill(seq[:prefill])
    rows = {prefill - 1: rec.rows[-1][0]}
    rng = np.random.default_rng(seed)
    pos, trims = prefill, 0
    while pos < len(seq):
        k = int(rng.choice([1, 2, 3, 5, 8, 16]))
        j = min(int(rng.integers(1, k + 1)), len(seq) - pos)
        garbage = [int(t) for t in rng.integers(5, target.args.vocab_size, k - j)]
        s.verify(seq[pos : pos + j] + garbage)
        for r in range(j):
            rows[pos + r] = rec.rows[-1][r]
        aux = s.commit(j)
        assert aux.shape[0] == j
        trims += k > j
        pos += j
    assert trims > (len(seq) - prefill) // 20  # rollback really happened, many times after the ring wrapped
    return np.stack([rows[i] for i in range(prefill - 1, len(seq))])


def hf_logits(target_dir, seq) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([seq])).logits[0].numpy()


def _check(mine: np.ndarray, ref: np.ndarray, atol: float, what: str) -> None:
    assert mine.shape == ref.shape, what
    err = float(np.abs(mine - ref).max())
    assert err <= atol, f"{what}: max |logit diff| {err:.3g} > {atol}"
    assert (mine.argmax(-1) == ref.argmax(-1)).all(), f"{what}: greedy choice differs"


def _load_torch(path):
    from kakeya.verifier.torch_backend.target import TargetTorch

    return TargetTorch.load(path, "cpu", "float32")


@pytest.fixture(scope="module")
def targets(tiny, tiny_moe, features_target, torch_target):
    return {
        "dense": (tiny.target, torch_target),
        "moe": (tiny_moe.target, _load_torch(tiny_moe.target)),
        "features": (features_target, _load_torch(features_target)),
    }


@pytest.mark.parametrize("name,prefill", [("dense", 20), ("dense", 45), ("moe", 20), ("features", 12)])
def test_logits_match_transformers(targets, name, prefill):
    path, target = targets[name]
    seq = sequence(target.args.vocab_size)
    assert target.args.sliding_window * 4 < SEQ_LEN
    ref = hf_logits(path, seq)[prefill - 1 :]
    _check(session_logits(target, seq, prefill), ref, HF_ATOL, f"{name} vs transformers")


@pytest.mark.parametrize(
    "name,policy",
    [
        ("dense", CachePolicy()),
        ("moe", CachePolicy()),
        ("features", CachePolicy()),
        ("dense", CachePolicy("sink-window", sink=4, window=20, slack=16)),
    ],
    ids=["dense", "moe", "features", "dense-sink4-window20"],
)
def test_logits_match_mlx_verifier(targets, name, policy):
    from kakeya.verifier.mlx_backend.target import TargetMLX

    path, target = targets[name]
    seq = sequence(target.args.vocab_size, seed=1)
    mine = session_logits(target, seq, 24, policy, seed=1)
    theirs = session_logits(TargetMLX.load(path), seq, 24, policy, seed=1)
    _check(mine, theirs, MLX_ATOL, f"{name} vs MLX ({policy.kind})")


def test_multimodal_names_load_the_same_model(targets, features_mm_target):
    _, plain = targets["features"]
    mm = _load_torch(features_mm_target)
    seq = sequence(plain.args.vocab_size, n=60, seed=2)
    _check(session_logits(mm, seq, 10, seed=2), session_logits(plain, seq, 10, seed=2), 0.0, "multimodal prefix")


def test_aux_is_the_decoder_layer_outputs(tiny, torch_target):
    """Aux of the verify forward == transformers' hidden_states after layers 1 and 4."""
    import torch
    from transformers import AutoModelForCausalLM

    seq = sequence(torch_target.args.vocab_size, n=50, seed=3)
    s = LocalVerifierSession(torch_target, AUX_LAYERS, CachePolicy())
    _, aux0 = s.prefill(seq[:30])
    s.verify(seq[30:38] + [7, 8])
    aux1 = s.commit(8)
    mine = torch.cat([aux0, aux1]).numpy()
    hf = AutoModelForCausalLM.from_pretrained(tiny.target, dtype=torch.float32).eval()
    with torch.no_grad():
        hs = hf(torch.tensor([seq[:38]]), output_hidden_states=True).hidden_states
    ref = torch.cat([hs[i + 1][0] for i in AUX_LAYERS], dim=-1).numpy()
    assert mine.shape == (38, len(AUX_LAYERS) * torch_target.args.hidden_size)
    assert np.abs(mine - ref).max() <= 1e-4
