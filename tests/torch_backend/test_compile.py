"""``--compile``: every layer's row-wise halves through ``torch.compile`` (inductor's C++ backend
here; Triton on CUDA) decode exactly what the eager layers decode, and compile once per layer
kind, not once per length. ``fullgraph=True`` makes any graph break an error."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from kakeya.backends.torch import ops
from kakeya.backends.torch.graphs import BUCKETS, GraphOptions
from kakeya.core.request import CachePolicy
from kakeya.drafter.local import TorchDrafter
from kakeya.orchestrator.decode.loop import run
from kakeya.verifier.local import LocalVerifier
from kakeya.verifier.session import LocalVerifierSession
from kakeya.verifier.torch_backend.target import TargetTorch

from ..policy_reference import torch_greedy
from .conftest import PROMPT

STATIC = GraphOptions(capture=False, buckets=BUCKETS, static_extent=True)  # what CUDA captures, eagerly


@pytest.fixture(scope="module")
def compiled(tiny_moe):
    """The MoE pair with both models compiled, in CUDA's static-step layout."""
    torch._dynamo.reset()
    counters.clear()
    target = TargetTorch.load(tiny_moe.target, "cpu", "float32", graph_options=STATIC)
    target.model.compile_layers()
    drafter = TorchDrafter(tiny_moe.draft, tiny_moe.target, "cpu", "float32", graph_options=STATIC, compile=True)
    yield target, drafter
    torch._dynamo.reset()


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def test_compiled_pair_decodes_greedy_ar_token_for_token_and_compiles_once(tiny_moe, compiled):
    target, drafter = compiled
    assert all(isinstance(layer.attn.attend, ops.CompiledAttention) for layer in target.model.layers)
    ref = torch_greedy(TargetTorch.load(tiny_moe.target, "cpu", "float32"), PROMPT, 48)  # eager, plain caches
    v = LocalVerifier(target, tiny_moe.target, drafter.target_layer_ids)

    def decode(prompt, block_size):
        return run(v.open_session(), drafter.open_session(), prompt, 48, block_size).token_ids

    for block_size in (4, 16):  # first shapes (rows of one get their own graph: size 1 specialises)
        assert decode(PROMPT, block_size) == ref
    assert decode(PROMPT[:9], 8)
    settled = _graphs()
    assert settled > 0  # the compiled halves ran
    for block_size in (2, 7, 11):  # other buckets, prefill and extension lengths: the same graphs
        assert decode(PROMPT, block_size) == ref
    assert decode(PROMPT[:13], 5)
    assert _graphs() == settled  # no graph per new length


def test_compiled_verify_matches_eager_logits_and_aux(tiny_moe, compiled):
    target, drafter = compiled
    eager = TargetTorch.load(tiny_moe.target, "cpu", "float32", graph_options=STATIC)
    aux_layers = drafter.target_layer_ids
    seq = [2] + [int(t) for t in np.random.default_rng(3).integers(5, eager.args.vocab_size, 60)]
    a, b = (
        LocalVerifierSession(eager, aux_layers, CachePolicy()),
        LocalVerifierSession(target, aux_layers, CachePolicy()),
    )
    _, aux_a = a.prefill(seq[:20])
    _, aux_b = b.prefill(seq[:20])
    torch.testing.assert_close(aux_b, aux_a, rtol=1e-4, atol=1e-4)
    for start in range(20, 60, 8):
        assert b.verify(seq[start : start + 8]) == a.verify(seq[start : start + 8])
        torch.testing.assert_close(b.cache.last_logits, a.cache.last_logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(b.commit(5), a.commit(5), rtol=1e-4, atol=1e-4)


def test_compiled_drafter_drafts_what_the_eager_one_drafts(tiny_moe, compiled):
    _, drafter = compiled
    eager = TorchDrafter(tiny_moe.draft, tiny_moe.target, "cpu", "float32")
    width = eager.model.config.aux_width
    rng = np.random.default_rng(4)
    s, e = drafter.open_session(), eager.open_session()
    for i, (rows, B) in enumerate(
        [(30, 8)] + [(int(rng.integers(1, 17)), int(rng.integers(2, 17))) for _ in range(20)]
    ):
        aux = torch.randn(rows, width, generator=torch.Generator().manual_seed(i))
        assert s.draft(aux, 7 + i, B) == e.draft(aux, 7 + i, B)


def test_compiled_attention_takes_no_graph_per_cache_capacity(monkeypatch):
    """A layer attends over the first ``extent`` slots of cache buffers whose capacities differ (a
    sliding ring, full buffers that double). On the H200 (2026-11-28) the 26B projection's compiled
    attention took graph after graph on those views' strides and on the split count's
    ``extent % 32`` until dynamo's recompile limit (8) failed it; traced as before, the sequence
    here took two more graphs per capacity. CUDA's folded path (forced) over four capacities, each
    attended whole (a contiguous view) and in part, split 4 to 32 ways: every graph is taken at the
    first capacity, and the outputs are eager's."""
    monkeypatch.setattr(ops, "folds", lambda q, mask: True)  # CUDA's path, on the CPU
    attend = ops.CompiledAttention()
    g = torch.Generator().manual_seed(0)
    kv_heads, D, L = 2, 16, 3  # sizes apart from one another and the extents: no duck-sized coincidences
    q = torch.randn(1, L, 4, D, generator=g).transpose(1, 2)
    graphs = []
    for capacity in (512, 1024, 2048, 768):
        k, v = (torch.randn(1, kv_heads, capacity, D, generator=g) for _ in range(2))
        for n in (capacity, capacity - 64):
            mask = torch.rand(L, n, generator=g) < 0.9
            out = attend(q, k[:, :, :n], v[:, :, :n], mask, 1.0)
            torch.testing.assert_close(out, ops.sdpa(q, k[:, :, :n], v[:, :, :n], mask, 1.0, fold=True))
        graphs.append(_graphs())
    assert graphs[1:] == graphs[:1] * 3, f"graphs after each capacity: {graphs}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_compiled_graphs_decode_what_eager_cuda_decodes(tiny_moe):
    """Triton kernels captured in the CUDA graphs of both models: float32 greedy output equals
    the eager CUDA target's own greedy AR, token for token."""
    torch._dynamo.reset()
    ref = torch_greedy(TargetTorch.load(tiny_moe.target, "cuda", "float32", cuda_graphs=False), PROMPT, 48)
    target = TargetTorch.load(tiny_moe.target, "cuda", "float32")
    target.model.compile_layers()
    drafter = TorchDrafter.colocated(tiny_moe.draft, target, compile=True)
    assert target.graph_options.capture and drafter.model.static_step.options.capture
    v = LocalVerifier(target, tiny_moe.target, drafter.target_layer_ids)
    for block_size in (4, 16):
        assert run(v.open_session(), drafter.open_session(), PROMPT, 48, block_size).token_ids == ref
    torch._dynamo.reset()
