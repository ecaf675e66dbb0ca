"""Below a model's ``min_batch`` queued sessions run one by one (CUDA graphs beat an eager batch there)."""

from __future__ import annotations

import pytest
import torch

from kakeya.backends.torch.graphs import GRAPHED_MIN_BATCH
from kakeya.core.contract import CachePolicy
from kakeya.drafter.batch import draft_batch
from kakeya.verifier.batch import verify_batch
from kakeya.verifier.session import VerifierSession

from .conftest import AUX_LAYERS, PROMPT


def test_eager_models_batch_from_two_sessions(torch_target, torch_drafter):
    assert torch_target.min_batch == 2 and torch_drafter.model.min_batch == 2
    assert GRAPHED_MIN_BATCH > 2


@pytest.mark.parametrize("min_batch,batched", [(3, False), (2, True)])
def test_verify_batch_runs_a_smaller_group_alone(torch_target, monkeypatch, min_batch, batched):
    calls = []
    forward = type(torch_target).forward

    def counted(self, segments):
        if len(segments) > 1:
            calls.append(1)
        return forward(self, segments)

    monkeypatch.setattr(type(torch_target), "forward", counted)
    monkeypatch.setattr(type(torch_target), "min_batch", min_batch)
    vs = [VerifierSession(torch_target, AUX_LAYERS, CachePolicy()) for _ in range(2)]
    firsts = [v.prefill(PROMPT[:n])[0] for v, n in zip(vs, (9, 15))]
    got = verify_batch([(v, [f, 61, 62], None) for v, f in zip(vs, firsts)])
    alone = []
    for n, f in zip((9, 15), firsts):
        s = VerifierSession(torch_target, AUX_LAYERS, CachePolicy())
        s.prefill(PROMPT[:n])
        alone.append(s.verify([f, 61, 62]))
    assert got == alone
    assert bool(calls) == batched


@pytest.mark.parametrize("min_batch,batched", [(3, False), (2, True)])
def test_draft_batch_runs_a_smaller_group_alone(torch_drafter, monkeypatch, min_batch, batched):
    model = torch_drafter.model
    calls = []
    logits = model.block_logits
    monkeypatch.setattr(model, "block_logits", lambda blocks: calls.append(len(blocks)) or logits(blocks))
    monkeypatch.setattr(type(model), "min_batch", min_batch)
    width = model.config.aux_width
    aux = [torch.randn(n, width, generator=torch.Generator().manual_seed(n)) for n in (7, 12)]
    ss = [torch_drafter.open_session() for _ in range(2)]
    got = draft_batch([(s, a, 5, 6) for s, a in zip(ss, aux)])
    alone = [torch_drafter.open_session().draft(a, 5, 6) for a in aux]
    assert got == alone
    assert (2 in calls) == batched  # one forward over both sessions' blocks, or each alone
