"""The drafter's static-shape block step (drafter/step_torch.py) against the eager forward.

On a CPU the step runs eagerly (``capture=False``) through exactly the code a
CUDA graph records: device row indices, the capacity-span mask, bucket padding,
cache reuse across sessions. On CUDA the captured graph is compared too.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from kakeya.backends.torch.graphs import BUCKETS, GraphOptions
from kakeya.drafter.backend import bind
from kakeya.drafter.session import TorchDrafter
from kakeya.drafter.torch_backend.model import DFlashConfig, DFlashDraftModel, TargetHead

STATIC_CPU = GraphOptions(capture=False, buckets=BUCKETS, static_extent=True)
VOCAB, HIDDEN = 96, 32


def _model(seed: int, layer_types, window: int | None, device="cpu", causal=None) -> DFlashDraftModel:
    cfg = DFlashConfig.from_dict(
        {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": HIDDEN,
            "num_hidden_layers": len(layer_types),
            "layer_types": list(layer_types),
            "sliding_window": window,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "intermediate_size": 64,
            "vocab_size": VOCAB,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "max_position_embeddings": 4096,
            "final_logit_softcapping": 30.0,
            **({"is_causal": causal} if causal is not None else {}),
            "dflash_config": {"block_size": 16, "target_layer_ids": [0, 1], "mask_token_id": 4},
        }
    )
    torch.manual_seed(seed)
    model = DFlashDraftModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5 if p.ndim == 1 else p.shape[-1] ** -0.5).add_(1.0 if p.ndim == 1 else 0.0)
    embed = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(seed + 1))
    # float64 on the CPU: the eager and static paths sum in different orders, and random weights give
    # near-tied logits whose float32 argmax flips with the CPU's kernels (one did on one VM, at index 32);
    # what these tests check is indexing, masks and padding, which a flip would hide, not show
    dtype = torch.float64 if device == "cpu" else torch.float32
    model = model.to(device, dtype).eval().requires_grad_(False)
    model.inv_freq = model.inv_freq.to(device).float()
    return bind(model, TargetHead(embed.to(device, dtype)))


def _pair(seed=0, layer_types=("sliding_attention", "full_attention", "sliding_attention"), window=12, **kw):
    eager = TorchDrafter(model=_model(seed, layer_types, window, **kw), cuda_graphs=False)
    static = TorchDrafter(model=_model(seed, layer_types, window, **kw), graph_options=STATIC_CPU)
    return eager, static


def _script(steps: int, seed: int = 3):
    """(new aux rows, last token, block size) per call: the first call brings a prompt's worth."""
    rng = np.random.default_rng(seed)
    out = [(int(rng.integers(5, 40)), int(rng.integers(5, VOCAB)), int(rng.integers(2, 17)))]
    for _ in range(steps):
        out.append((int(rng.integers(1, 17)), int(rng.integers(5, VOCAB)), int(rng.integers(1, 17))))
    return out


def _aux(n: int, seed: int, device="cpu") -> torch.Tensor:
    return torch.randn(n, 2 * HIDDEN, generator=torch.Generator().manual_seed(seed)).to(device)


def _drive(drafter, script, device="cpu"):
    s = drafter.open_session()
    out = [s.draft(_aux(n, 100 + i, device), last, B) for i, (n, last, B) in enumerate(script)]
    length = s.cache.length
    s.close()
    return out, length


@pytest.fixture(params=["sdpa", "folded"])
def attention(request, monkeypatch):
    """The drafter's attention as on the CPU, and as on CUDA (query heads folded per KV head, which
    only a CUDA tensor takes otherwise): a GQA drafter's one-row mask broke only the latter."""
    if request.param == "folded":
        import kakeya.drafter.torch_backend.model as draft_model
        from kakeya.backends.torch import ops

        def folded(q, k, v, mask, scale):
            assert mask is None or mask.dim() == 2
            return ops.sdpa_folded(q, k, v, mask, scale)

        monkeypatch.setattr(draft_model, "sdpa", folded)
    return request.param


@pytest.mark.parametrize("causal", [None, True])
def test_static_drafts_equal_eager_through_growth_compaction_and_every_block_size(causal, attention):
    eager, static = _pair(causal=causal)
    script = _script(60)
    want, n_eager = _drive(eager, script)
    got, n_static = _drive(static, script)
    assert got == want and n_static == n_eager
    assert any(len(d.tokens) == 15 for d in got) and any(d.tokens == () for d in got)  # B = 16 and B = 1 both ran
    sliding = static.model.make_cache()  # the released cache: the sliding buffer compacted in place
    assert sliding.plan.length == 0 and sliding.static is not None
    assert 0 < sliding.plan.layouts[0].capacity < n_static  # bounded by the window, not the context


