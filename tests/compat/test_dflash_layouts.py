"""Drafters saved by the ``dflash`` package's own ``DFlashDraftModel.save_pretrained`` in z-lab's two layouts
are read as that package reads them: our loop drafts, block for block, the tokens the package's own
``dflash_generate`` drafts over the same transformers target (float32), on torch; the MLX drafter's block
logits equal the torch drafter's. (The greedy output of every family with these drafters is pinned against
transformers in ``test_transformers.py``; the project's own layout in tests/torch_backend/test_drafter_parity.py.)
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from .conftest import PROMPT

LAYOUTS = {"may": "e", "june": "moe"}  # layout -> the family whose drafter is saved in it
B = 8


def _package_drafts(target, draft, n, monkeypatch):
    import dflash.model as dm
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(dm, "_cuda_time", time.perf_counter)  # CPU run with return_stats
    ref = dm.DFlashDraftModel.from_pretrained(str(draft), dtype=torch.float32).eval()
    drafted: list[list[int]] = []
    compute_logits = ref.compute_logits

    def recording(hidden, head):
        logits = compute_logits(hidden, head)
        drafted.append(logits.argmax(-1)[0].tolist())
        return logits

    monkeypatch.setattr(ref, "compute_logits", recording)
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    st = dm.dflash_generate(ref, hf, torch.tensor([PROMPT]), n, None, block_size=B, return_stats=True)
    assert ref.block_size == 8  # the package read the layout's block_size where it was written
    return st, drafted


class _Recorder:
    def __init__(self, session):
        self.session, self.drafted = session, []

    def draft(self, new_aux, last, block_size):
        out = self.session.draft(new_aux, last, block_size)
        self.drafted.append(list(out.tokens))
        return out

    def close(self):
        self.session.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_drafts_what_the_dflash_package_drafts(checkpoints, layout, monkeypatch):
    from kakeya.orchestrator.decode.loop import run

    from .cells import pair

    name = LAYOUTS[layout]
    target, draft = checkpoints("float32", name), checkpoints("draft", name)
    n = 96
    st, theirs = _package_drafts(target, draft, n, monkeypatch)
    verifier, drafter = pair("torch", target, draft)
    assert drafter.model.config.block_size == 8
    rec = _Recorder(drafter.open_session())
    gen = run(verifier.open_session(), rec, PROMPT, n, B)
    assert gen.token_ids == st.output_ids[0, len(PROMPT) :].tolist()
    # the loops cut their last blocks differently at max_tokens: compare the full-size blocks
    k = sum(1 for a, b in zip(rec.drafted, theirs) if len(a) == len(b) == B - 1)
    assert k > 30
    assert rec.drafted[:k] == theirs[:k]
    assert gen.acceptance_lengths[:k] == st.acceptance_lengths[:k]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mlx_drafter_equals_torch_drafter(checkpoints, layout):
    import mlx.core as mx

    from kakeya.drafter.backend import extend

    from .cells import pair

    name = LAYOUTS[layout]
    target, draft = checkpoints("float32", name), checkpoints("draft", name)
    mine, theirs = pair("torch", target, draft)[1].model, pair("mlx", target, draft)[1].model
    assert mine.config.layer_types == theirs.config.layer_types
    aux = np.random.default_rng(5).standard_normal((40, mine.config.aux_width)).astype(np.float32)
    c1, c2, pos = mine.make_cache(), theirs.make_cache(), 0
    for i, step in enumerate([9, 1, 7, 3, 12, 8]):
        extend(mine, [c1], [torch.from_numpy(aux[pos : pos + step])])
        extend(theirs, [c2], [mx.array(aux[pos : pos + step])])
        pos += step
        block = [13 * i + 3] + [mine.config.mask_token_id] * (B - 1)
        a = mine.block_logits([(c1, block)]).numpy()
        b = np.asarray(theirs.block_logits([(c2, block)]))
        assert np.abs(a - b).max() <= 1e-4, f"step {i}"
