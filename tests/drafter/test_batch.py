"""Batched drafting (``session.draft_batch``): each session drafts in a batch what it drafts alone.

Both backends (torch float32 and MLX, on the CPU), the plain and the
sliding+full drafter: sessions of different context lengths, block sizes and
last tokens, over several consecutive calls (so their caches must stay the
same too), some caches on a small step so full buffers grow and sliding ones
compact while batched.
"""

from __future__ import annotations

import numpy as np
import pytest

from kakeya.core.contract import Draft
from kakeya.core.request import COUPLED, MAX_BLOCK_SIZE, REJECTION, SamplingParams
from kakeya.drafter.backend import DraftModel
from kakeya.drafter.session import DraftItem, LocalDrafterSession, draft_batch

BACKENDS = ("torch", "mlx")
KV_ATOL = 1e-4  # K/V written by a batched extension: a matmul over more rows rounds differently (~1e-6)


def _load(backend: str, pair):
    if backend == "mlx":
        from kakeya.drafter.mlx_backend.model import load_dflash_mlx

        return load_dflash_mlx(pair.draft, pair.target)
    from kakeya.drafter.torch_backend.load import load_dflash_torch

    return load_dflash_torch(pair.draft, pair.target, "cpu", "float32")


def _aux(backend: str, rows: np.ndarray):
    if backend == "mlx":
        import mlx.core as mx

        return mx.array(rows)
    import torch

    return torch.from_numpy(rows)


def _session(model, i: int, sampling: SamplingParams | None = None) -> LocalDrafterSession:
    s = LocalDrafterSession(model, sampling)
    s.cache = model.make_cache(step=4 if i % 2 == 0 else 256)  # step 4: buffers grow / compact often
    return s


def _np(a) -> np.ndarray:
    if type(a).__module__.startswith("torch"):
        return a.float().numpy()
    return np.asarray(a, np.float32)


def _same_cache(a: LocalDrafterSession, b: LocalDrafterSession) -> None:
    assert a.cache.length == b.cache.length
    assert a.cache.nbytes == b.cache.nbytes
    for i in range(a.model.config.num_hidden_layers):
        (ka, va), (kb, vb) = a.cache.view(i), b.cache.view(i)
        assert (ka is None) == (kb is None)
        if ka is not None:
            np.testing.assert_allclose(_np(ka), _np(kb), atol=KV_ATOL)
            np.testing.assert_allclose(_np(va), _np(vb), atol=KV_ATOL)


