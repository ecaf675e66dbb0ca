"""Pre-drafts that prepare for rejections (``LocalDrafterSession.predraft`` with ``alternatives``).

Both backends, every drafter variant (the sliding one compacts its buffer on a
small step): a pre-draft's blocks all run in ONE forward against one session's
cache, so each must come out as it does drafted on its own, and the
alternatives must be the next likeliest ids of the draft that proposed the
pending candidates; with the cap on blocks, the verdicts kept must be the
likeliest by that draft's own probabilities.
"""

from __future__ import annotations

import numpy as np
import pytest

from kakeya.drafter import session as drafter_session
from kakeya.drafter.batch import DraftItem, PredraftItem, draft_batch
from kakeya.drafter.session import DraftCall, LocalDrafterSession, draft_together

from .test_batch import BACKENDS, _aux, _load


def _session(model, step: int, predraft_blocks: int = drafter_session.PREDRAFT_BLOCKS) -> LocalDrafterSession:
    s = LocalDrafterSession(model, predraft_blocks=predraft_blocks)
    s.cache = model.make_cache(step=step)
    return s


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_prepared_block_is_what_drafting_it_alone_gives(backend, pair):
    model = _load(backend, pair)
    width, mask = model.config.aux_width, model.config.mask_token_id
    rng = np.random.default_rng(7)
    for B, ctx, step in [(8, 40, 4), (4, 70, 256), (16, 9, 4), (2, 5, 4)]:
        prompt, kept = (rng.standard_normal((n, width)).astype(np.float32) for n in (ctx, 3))
        s, twin = _session(model, step, predraft_blocks=32), _session(model, step)  # s: every verdict, each checked
        first = s.draft(_aux(backend, prompt), 7, B)
        once = s.predraft(None, [7, *first.tokens], B, 2)()
        assert [accepted for accepted, _ in once.blocks] == [B - 1]  # no record yet: the full acceptance alone
        d = s.draft(_aux(backend, kept), 11, B)  # kept from now on: the session was asked for alternatives
        found = s.predraft(None, [11, *d.tokens], B, 2)()
        assert len(found.blocks) == 1 + 2 * (B - 1)

        twin.draft(_aux(backend, prompt), 7, B)
        assert twin.draft(_aux(backend, kept), 11, B) == d  # the same context as s's
        ranked, _ = model.ranked(model.block_logits([(twin.cache, [11] + [mask] * (B - 1))]), 3)
        for n, c in enumerate(d.tokens):
            alts = [t for (m, t) in found.blocks if m == n]
            assert alts == ranked[n][1:3] and c == ranked[n][0], (B, n)
        nothing = model.zeros_aux(0)
        for (accepted, token), tokens in found.blocks.items():
            if accepted == B - 1:  # the full acceptance: its guess, then the block after it
                alone = draft_together([DraftCall(twin, nothing, 11, B, d.tokens)])[0].tokens
                assert (alone[0], alone[1:]) == (token, tokens), B
            else:
                pending = d.tokens[:accepted] + (token,)
                alone = draft_together([DraftCall(twin, nothing, 11, B, pending, guesses=False)])[0].tokens
                assert alone == tokens and len(tokens) == B - 1, (B, accepted)
        assert s.cache.length == twin.cache.length == ctx + 3  # pre-drafts extend nothing beyond new_aux


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_cap_keeps_the_likeliest_verdicts_by_the_drafters_probabilities(backend, pair):
    model = _load(backend, pair)
    width, mask, cap = model.config.aux_width, model.config.mask_token_id, drafter_session.PREDRAFT_BLOCKS
    rng = np.random.default_rng(11)
    for B, k in [(8, 2), (16, 3), (4, 1)]:
        s, twin = _session(model, 256), _session(model, 256)
        first = s.draft(_aux(backend, rng.standard_normal((30, width)).astype(np.float32)), 7, B)
        s.predraft(None, [7, *first.tokens], B, k)()  # asks for alternatives: the next draft is recorded
        kept = rng.standard_normal((2, width)).astype(np.float32)
        d = s.draft(_aux(backend, kept), 11, B)
        found = s.predraft(None, [11, *d.tokens], B, k)()

        twin.cache = s.cache  # read only below: the logits the recorded draft came from
        logits = np.asarray(model.block_logits([(twin.cache, [11] + [mask] * (B - 1))]), np.float64)
        logp = (
            logits
            - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
            - logits.max(-1, keepdims=True)
        )
        ids, got_logp = model.ranked(model.block_logits([(twin.cache, [11] + [mask] * (B - 1))]), k + 1)
        np.testing.assert_allclose(np.asarray(got_logp), np.take_along_axis(logp, np.asarray(ids), -1), atol=1e-4)
        rated = []  # every rejection verdict the drafter could prepare for, rated by its own probabilities
        for n, c in enumerate(d.tokens):
            order = [int(t) for t in np.argsort(-logits[n], kind="stable") if t != c][:k]
            rated += [(logp[:n, :][np.arange(n), list(d.tokens[:n])].sum() + logp[n, a], (n, a)) for a in order]
        rated.sort(key=lambda r: -r[0])
        want = {v for _, v in rated[: cap - 1]}
        rejections = {key for key in found.blocks if key[0] < B - 1}
        assert len(found.blocks) == min(cap, 1 + k * (B - 1)) and rejections == want, (B, k)
        assert sum(1 for key in found.blocks if key[0] == B - 1) == 1  # the full acceptance always


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_batched_predraft_prepares_what_it_does_alone(backend, pair):
    """The drafter server batches a pre-draft with other streams' drafts (``draft_batch``)."""
    model = _load(backend, pair)
    width = model.config.aux_width
    rng = np.random.default_rng(3)
    rows = [rng.standard_normal((n, width)).astype(np.float32) for n in (20, 2, 12)]
    a, a2, other, other2 = (_session(model, 256) for _ in range(4))
    for s in (a, a2):
        d = s.draft(_aux(backend, rows[0]), 5, 8)
        s.predraft(None, [5, *d.tokens], 8, 3)  # asks for alternatives: the next draft is recorded
        d = s.draft(_aux(backend, rows[1]), 9, 8)
    for s in (other, other2):
        s.draft(_aux(backend, rows[2]), 6, 4)
    want = [a2.predraft(None, [9, *d.tokens], 8, 3)(), other2.draft(_aux(backend, rows[1]), 2, 4)]
    got = draft_batch([PredraftItem(a, None, 9, 8, d.tokens, 3), DraftItem(other, _aux(backend, rows[1]), 2, 4)])
    assert got == want and len(got[0].blocks) == drafter_session.PREDRAFT_BLOCKS


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_alternatives_are_refused_naming_the_field(backend, pair):
    model = _load(backend, pair)
    s = _session(model, 256)
    d = s.draft(_aux(backend, np.zeros((4, model.config.aux_width), np.float32)), 3, 4)
    for bad in (-1, 5):
        with pytest.raises(ValueError, match="alternatives"):
            s.predraft(None, [3, *d.tokens], 4, bad)
    assert draft_batch([PredraftItem(s, None, 3, 4, d.tokens, 9)])[0].args[0].startswith("alternatives")


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_drafter_server_caps_its_sessions_predrafts_and_refuses_a_bad_cap(backend, pair):
    """``serve drafter --predraft-blocks N`` reaches every session the servicer opens; 0 or over 32 is refused
    naming the flag before anything loads."""
    from kakeya.drafter.local import LocalDrafter
    from kakeya.drafter.server import DrafterServicer

    for bad in (0, 33):
        with pytest.raises(ValueError, match="--predraft-blocks"):
            DrafterServicer(predraft_blocks=bad)
    servicer = DrafterServicer(predraft_blocks=2)
    servicer._setup(
        lambda **shared: LocalDrafter(_load(backend, pair), **shared), "draft", "target", backend
    )  # load()'s, on this thread
    s = servicer.drafter.open_session()
    rng = np.random.default_rng(2)
    d = s.draft(_aux(backend, rng.standard_normal((9, s.model.config.aux_width)).astype(np.float32)), 4, 8)
    s.predraft(None, [4, *d.tokens], 8, 2)()  # asks for alternatives
    d = s.draft(_aux(backend, rng.standard_normal((2, s.model.config.aux_width)).astype(np.float32)), 5, 8)
    assert len(s.predraft(None, [5, *d.tokens], 8, 2)().blocks) == 2  # the full acceptance and the likeliest rejection


def test_a_static_step_session_still_keeps_the_alternatives_its_next_predraft_needs(pair):
    """Torch's static step (CUDA graphs; run eagerly here) keeps no logits: a session asked for
    alternatives drafts through the eager forward, so its pre-drafts still prepare for rejections."""
    from kakeya.backends.torch.graphs import BUCKETS, GraphOptions
    from kakeya.drafter.local import TorchDrafter

    drafter = TorchDrafter(
        pair.draft, pair.target, graph_options=GraphOptions(capture=False, buckets=BUCKETS, static_extent=True)
    )
    assert drafter.model.static_step is not None
    rng = np.random.default_rng(5)
    s = drafter.open_session()
    first = s.draft(_aux("torch", rng.standard_normal((12, drafter.model.config.aux_width)).astype(np.float32)), 7, 8)
    s.predraft(None, [7, *first.tokens], 8, 2)()  # asks for alternatives
    calls = s.calls
    d = s.draft(_aux("torch", rng.standard_normal((3, drafter.model.config.aux_width)).astype(np.float32)), 9, 8)
    assert s.calls == calls + 1
    assert len(s.predraft(None, [9, *d.tokens], 8, 2)().blocks) == drafter_session.PREDRAFT_BLOCKS
