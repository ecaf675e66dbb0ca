"""Pooled K/V and the batched verify step (verifier/torch_backend/pool.py, batch_step.py), on a CPU.

Structure: a batched verify of 16 sessions runs as many device operations as one session's
verify (within 10 %) and syncs with the host once. Accounting: a session's pages come back
when it closes and go to the next one; a pool grows by whole chunks, and sessions decode on
exactly across a growth. Outputs of batches against sessions alone: ``test_batch_verify.py``.
"""

from __future__ import annotations

import collections

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kakeya.core.request import CachePolicy
from kakeya.verifier.session import LocalVerifierSession, VerifyItem, counts, verify_batch
from kakeya.verifier.torch_backend import batch_step
from kakeya.verifier.torch_backend.target import TargetTorch

from .conftest import AUX_LAYERS, PROMPT

SINK = CachePolicy(kind="sink-window", sink=2, window=8)


def _prompt(n: int, salt: int) -> list[int]:
    return [2] + [5 + (7 * i + salt) % 200 for i in range(n - 1)]


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


def _sessions(target, n: int, policies=(CachePolicy(), SINK)) -> tuple[list, list]:
    sessions, lasts = [], []
    for k in range(n):
        s = LocalVerifierSession(target, AUX_LAYERS, policies[k % len(policies)])
        lasts.append(s.prefill(_prompt(5 + 9 * k, k))[0])  # different positions; the SINK rings wrap
        sessions.append(s)
    return sessions, lasts


def _items(sessions, lasts, sizes):
    return [VerifyItem(s, [t] + [10 + j for j in range(L - 1)]) for s, t, L in zip(sessions, lasts, sizes)]


def _counted(fn):
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


def test_sixteen_sessions_run_the_device_operations_of_one(torch_target, monkeypatch):
    many, lasts = _sessions(torch_target, 16)
    sizes = [1 + (5 * k) % 16 for k in range(16)]  # blocks of 1..16: ragged rows
    one, (last,) = _sessions(torch_target, 1)

    def batch():
        got = verify_batch(_items(many, lasts, sizes))
        assert all(isinstance(g, list) for g in got), got
        for s in many:
            s.commit(1)

    def alone():
        verify_batch(_items(one, [last], [8]))
        one[0].commit(1)

    batch(), alone()  # warm
    # one session through the step every batch takes: its pages gathered through the table (a lone session's
    # consecutive pages are read as a slice instead: test_a_lone_session_reads_its_pages_as_a_slice)
    monkeypatch.setattr(batch_step, "_first_row", lambda *a: None)
    b, a = _counted(batch), _counted(alone)
    monkeypatch.undo()
    assert abs(b.total - a.total) <= 0.1 * a.total, (b.total, a.total, b.ops - a.ops, a.ops - b.ops)
    # what would grow with the sessions: a cache write, a gather or an attention call per session
    n_layers = torch_target.args.num_hidden_layers
    assert b.ops["index_copy_"] == a.ops["index_copy_"] <= 2 * n_layers
    attention = lambda m: sum(v for k, v in m.ops.items() if "scaled_dot_product" in k)
    assert attention(b) == attention(a) == n_layers  # one attention call per layer over all 16 sessions
    assert b.ops["argmax"] == 1
    assert _syncs(monkeypatch, batch) == ["tolist"]  # the choices of all 16 sessions: one host sync
    assert _syncs(monkeypatch, alone) == ["tolist"]


def test_a_lone_session_reads_its_pages_as_a_slice(torch_target, monkeypatch):
    """Eagerly, a lone session whose pages lie in a row attends over a slice of the pool: no gather, fewer
    operations, the same choices and aux hidden states bit for bit as through the table."""

    def verify(slices: bool):
        if not slices:
            monkeypatch.setattr(batch_step, "_first_row", lambda *a: None)
        (s,), (last,) = _sessions(torch_target, 1)
        ops = DeviceOps()
        with ops:
            got = verify_batch(_items([s], [last], [8]))[0]
        aux = s._pending[1].clone()  # the block's aux hidden states (what the drafter reads)
        s.close()
        monkeypatch.undo()
        return got, aux, ops

    got, aux, sliced = verify(True)
    want, want_aux, gathered = verify(False)
    assert got == want and torch.equal(aux, want_aux)
    assert sliced.ops["index_select"] == 0 < gathered.ops["index_select"]
    assert sliced.total < gathered.total


