"""The torch drafter's batched step over pooled context K/V (drafter/torch_backend/batch_step.py), on a CPU.

Structure: a batched draft of 16 sessions (ragged contexts, blocks of 1..16) runs as many device
operations as one session's draft (within 10 %) and syncs with the host once. Exactness: each
session's batched draft equals its draft alone (the same greedy tokens, float32 logits within a few
ulps of their scale),
over consecutive rounds, on a full-attention drafter and on one with a sliding layer whose rings wrap.
"""

from __future__ import annotations

import collections
import json
import shutil

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kakeya.core.contract import Draft
from kakeya.drafter.local import TorchDrafter
from kakeya.drafter.session import DraftItem, draft_batch

SIZES = [1 + (5 * k) % 16 for k in range(16)]  # every block size 1..16 once: ragged rows, extensions alone


class DeviceOps(TorchDispatchMode):
    """Counts dispatched aten ops that do work: views (which launch nothing) are left out."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


@pytest.fixture(scope="module", params=["full", "mixed"])
def drafter(request, tiny, tmp_path_factory):
    """The tiny drafter (full attention), or the same with a sliding layer (window 8) in front."""
    if request.param == "full":
        return TorchDrafter(tiny.draft, tiny.target, "cpu", "float32")
    d = tmp_path_factory.mktemp("draft_pool_mixed") / "draft"
    shutil.copytree(tiny.draft, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(layer_types=["sliding_attention", "full_attention"], sliding_window=8, use_sliding_window=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return TorchDrafter(d, tiny.target, "cpu", "float32")


def _aux(drafter, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, drafter.model.config.aux_width, generator=g)


def _sessions(drafter, n: int) -> list:
    sessions = []
    for k in range(n):
        s = drafter.open_session()
        s.draft(_aux(drafter, 5 + 9 * k, k), 3, 2)  # contexts of 5 .. 140 positions: the rings wrap
        sessions.append(s)
    return sessions


def _counted(fn) -> DeviceOps:
    mode = DeviceOps()
    with mode:
        fn()
    return mode


def _syncs(monkeypatch, fn) -> list[str]:
    seen = []
    for name in ("tolist", "item", "__bool__", "cpu", "numpy"):
        orig = getattr(torch.Tensor, name)
        monkeypatch.setattr(
            torch.Tensor, name, lambda self, *a, _o=orig, _n=name, _s=seen, **k: _s.append(_n) or _o(self, *a, **k)
        )
    try:
        fn()
    finally:
        monkeypatch.undo()
    return seen


def test_sixteen_sessions_draft_with_the_device_operations_of_one(drafter, monkeypatch):
    many, (one,) = _sessions(drafter, 16), _sessions(drafter, 1)
    auxs = [_aux(drafter, 1 + k % 4, 100 + k) for k in range(16)]  # (made outside: not the draft's own work)

    def batch():
        got = draft_batch([DraftItem(s, a, 7 + k, B) for k, (s, a, B) in enumerate(zip(many, auxs, SIZES))])
        assert [len(g.tokens) for g in got] == [B - 1 for B in SIZES], got

    def alone():
        (got,) = draft_batch([DraftItem(one, auxs[0], 7, 8)])
        assert isinstance(got, Draft) and len(got.tokens) == 7

    batch(), alone()  # warm
    b, a = _counted(batch), _counted(alone)
    assert abs(b.total - a.total) <= 0.1 * a.total, (b.total, a.total, b.ops - a.ops, a.ops - b.ops)
    # what would grow with the sessions: a context write, a RoPE table or an attention call per session
    n_layers = len(drafter.model.layers)
    assert b.ops["index_copy_"] == a.ops["index_copy_"] == 4 * n_layers  # K and V: the extension's, the blocks'
    assert b.ops["cos"] == a.ops["cos"] == 2  # RoPE: the extension's positions, the blocks'
    attention = lambda m: sum(v for k, v in m.ops.items() if "scaled_dot_product" in k)
    assert attention(b) == attention(a) == n_layers  # one attention call per layer over all 16 sessions
    assert b.ops["argmax"] == a.ops["argmax"] == 1
    assert _syncs(monkeypatch, batch) == ["tolist"]  # the tokens of all 16 sessions: one host sync
    assert _syncs(monkeypatch, alone) == ["tolist"]


def test_each_sessions_batched_draft_equals_its_draft_alone(drafter):
    model = drafter.model
    batched, alone = _sessions(drafter, 16), _sessions(drafter, 16)
    rng = np.random.default_rng(3)
    mask = model.config.mask_token_id
    for round_ in range(4):
        sizes = SIZES[round_:] + SIZES[:round_]
        work = [(_aux(drafter, int(rng.integers(0, 17)), 1000 * round_ + k), int(rng.integers(0, 200)), B)
                for k, B in enumerate(sizes)]  # fmt: skip
        tokens, logits = model.draft_step(
            [(s.cache, a) for s, (a, _, _) in zip(batched, work)],
            [(s.cache, [t] + [mask] * (B - 1)) for s, (_, t, B) in zip(batched, work) if B > 1],
            True,
            True,
        )
        want_tokens, want_logits = [], []
        for s, (a, t, B) in zip(alone, work):  # each session's extension and block as a step of its own
            got = model.draft_step([(s.cache, a)], [(s.cache, [t] + [mask] * (B - 1))] if B > 1 else [], True, True)
            if B > 1:
                want_tokens += got[0]
                want_logits.append(got[1])
        want_logits = torch.cat(want_logits)
        assert tokens == want_tokens, round_
        assert logits.dtype == torch.float32 and logits.shape == want_logits.shape
        # the same arithmetic on the same rows; a GEMM over more rows picks another kernel and rounds apart
        # by ~1e-6 in the hidden rows, which the LM head sums into up to ~2e-5 on logits of magnitude ~16
        # (a few float32 ulps of the largest; measured on this 2-core VM)
        torch.testing.assert_close(logits, want_logits, rtol=0, atol=5e-5)
        assert [s.cache.length for s in batched] == [s.cache.length for s in alone]