def test_a_reused_cache_drafts_like_a_fresh_one_and_graphs_are_kept():
    eager, static = _pair(seed=1, layer_types=("full_attention", "full_attention"), window=None)
    first = _script(20, seed=5)
    _drive(static, first)
    cache = static.model._free[-1]
    graphs = dict(cache.static.graphs.steps)
    assert graphs, "the static step built no steps"
    second = _script(25, seed=6)
    want, _ = _drive(eager, second)
    got, _ = _drive(static, second)
    assert got == want
    assert set(graphs) <= set(cache.static.graphs.steps)  # the first session's steps were reused


def test_padding_up_to_a_bucket_never_changes_what_real_rows_see():
    eager, static = _pair(seed=2, layer_types=("full_attention",), window=None)
    for B in (3, 5, 6, 7, 9, 12, 15):  # all padded (buckets 4, 8, 16)
        e, s = eager.open_session(), static.open_session()
        ctx = _aux(20, B)
        assert s.draft(ctx, 7, B) == e.draft(ctx, 7, B)
        assert s.draft(_aux(2, B + 50), 9, B) == e.draft(_aux(2, B + 50), 9, B)
        e.close(), s.close()


@pytest.mark.parametrize("prompt", [5, 16, 40])
def test_the_extension_runs_inside_the_step_unless_it_outgrows_a_block(prompt):
    """New aux rows up to a block's worth are extended by the static step itself (no eager
    extension launches), from the very first call of a short prompt; more rows first go eagerly.
    A block-size-1 call (the extension alone, as after an n-gram-copied block) fuses too."""
    eager, static = _pair(seed=4, window=40)
    eagerly = []
    context_kv = static.model.context_kv  # the eager extension's projection (the step has its own)
    static.model.context_kv = lambda auxs, offsets: (
        eagerly.extend(a.shape[0] for a in auxs) or context_kv(auxs, offsets)
    )
    script = [(prompt, 9, 8)] + [
        (n, last, 1 if i % 3 == 0 else max(B, 2)) for i, (n, last, B) in enumerate(_script(50, seed=8)[1:])
    ]
    want, n_eager = _drive(eager, script)
    got, n_static = _drive(static, script)
    assert got == want and n_static == n_eager
    assert sum(d.tokens == () for d in got) == 17  # the extensions alone drafted nothing, as eagerly
    assert eagerly == ([prompt] if prompt > 16 else [])  # every later call (1..16 rows) fused, block size 1 too


def test_closed_session_reports_empty_stats_and_refuses_work():
    _, static = _pair()
    s = static.open_session()
    s.draft(_aux(8, 0), 5, 4)
    s.close()
    s.close()  # idempotent: the cache is released once
    assert s.stats().context_len == 0 and len(static.model._free) == 1
    with pytest.raises(RuntimeError, match="closed"):
        s.draft(_aux(1, 0), 5, 4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_drafts_equal_eager_cuda_with_one_host_sync_per_draft():
    eager = TorchDrafter(model=_model(0, ("sliding_attention", "full_attention"), 12, device="cuda"), cuda_graphs=False)
    graphed = TorchDrafter(model=_model(0, ("sliding_attention", "full_attention"), 12, device="cuda"))
    assert graphed.model.static_step.options.capture
    script = _script(40)
    want, _ = _drive(eager, script, "cuda")
    got, _ = _drive(graphed, script, "cuda")
    assert got == want
    s = graphed.open_session()
    s.draft(_aux(20, 0, "cuda"), 5, 8)
    s.draft(_aux(1, 1, "cuda"), 5, 8)  # captured by now
    assert any(st.captured for st in s.cache.static.graphs.steps.values())
    aux = _aux(1, 2, "cuda")  # (made outside: a copy from pageable host memory syncs)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            s.draft(aux, 6, 8)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "called a synchronizing" in str(w.message)]
    assert len(syncs) <= 1, [str(w.message) for w in syncs]


@pytest.mark.parametrize("keep,is_causal", [(None, False), (None, True), (7, True), (7, False), (3, True)])
def test_the_device_mask_is_block_mask_over_the_capacity(keep, is_causal):
    """step_torch's device-built mask equals context.block_mask(span="capacity") -- the host rule
    the eager forward uses -- with a padded block's extra rows masked out as keys."""
    from types import SimpleNamespace

    from kakeya.drafter.context import ContextLayout, block_mask
    from kakeya.drafter.torch_backend.step import _mask

    attn = SimpleNamespace(is_causal=is_causal, window=None if keep is None else keep + 1)
    layout = ContextLayout(keep, step=4)
    for n, B, padded in [(1, 2, 2), (2, 5, 8), (5, 16, 16), (9, 3, 4), (30, 11, 16), (2, 2, 2)]:
        layout.append(n)
        view = layout.block(padded, scratch=True, span="capacity")
        want = block_mask(view, padded, is_causal=is_causal, window=attn.window, span="capacity")
        want[:, view.stop + B : view.stop + padded] = False  # padded rows are never keys
        bounds = torch.tensor([0, view.start, view.stop])
        got = _mask(bounds, torch.arange(layout.capacity), torch.arange(padded), torch.tensor(B), attn)
        assert torch.equal(got, torch.from_numpy(want))