def test_a_closed_sessions_pages_go_to_the_next_session(tiny):
    target = TargetTorch.load(tiny.target, "cpu", "float32", chunk_pages=4)
    sliding, full = target.pool.sliding, target.pool.full()
    free = (len(sliding.free), len(full.free))
    a = LocalVerifierSession(target, AUX_LAYERS, CachePolicy())
    a.prefill(PROMPT + list(range(70, 110)))  # 62 positions: 4 full pages of 16
    ring_pages, full_pages = list(a.cache.ring_pages), list(a.cache.full_pages)
    assert len(ring_pages) == -(-a.layout.capacity // 16) and len(full_pages) == 4
    assert 0 not in ring_pages + full_pages  # page 0 is the trash page
    assert (len(sliding.free), len(full.free)) == (free[0] - len(ring_pages), free[1] - 4)
    assert a.stats().kv_bytes.full == 4 * 16 * full.row_bytes
    a.close()
    assert (len(sliding.free), len(full.free)) == free  # every page back
    b = LocalVerifierSession(target, AUX_LAYERS, CachePolicy())
    b.prefill(PROMPT)
    assert b.cache.ring_pages == ring_pages and b.cache.full_pages == full_pages[:2]  # lowest first: reused
    del b  # never closed: its pages come back when it is collected
    import gc

    gc.collect()
    assert (len(sliding.free), len(full.free)) == free


def test_pools_grow_by_whole_chunks_and_sessions_decode_on_exactly(tiny, torch_target):
    grown = TargetTorch.load(tiny.target, "cpu", "float32", chunk_pages=2)
    sliding = grown.pool.sliding
    assert sliding.pages == 1 + 2 and sliding.growths == 1  # one chunk and the trash page
    ref_sessions, ref_lasts = _sessions(torch_target, 6)
    sessions, lasts = _sessions(grown, 6)  # 6 rings of 3 pages: the sliding pool grew on the way
    assert sliding.growths > 1 and (sliding.pages - 1) % 2 == 0
    assert sliding.pages - 1 >= 2 * (sliding.used_pages // 2) and len(sliding.free) < 2 * sliding.pages
    assert lasts == ref_lasts
    rng = np.random.default_rng(3)
    for r in range(6):
        sizes = [int(rng.integers(1, 17)) for _ in sessions]
        want = verify_batch(_items(ref_sessions, ref_lasts, sizes))
        gens = (sliding.generation, grown.pool.full().generation)
        got = verify_batch(_items(sessions, lasts, sizes))
        assert got == want, f"round {r}"
        for s, t, g in zip(sessions + ref_sessions, lasts + ref_lasts, want + want):
            s.commit(len(g))
        lasts = ref_lasts = [g[-1] for g in want]
    assert (sliding.generation, grown.pool.full().generation) != (1, 1)  # the full pool grew mid-decode too
    assert gens != (1, 1)


def test_quantized_full_kv_sessions_batch_in_a_pool_of_their_own(torch_target):
    before = counts()
    q8 = CachePolicy(full_kv_bits=8, full_kv_group_size=32)
    ss, lasts = _sessions(torch_target, 4, policies=(CachePolicy(), q8))
    got = verify_batch(_items(ss, lasts, [3, 4, 5, 6]))
    assert all(isinstance(g, list) for g in got)
    after = counts()
    assert after["forwards"] - before["forwards"] == 2  # one per full pool: exact and 8-bit
    assert after["batched"] - before["batched"] == 4 and after["alone_policy"] == before["alone_policy"]
    assert ss[1].cache.full is torch_target.pool.full(8, 32) and ss[0].cache.full is torch_target.pool.full()
