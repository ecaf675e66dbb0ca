"""The batched verify step with its attention in the Triton decode-attention kernel (what CUDA runs)
against the same step's eager gather and SDPA, through whole sessions: under Triton's interpreter on
a CPU, on CUDA where there is one.

Batches of sessions of different positions, block sizes and ring policies (sink-window rings past a
wrap), ragged rows on the CPU, one session alone: the same choices and aux within float32 noise,
round after round with trims."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from .conftest import DEVICE, cuda_only

pytest.importorskip("triton", reason="the kernels need triton (Linux only; no macOS wheels)")

from kakeya.checkpoints.tiny import make_tiny
from kakeya.core.request import CachePolicy
from kakeya.verifier.session import LocalVerifierSession, VerifyItem, verify_batch
from kakeya.verifier.torch_backend.target import TargetTorch

AUX = (1, 4)
POLICIES = [CachePolicy(), CachePolicy(kind="sink-window", sink=2, window=8), CachePolicy(slack=8)]


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    tiny = make_tiny(tmp_path_factory.mktemp("pooled_kernel"), seed=0, sliding_window=32)
    kw = dict(cuda_graphs=False) if DEVICE.type == "cuda" else {}
    kernel = TargetTorch.load(tiny.target, DEVICE, "float32", attention_kernel=True, **kw)
    eager = TargetTorch.load(tiny.target, DEVICE, "float32", attention_kernel=False, **kw)
    assert kernel.attention_kernel and not eager.attention_kernel
    return kernel, eager


def test_kernel_attention_decodes_as_the_eager_step(targets, monkeypatch):
    from kakeya.backends.torch.kernels import attention

    kernel, eager = targets
    launches = []
    real = attention.decode_attention
    monkeypatch.setattr(attention, "decode_attention", lambda *a, **k: launches.append(a[0].shape[0]) or real(*a, **k))
    twins = []
    for k in range(4):
        prompt = [2] + [5 + (11 * i + k) % 300 for i in range(6 + 13 * k)]
        pair = [LocalVerifierSession(t, AUX, POLICIES[k % len(POLICIES)]) for t in (kernel, eager)]
        firsts = [s.prefill(prompt)[0] for s in pair]
        assert firsts[0] == firsts[1]
        twins.append((pair, firsts[0]))
    rng = np.random.default_rng(0)
    for r in range(5):
        chosen = twins if r % 2 == 0 else twins[:1]  # a batch, then one session alone (the same step)
        blocks = []
        for pair, last in chosen:
            L = int(rng.integers(1, pair[0].policy.slack + 1))
            blocks.append([last] + [int(t) for t in rng.integers(3, 1000, L - 1)])
        got = verify_batch([VerifyItem(pair[0], b) for (pair, _), b in zip(chosen, blocks)])
        want = verify_batch([VerifyItem(pair[1], b) for (pair, _), b in zip(chosen, blocks)])
        assert got == want, f"round {r}"
        for j, ((pair, _), b, c) in enumerate(zip(chosen, blocks, want)):
            keep = int(rng.integers(1, len(b) + 1))
            a_k, a_e = pair[0].commit(keep), pair[1].commit(keep)
            torch.testing.assert_close(a_k, a_e, rtol=1e-4, atol=1e-4)
            idx = twins.index(chosen[j])
            twins[idx] = (pair, c[keep - 1])
    assert twins[1][0][0].offset > twins[1][0][0].layout.capacity  # the sink-window ring wrapped
    layers = kernel.args.num_hidden_layers
    assert len(launches) >= 5 * layers and 4 in launches  # every attention of the batches: one launch each


@cuda_only
def test_captured_batches_decode_as_the_eager_step(tmp_path):
    """CUDA graphs of the batched step (one per shape, for any set of sessions: 5 sessions run as a
    bucket of 8) decode as the eager step does, one host sync per batched verify."""
    import warnings

    tiny = make_tiny(tmp_path, seed=0, sliding_window=32)
    graphed = TargetTorch.load(tiny.target, "cuda", "float32")
    eager = TargetTorch.load(tiny.target, "cuda", "float32", cuda_graphs=False, attention_kernel=False)
    assert graphed.graph_options.capture and graphed.attention_kernel
    pairs, lasts = [], []
    for k in range(5):
        prompt = [2] + [5 + (11 * i + k) % 300 for i in range(6 + 13 * k)]
        pair = [LocalVerifierSession(t, AUX, POLICIES[k % 2]) for t in (graphed, eager)]
        firsts = [s.prefill(prompt)[0] for s in pair]
        assert firsts[0] == firsts[1]
        pairs.append(pair)
        lasts.append(firsts[0])
    rng = np.random.default_rng(1)
    for r in range(6):
        blocks = [[t] + [int(x) for x in rng.integers(3, 1000, int(rng.integers(0, 16)))] for t in lasts]
        if r == 5:  # the shapes are captured by now: count the synchronising calls of one batched verify
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    got = verify_batch([VerifyItem(p[0], b) for p, b in zip(pairs, blocks)])
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            syncs = [str(w.message) for w in caught if "called a synchronizing" in str(w.message)]
            assert len(syncs) <= 1, syncs
        else:
            got = verify_batch([VerifyItem(p[0], b) for p, b in zip(pairs, blocks)])
        want = verify_batch([VerifyItem(p[1], b) for p, b in zip(pairs, blocks)])
        assert got == want, f"round {r}"
        for j, (p, b, c) in enumerate(zip(pairs, blocks, want)):
            keep = int(rng.integers(1, len(b) + 1))
            torch.testing.assert_close(p[0].commit(keep), p[1].commit(keep), rtol=1e-4, atol=1e-4)
            lasts[j] = c[keep - 1]
    shapes = list(graphed.steps.graphs.steps)
    assert any(sh.sessions == 8 for sh in shapes)
    assert any(step.captured for step in graphed.steps.graphs.steps.values())
