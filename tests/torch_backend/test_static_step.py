"""The verify step with CUDA's static shapes (verifier/torch_backend/batch_step.py) and its graph
wrapper (graphs.py), on a CPU.

``GraphOptions(capture=False, buckets=BUCKETS, static_extent=True)`` runs exactly
what a CUDA device captures -- padded buckets, fixed extents, static packed
inputs, one step per shape kept and reused by every session, steps dropped when
a pool grows -- eagerly; its outputs must equal the CPU default path's (exact
lengths, filled extents) token for token, and the caches must end as after an
unpadded verify. The replay test at the bottom needs a CUDA device.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from kakeya.backends.torch.graphs import BUCKETS, GraphOptions, StepGraphs, bucket_for
from kakeya.core.request import CachePolicy
from kakeya.orchestrator.decode.loop import run
from kakeya.verifier.local import LocalVerifier
from kakeya.verifier.session import LocalVerifierSession
from kakeya.verifier.torch_backend.target import TargetTorch

from ..policy_reference import torch_greedy
from .conftest import AUX_LAYERS, PROMPT

GRAPH_MODE = GraphOptions(capture=False, buckets=BUCKETS, static_extent=True)


@pytest.fixture(scope="module")
def graph_target(tiny):
    """The tiny target with CUDA's step layout, run eagerly: full extents from 40 positions (then doubling),
    pools of two pages a chunk (so they grow)."""
    return TargetTorch.load(tiny.target, "cpu", "float32", graph_options=GRAPH_MODE, max_context=40, chunk_pages=2)


def test_bucket_choice():
    assert [bucket_for(n, BUCKETS, 16) for n in range(1, 17)] == [1, 2, 4, 4] + [8] * 4 + [16] * 8
    assert bucket_for(3, None, 16) == 3  # no buckets: every length as is (the CPU default)
    assert bucket_for(5, BUCKETS, 6) == 5  # a padded block must stay within the ring's slack
    with pytest.raises(ValueError):
        bucket_for(0, BUCKETS, 16)
    with pytest.raises(ValueError):
        bucket_for(17, BUCKETS, 16)


def test_graph_options_per_device():
    assert GraphOptions.for_device(torch.device("cpu")) == GraphOptions()  # eager, exact, filled extents
    assert GraphOptions.for_device(torch.device("cpu"), cuda_graphs=False) == GraphOptions()
    with pytest.raises(ValueError, match="CUDA"):
        GraphOptions.for_device(torch.device("cpu"), cuda_graphs=True)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            TargetTorch.random(_small_args(), "cpu", "float32", graph_options=GraphOptions(capture=True))


def _small_args():
    from kakeya.verifier.torch_backend.gemma4 import Gemma4Args

    return Gemma4Args(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        global_head_dim=16,
        sliding_window=8,
        hidden_size_per_layer_input=0,
    )


def test_step_graphs_build_once_per_key_and_forget_on_invalidate():
    calls = []
    graphs = StepGraphs(GraphOptions())
    x = torch.zeros(2)
    make = lambda key: (lambda t: calls.append(key) or t + key, (x,))
    s1 = graphs.get(4, make)
    assert graphs.get(4, make) is s1 and graphs.captures == 1
    x.fill_(1.0)  # inputs are read at call time: static buffers written in place
    assert s1().tolist() == [5.0, 5.0] and not s1.captured
    graphs.invalidate()
    assert graphs.get(4, make) is not s1 and graphs.captures == 2


def _decode(target, seq, prefill, seed=0, policy=CachePolicy()):
    """Choices and aux of verify/commit blocks (a kept prefix, garbage after it) along ``seq``."""
    s = LocalVerifierSession(target, AUX_LAYERS, policy)
    s.prefill(seq[:prefill])
    rng = np.random.default_rng(seed)
    pos, out = prefill, []
    while pos < len(seq):
        k = int(rng.choice([1, 2, 3, 5, 7, 8, 11, 16]))
        j = min(int(rng.integers(1, k + 1)), len(seq) - pos)
        garbage = [int(t) for t in rng.integers(5, target.args.vocab_size, k - j)]
        choices = s.verify(seq[pos : pos + j] + garbage)
        aux = s.commit(j)
        out.append((choices, aux.clone()))
        pos += j
        assert (
            s.offset == pos and s.layout.positions.max() < pos
        )  # padding trimmed (the layout: the one position counter)
    return s, out


def test_graph_layout_equals_the_cpu_path(torch_target, graph_target):
    seq = [2] + [int(t) for t in np.random.default_rng(1).integers(5, torch_target.args.vocab_size, 150)]
    _, ref = _decode(torch_target, seq, prefill=20)
    s, got = _decode(graph_target, seq, prefill=20)
    for (c0, a0), (c1, a1) in zip(ref, got):
        assert c1 == c0
        torch.testing.assert_close(a1, a0, rtol=1e-4, atol=1e-4)  # float32 reduction order (other extents)
    shapes = list(graph_target.steps.graphs.steps)
    assert shapes and {sh.block for sh in shapes} <= set(BUCKETS)  # every step ran at a bucket's length
    assert {sh.sessions for sh in shapes} == {1} and not any(sh.ragged for sh in shapes)
    assert {sh.full for sh in shapes} <= {48, 80, 160, 320}  # 40 * 2**k positions, in whole pages of 16
    assert max(sh.full for sh in shapes) >= 160  # the context outgrew 40 and 80: doubled twice
    assert {sh.ring for sh in shapes} == {len(s.cache.ring_pages) * 16}  # the whole ring: fixed shapes
    assert all(sh.generation == shapes[-1].generation for sh in shapes)  # steps of outgrown pools were dropped


def test_padded_verify_leaves_the_caches_as_an_unpadded_one(torch_target, graph_target):
    ids = PROMPT + [61, 62, 63]
    a = LocalVerifierSession(torch_target, AUX_LAYERS, CachePolicy())
    b = LocalVerifierSession(graph_target, AUX_LAYERS, CachePolicy())
    for s in (a, b):
        s.prefill(PROMPT)
    assert b.verify([61, 62, 63]) == a.verify([61, 62, 63])  # b ran at length 4
    assert any(sh.block == 4 and sh.sessions == 1 for sh in graph_target.steps.graphs.steps)
    a.commit(3), b.commit(3)
    assert (b.layout.positions >= 0).sum() == (a.layout.positions >= 0).sum() == len(ids)
    assert b.layout.offset == a.layout.offset and np.array_equal(b.layout.positions, a.layout.positions)
    assert b.verify([64]) == a.verify([64])


def test_one_host_sync_per_verify(torch_target, graph_target, monkeypatch):
    for target in (torch_target, graph_target):
        s = LocalVerifierSession(target, AUX_LAYERS, CachePolicy())
        s.prefill(PROMPT)
        s.verify([61, 62, 63, 64, 65])  # graph mode: the first call of a shape builds its step
        s.commit(0)
        syncs = []
        for name in ("tolist", "item", "__bool__", "cpu", "numpy"):
            orig = getattr(torch.Tensor, name)
            monkeypatch.setattr(
                torch.Tensor, name, lambda self, *a, _o=orig, _n=name, _s=syncs, **k: _s.append(_n) or _o(self, *a, **k)
            )
        s.verify([61, 62, 63, 64, 65])
        monkeypatch.undo()
        assert syncs == ["tolist"], syncs  # the choices, and nothing else reads the device


def test_a_closed_sessions_pages_and_the_targets_steps_serve_the_next_session(graph_target):
    s1 = LocalVerifierSession(graph_target, AUX_LAYERS, CachePolicy())
    s1.prefill(PROMPT)
    first = s1.verify([61])
    pages = (list(s1.cache.ring_pages), list(s1.cache.full_pages))
    steps, captures = dict(graph_target.steps.graphs.steps), graph_target.steps.graphs.captures
    s1.close()
    s2 = LocalVerifierSession(graph_target, AUX_LAYERS, CachePolicy())
    assert s2.cache.ring_pages == pages[0]  # the closed session's pages, handed out again
    s2.prefill(PROMPT)
    assert s2.cache.full_pages == pages[1]
    assert s2.verify([61]) == first  # stale K/V of the previous session are never attended
    assert graph_target.steps.graphs.captures == captures  # nothing rebuilt: steps are per shape, not per session
    assert all(graph_target.steps.graphs.steps[k] is v for k, v in steps.items())
    s2.close()


def test_sdpa_runs_with_cudnn_off_in_the_target_and_the_drafter(torch_target, torch_drafter, monkeypatch):
    from kakeya.backends.torch import ops

    seen = []
    real = ops.F.scaled_dot_product_attention

    def spy(*a, **k):
        seen.append(
            (
                torch.backends.cuda.cudnn_sdp_enabled(),
                torch.backends.cuda.flash_sdp_enabled(),
                torch.backends.cuda.mem_efficient_sdp_enabled(),
                torch.backends.cuda.math_sdp_enabled(),
            )
        )
        return real(*a, **k)

    def go():
        s = LocalVerifierSession(torch_target, AUX_LAYERS, CachePolicy())
        first, aux = s.prefill(PROMPT)
        choices = s.verify([first, 61, 62])
        d = torch_drafter.open_session().draft(aux, first, 4)
        return choices, d

    before = go()
    monkeypatch.setattr(ops.F, "scaled_dot_product_attention", spy)
    after = go()
    assert after == before
    n_layers = torch_target.args.num_hidden_layers
    assert len(seen) >= 2 * n_layers + torch_drafter.model.config.num_hidden_layers
    assert set(seen) == {(False, True, True, True)}  # cuDNN never, flash/efficient/math allowed
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored outside the forwards


def test_graph_layout_decodes_greedy_ar_with_the_drafter(tiny, graph_target, torch_drafter, torch_target):
    ref = torch_greedy(torch_target, PROMPT, 80)
    v = LocalVerifier(graph_target, tiny.target, AUX_LAYERS)
    for block_size in (3, 8, 16):
        assert run(v.open_session(), torch_drafter.open_session(), PROMPT, 80, block_size).token_ids == ref


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_replay_equals_eager_token_for_token(tiny, torch_drafter):
    eager = TargetTorch.load(tiny.target, "cuda", "float32", cuda_graphs=False)
    graphed = TargetTorch.load(tiny.target, "cuda", "float32")
    assert graphed.graph_options.capture
    ref = torch_greedy(eager, PROMPT, 120)
    drafter = type(torch_drafter)(tiny.draft, tiny.target, "cuda", "float32")
    for block_size in (1, 3, 8, 16):
        gen = run(
            LocalVerifier(graphed, tiny.target, AUX_LAYERS).open_session(),
            drafter.open_session(),
            PROMPT,
            120,
            block_size,
        )
        assert gen.token_ids == ref
    s = LocalVerifierSession(graphed, AUX_LAYERS, CachePolicy())
    s.prefill(PROMPT)
    s.verify([61, 62, 63])
    s.commit(0)
    assert any(step.captured for step in graphed.steps.graphs.steps.values())
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:  # each synchronizing call warns once
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            s.verify([61, 62, 63])
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "called a synchronizing" in str(w.message)]
    assert len(syncs) <= 1, syncs  # the choices' .tolist(), nothing else


def test_cli_fast_path_flags_reach_the_torch_verifier():
    import argparse

    from kakeya.app.options import add_backend_args, torch_options

    p = argparse.ArgumentParser()
    add_backend_args(p)
    assert torch_options(p.parse_args([])) == {}  # auto: graphs follow the device, nothing compiled
    assert torch_options(p.parse_args(["--cuda-graphs", "off", "--compile"])) == {"cuda_graphs": False, "compile": True}
    assert torch_options(p.parse_args(["--cuda-graphs", "on"])) == {"cuda_graphs": True}


def test_cpu_never_compiles(tiny, monkeypatch):
    from kakeya.orchestrator.assembly import build_local_engine

    def refuse(*a, **k):
        raise AssertionError("torch.compile called on the CPU default path")

    monkeypatch.setattr(torch, "compile", refuse)
    engine = build_local_engine(tiny.target, tiny.draft, "torch", "cpu")
    assert not engine.verifier.target.graph_options.capture
    with pytest.raises(ValueError, match="CUDA"):
        build_local_engine(tiny.target, tiny.draft, "torch", "cpu", torch_options={"cuda_graphs": True})
    with pytest.raises(ValueError, match="--compile applies to --device cuda, not cpu"):
        build_local_engine(tiny.target, tiny.draft, "torch", "cpu", torch_options={"compile": True})


def test_sdpa_backends_sets_what_sdpa_kernel_sets():
    from torch.nn.attention import sdpa_kernel

    from kakeya.backends.torch.ops import SDPA_BACKENDS, _sdp_flags, sdpa_backends

    outside = _sdp_flags()
    with sdpa_kernel(list(SDPA_BACKENDS)):
        reference = _sdp_flags()
    with sdpa_backends():
        assert _sdp_flags() == reference == (False, True, True, True)
    assert _sdp_flags() == outside
