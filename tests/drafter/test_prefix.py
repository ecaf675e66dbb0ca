"""A drafter session resumed from a prefix snapshot drafts what the session that saved it would have.

Both backends, the plain and the sliding+full drafter, buffers that grow and compact
(small steps): the saved context (extended by the aux the loop had not handed over
yet) comes back row for row, the next drafts are equal, and the snapshot stays as
it was while the resumed session writes its own cache.
"""

from __future__ import annotations

import numpy as np
import pytest

from kakeya.core.prefix import PrefixCache
from kakeya.drafter.session import LocalDrafterSession

from .test_batch import _aux, _load, _np

BACKENDS = ("torch", "mlx")
MASK = 4


def _visible(session) -> list[np.ndarray]:
    n = session.model.config.num_hidden_layers
    return [_np(a) for i in range(n) for a in session.cache.view(i) if a is not None]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["full", "mixed"])
def test_resumed_context_drafts_as_the_saved_one(pairs, backend, name):
    model = _load(backend, pairs[name])
    width = model.config.aux_width
    rows = np.random.default_rng(7).standard_normal((80, width)).astype(np.float32)
    ids = list(range(10, 10 + 61))  # the tokens of the 61 positions saved
    cache = PrefixCache(1 << 26)

    saver = LocalDrafterSession(model, prefixes=cache)
    saver.cache = model.make_cache(step=4)  # grows (full) and compacts (sliding) along the way
    at = 0
    for n, B in [(20, 8), (3, 4), (5, 8), (1, 2), (7, 8)]:
        saver.draft(_aux(backend, rows[at : at + n]), 9, B)
        at += n
    assert at == 36
    unseen = [_aux(backend, rows[36:50]), _aux(backend, rows[50:70])]  # more rows than the save needs
    assert saver.save(ids, unseen) and saver.cache.length == 61
    kept = _visible(saver)
    block = [ids[-1]] + [MASK] * 7
    want = model.block_logits([(saver.cache, block)])
    saver.close()

    resumed = LocalDrafterSession(model, prefixes=cache)
    prompt = ids + [ids[-1], 3, 3]
    assert resumed.cached_prefixes(prompt) == [61]
    resumed.resume(61)
    assert resumed.cache.length == 61
    assert all(np.array_equal(a, b) for a, b in zip(kept, _visible(resumed)))
    np.testing.assert_array_equal(_np(model.block_logits([(resumed.cache, block)])), _np(want))
    resumed.draft(_aux(backend, rows[61:64]), 5, 8)  # writes its own cache, never the snapshot
    (entry,) = cache.find("context", prompt)
    assert all(
        np.array_equal(a, _np(b)) for a, b in zip(kept, (x for kv in entry.value.kv for x in kv if x is not None))
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_resume_needs_what_cached_prefixes_held_and_a_save_needs_the_rows(pairs, backend):
    model = _load(backend, pairs["full"])
    cache = PrefixCache(1 << 26)
    s = LocalDrafterSession(model, prefixes=cache)
    s.draft(_aux(backend, np.zeros((5, model.config.aux_width), np.float32)), 9, 4)
    assert not s.save(list(range(9)), [_aux(backend, np.zeros((2, model.config.aux_width), np.float32))])
    assert not s.save(list(range(3)), [])  # fewer ids than the context holds
    s.close()
    fresh = LocalDrafterSession(model, prefixes=cache)
    assert fresh.cached_prefixes(list(range(20))) == []
    with pytest.raises(ValueError, match="resume"):
        fresh.resume(5)
    fresh.resume(0)  # nothing held: start cold
    assert fresh.cache.length == 0
    assert not LocalDrafterSession(model).save([1, 2], [])  # no cache: nothing kept