def _calls(rng, n_sessions: int, width: int, vocab: int, first: list[int]):
    """One call per session: (aux rows, last token, block size)."""
    out = []
    for j in range(n_sessions):
        n = first[j] if first else int(rng.integers(0, 13))
        aux = rng.standard_normal((n, width)).astype(np.float32)
        out.append((aux, int(rng.integers(0, vocab)), int(rng.choice([2, 3, 5, 8, 11, 16]))))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_backend_has_every_member_of_the_draft_model_protocol(backend, pair):
    """session.py asks a model for what ``DraftModel`` declares and nothing else."""
    model = _load(backend, pair)
    members = {name for name in vars(DraftModel) if not name.startswith("_")} | set(DraftModel.__annotations__)
    assert {"block_logits", "context_kv", "min_batch", "static_step", "release_cache"} <= members
    assert sorted(name for name in members if not hasattr(model, name)) == []
    assert model.backend == backend and model.min_batch == 2 and model.static_step is None  # eager: batch from 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_batched_drafts_equal_drafting_alone_over_consecutive_calls(backend, pair):
    model = _load(backend, pair)
    width, vocab = model.config.aux_width, model.target.vocab_size
    alone = [_session(model, i) for i in range(5)]
    batched = [_session(model, i) for i in range(5)]
    rng = np.random.default_rng(11)
    for call in range(8):
        work = _calls(rng, 5, width, vocab, [1, 9, 30, 70, 3] if call == 0 else [])
        want = [s.draft(_aux(backend, a), t, b) for s, (a, t, b) in zip(alone, work)]
        got = draft_batch([DraftItem(s, _aux(backend, a), t, b) for s, (a, t, b) in zip(batched, work)])
        assert got == want, f"call {call}"
        assert all(len(g.tokens) == b - 1 and g.proposal is None for g, (_, _, b) in zip(got, work))
        for a, b in zip(alone, batched):
            _same_cache(a, b)
    assert [s.calls for s in batched] == [8] * 5
    if pair.variant.sliding_window:  # the context outgrew a sliding layer's rows (a torch ring wrapped,
        # the MLX step-4 session's buffer was compacted) while batched
        assert batched[0].cache.length > pair.variant.sliding_window + MAX_BLOCK_SIZE


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_bad_item_fails_alone_and_block_size_one_only_extends(backend, pairs):
    model = _load(backend, pairs["mixed"])
    width, vocab = model.config.aux_width, model.target.vocab_size
    rng = np.random.default_rng(5)
    rows = lambda n: _aux(backend, rng.standard_normal((n, width)).astype(np.float32))
    good, ext, bad_tok, closed, bad_aux, dup = (_session(model, i) for i in range(6))
    twin = _session(model, 0)  # `good` drafting alone
    init = rows(6)
    for s in (good, ext, bad_tok, closed, bad_aux, twin):
        s.draft(init, 3, 1)
    closed.close()
    first = rows(4)
    want = twin.draft(first, 7, 6)
    got = draft_batch([
        DraftItem(good, first, 7, 6),
        DraftItem(ext, rows(5), 9, 1),
        DraftItem(bad_tok, rows(2), vocab, 4),
        DraftItem(closed, rows(2), 3, 4),
        DraftItem(bad_aux, _aux(backend, np.zeros((2, width + 1), np.float32)), 3, 4),
        DraftItem(good, rows(1), 7, 4),  # the same session twice in one batch
        DraftItem(dup, rows(0), 3, 4),  # the first call of a session with no aux
    ])  # fmt: skip
    assert got[0] == want and len(want.tokens) == 5
    assert got[1] == Draft(()) and ext.cache.length == 11 and ext.calls == 2
    for r, kind, text in [(got[2], ValueError, "last_token"), (got[3], RuntimeError, "closed"),
                          (got[4], ValueError, "width"), (got[5], ValueError, "once per batch"),
                          (got[6], ValueError, "at least one position")]:  # fmt: skip
        assert isinstance(r, kind) and text in str(r), r
    assert (bad_tok.cache.length, bad_aux.cache.length, dup.cache.length) == (6, 6, 0)
    assert (bad_tok.calls, bad_aux.calls) == (1, 1)
    _same_cache(good, twin)
    # every item extending only: nothing drafted, every cache extended
    before = [s.cache.length for s in (good, ext)]
    assert draft_batch([DraftItem(good, rows(3), 1, 1), DraftItem(ext, rows(2), 1, 1)]) == [Draft(()), Draft(())]
    assert [s.cache.length for s in (good, ext)] == [before[0] + 3, before[1] + 2]


@pytest.mark.parametrize("backend", BACKENDS)
def test_seeded_sampling_sessions_draw_the_same_draft_in_a_batch(backend, pairs):
    model = _load(backend, pairs["mixed"])
    width, vocab = model.config.aux_width, model.target.vocab_size
    params = [
        SamplingParams(0.8, seed=3),
        None,
        SamplingParams(1.0, top_k=20, top_p=0.9, seed=4, rule=REJECTION),
        SamplingParams(0.7, seed=5, rule=REJECTION),
        SamplingParams(1.1, min_p=0.02, seed=6),
    ]
    alone = [_session(model, i, p) for i, p in enumerate(params)]
    batched = [_session(model, i, p) for i, p in enumerate(params)]
    rng = np.random.default_rng(21)
    for call in range(4):
        work = _calls(rng, len(params), width, vocab, [5, 17, 2, 40, 9] if call == 0 else [])
        want = [s.draft(_aux(backend, a), t, b) for s, (a, t, b) in zip(alone, work)]
        got = draft_batch([DraftItem(s, _aux(backend, a), t, b) for s, (a, t, b) in zip(batched, work)])
        for g, w, p in zip(got, want, params):
            assert g.tokens == w.tokens
            if p is None or p.rule == COUPLED:  # greedy or coupled: candidates only
                assert g.proposal is None and w.proposal is None
                continue
            assert np.array_equal(g.proposal.ids, w.proposal.ids)
            np.testing.assert_allclose(g.proposal.probs, w.proposal.probs, atol=1e-5)
        for a, b in zip(alone, batched):
            _same_cache(a, b)
