"""The drafter's batched step with its attention in the Triton decode-attention kernel (what CUDA runs)
against the same step's eager gather and SDPA: under Triton's interpreter on a CPU, on CUDA where there
is one.

A full-attention drafter (non-causal blocks: the queries at the block's last position), one with a
causal sliding layer (window 8, rings past a wrap) in front, and one whose sliding layer attends
non-causally (not the kernel's rule: that layer takes SDPA in the same step): batches of sessions of different context
lengths and block sizes (ragged rows on the CPU), one session alone, round after round: the same tokens,
the same logits within float32 noise, one kernel launch per layer and step."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from .conftest import DEVICE

pytest.importorskip("triton", reason="the kernels need triton (Linux only; no macOS wheels)")

from kakeya.checkpoints.tiny import make_tiny
from kakeya.drafter.local import TorchDrafter


@pytest.fixture(scope="module", params=["full", "mixed", "mixed-noncausal"])
def drafters(request, tmp_path_factory):
    tiny = make_tiny(tmp_path_factory.mktemp("draft_kernel"), seed=0, sliding_window=32)
    draft = tiny.draft
    if request.param != "full":
        draft = tmp_path_factory.mktemp("draft_kernel_mixed") / "draft"
        shutil.copytree(tiny.draft, draft)
        cfg = json.loads((draft / "config.json").read_text())
        cfg.update(layer_types=["sliding_attention", "full_attention"], sliding_window=8, use_sliding_window=True)
        if request.param == "mixed-noncausal":  # a windowed non-causal layer: SDPA, beside the kernel's
            cfg.update(is_causal=False)
        (draft / "config.json").write_text(json.dumps(cfg))
    kw = dict(cuda_graphs=False) if DEVICE.type == "cuda" else {}
    kernel = TorchDrafter(draft, tiny.target, DEVICE, "float32", attention_kernel=True, **kw)
    eager = TorchDrafter(draft, tiny.target, DEVICE, "float32", attention_kernel=False, **kw)
    assert kernel.model.attention_kernel and not eager.model.attention_kernel
    return kernel, eager


def test_kernel_attention_drafts_as_the_eager_step(drafters, monkeypatch):
    from kakeya.backends.torch.kernels import attention

    kernel, eager = drafters
    launches = []
    real = attention.decode_attention
    monkeypatch.setattr(attention, "decode_attention", lambda *a, **k: launches.append(a[0].shape[0]) or real(*a, **k))
    width, mask = kernel.model.config.aux_width, kernel.model.config.mask_token_id
    aux = lambda n, seed: torch.randn(n, width, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    pairs = []
    for k in range(4):
        pair = [d.open_session() for d in (kernel, eager)]
        for s in pair:
            s.draft(aux(3 + 11 * k, k), 5, 2)  # contexts of 3 .. 36 positions: the window-8 rings wrap
        pairs.append(pair)
    rng = np.random.default_rng(0)
    launches.clear()  # the openings' drafts launched too: count the rounds'
    for r in range(5):
        chosen = pairs if r % 2 == 0 else pairs[:1]  # a batch, then one session alone (the same step)
        work = [(int(rng.integers(0, 5)), int(rng.integers(3, 500)), int(rng.integers(2, 17))) for _ in chosen]
        got, want = (
            d.model.draft_step(
                [(p[j].cache, aux(n, 100 * r + i)) for i, (p, (n, _, _)) in enumerate(zip(chosen, work))],
                [(p[j].cache, [t] + [mask] * (B - 1)) for p, (_, t, B) in zip(chosen, work)],
                True,
                True,
            )
            for j, d in enumerate((kernel, eager))
        )
        assert got[0] == want[0], f"round {r}"
        torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-4)
    assert pairs[3][0].cache.length > 2 * 8  # the longest context is past its ring's wraps
    specs = [layer.self_attn.spec for layer in kernel.model.layers]
    layers = sum(a.is_causal or a.window is None for a in specs)  # the rules the kernel takes
    assert layers >= 1 and len(launches) == 5 * layers and 4 in launches  # one launch per such layer and step
