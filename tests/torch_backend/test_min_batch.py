"""Below a model's ``min_batch`` queued sessions run one by one (CUDA graphs beat an eager batch there)."""

from __future__ import annotations

import sys

import pytest
import torch

from kakeya.backends.torch.graphs import GRAPHED_MIN_BATCH, GraphOptions
from kakeya.core.request import CachePolicy
from kakeya.drafter.session import DraftItem, draft_batch
from kakeya.verifier.session import LocalVerifierSession, VerifyItem, verify_batch

from .conftest import AUX_LAYERS, PROMPT


def test_eager_models_batch_from_two_sessions(torch_target, torch_drafter):
    assert torch_target.min_batch == 2 and torch_drafter.model.min_batch == 2
    assert GRAPHED_MIN_BATCH > 2


@pytest.mark.parametrize("min_batch,batched", [(3, False), (2, True)])
def test_verify_batch_runs_a_smaller_group_alone(torch_target, monkeypatch, min_batch, batched):
    calls = []
    segments_of = type(torch_target).verify_segments

    def counted(self, segments, greedy):
        if len(segments) > 1:
            calls.append(1)
        return segments_of(self, segments, greedy)

    monkeypatch.setattr(type(torch_target), "verify_segments", counted)
    monkeypatch.setattr(type(torch_target), "min_batch", min_batch)
    vs = [LocalVerifierSession(torch_target, AUX_LAYERS, CachePolicy()) for _ in range(2)]
    firsts = [v.prefill(PROMPT[:n])[0] for v, n in zip(vs, (9, 15))]
    got = verify_batch([VerifyItem(v, [f, 61, 62]) for v, f in zip(vs, firsts)])
    alone = []
    for n, f in zip((9, 15), firsts):
        s = LocalVerifierSession(torch_target, AUX_LAYERS, CachePolicy())
        s.prefill(PROMPT[:n])
        alone.append(s.verify([f, 61, 62]))
    assert got == alone
    assert bool(calls) == batched


@pytest.mark.parametrize("min_batch,batched", [(3, False), (2, True)])
def test_draft_batch_runs_a_smaller_group_alone(torch_drafter, monkeypatch, min_batch, batched):
    model = torch_drafter.model
    calls = []
    step = model.draft_step
    monkeypatch.setattr(
        model, "draft_step", lambda ext, blocks, *a, **k: calls.append(len(blocks)) or step(ext, blocks, *a, **k)
    )
    monkeypatch.setattr(type(model), "min_batch", min_batch)
    width = model.config.aux_width
    aux = [torch.randn(n, width, generator=torch.Generator().manual_seed(n)) for n in (7, 12)]
    ss = [torch_drafter.open_session() for _ in range(2)]
    got = draft_batch([DraftItem(s, a, 5, 6) for s, a in zip(ss, aux)])
    alone = [torch_drafter.open_session().draft(a, 5, 6) for a in aux]
    assert got == alone
    assert (2 in calls) == batched  # one forward over both sessions' blocks, or each alone


@pytest.mark.parametrize("given, value", [(None, GRAPHED_MIN_BATCH), (0, sys.maxsize), (8, 8)])
def test_graphed_min_batch_option(given, value):
    """--graphed-min-batch: a GPU node's A/B of the eager batch against graph replays one by one; an
    eager model (no capture: a CPU) batches from two sessions whatever is asked."""
    assert GraphOptions(capture=True, min_batch=value).batch_from == value
    assert GraphOptions.for_device(torch.device("cpu"), None, given).batch_from == 2


@pytest.mark.parametrize("given", [1, -2])
def test_graphed_min_batch_refuses_nonsense(given):
    from types import SimpleNamespace

    from kakeya.app.options import torch_options

    with pytest.raises(ValueError, match="min_batch"):
        GraphOptions.for_device(torch.device("cpu"), None, given)
    with pytest.raises(ValueError, match="--graphed-min-batch"):
        torch_options(SimpleNamespace(graphed_min_batch=given))


def test_graphed_min_batch_is_the_drafters():
    from types import SimpleNamespace

    from kakeya.app.options import torch_options

    assert torch_options(SimpleNamespace(graphed_min_batch=8)) == {"graphed_min_batch": 8}
    with pytest.raises(ValueError, match="drafter"):
        torch_options(SimpleNamespace(graphed_min_batch=8), drafter=False)
