"""The drafter's batched step with static shapes (drafter/torch_backend/batch_step.py) against exact shapes.

On a CPU the step runs eagerly (``capture=False``) through exactly the code a
CUDA graph records: the packed inputs, the tables and device-built masks, bucket
padding of blocks, lanes and extension rows, cache reuse across sessions. On CUDA
the captured graph is compared too.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from kakeya.backends.torch.graphs import BUCKETS, GraphOptions
from kakeya.drafter.backend import bind
from kakeya.drafter.local import TorchDrafter
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


@pytest.mark.parametrize("causal", [None, True])
def test_static_drafts_equal_eager_through_growth_ring_wraps_and_every_block_size(causal):
    eager, static = _pair(causal=causal)
    script = _script(60)
    want, n_eager = _drive(eager, script)
    got, n_static = _drive(static, script)
    assert got == want and n_static == n_eager
    assert any(len(d.tokens) == 15 for d in got) and any(d.tokens == () for d in got)  # B = 16 and B = 1 both ran
    reused = static.model.make_cache()  # the released cache, emptied, its ring pages kept
    assert reused.length == 0 and len(reused.ring_pages) == static.model.pool.ring // 16
    assert 0 < static.model.pool.ring < n_static  # the ring wrapped: bounded by the window, not the context


def test_a_reused_cache_drafts_like_a_fresh_one_and_graphs_are_kept():
    eager, static = _pair(seed=1, layer_types=("full_attention", "full_attention"), window=None)
    first = _script(20, seed=5)
    _drive(static, first)
    cache = static.model._free[-1]
    graphs = dict(static.model.steps.graphs.steps)
    assert graphs, "the static step built no steps"
    second = _script(25, seed=6)
    want, _ = _drive(eager, second)
    got, _ = _drive(static, second)
    assert got == want and static.model._free[-1] is cache  # the second session drafted in the first's cache
    assert set(graphs) <= set(static.model.steps.graphs.steps)  # the first session's steps were kept


def test_padding_up_to_a_bucket_never_changes_what_real_rows_see():
    eager, static = _pair(seed=2, layer_types=("full_attention",), window=None)
    for B in (3, 5, 6, 7, 9, 12, 15):  # all padded (buckets 4, 8, 16)
        e, s = eager.open_session(), static.open_session()
        ctx = _aux(20, B)
        assert s.draft(ctx, 7, B) == e.draft(ctx, 7, B)
        assert s.draft(_aux(2, B + 50), 9, B) == e.draft(_aux(2, B + 50), 9, B)
        e.close(), s.close()


@pytest.mark.parametrize("prompt", [5, 16, 40])
def test_the_extension_runs_inside_the_step_unless_it_outgrows_a_block(prompt, monkeypatch):
    """New aux rows up to a block's worth are extended by the static step itself (no eager
    step), from the very first call of a short prompt; more rows first go as an eager step of
    their own. A block-size-1 call (the extension alone, as after an n-gram-copied block) fuses too."""
    from kakeya.drafter.torch_backend.batch_step import DraftSteps

    eager, static = _pair(seed=4, window=40)
    eagerly = []
    steps = DraftSteps.__call__

    def counted(self, batch, aux, is_static):
        if self.model is static.model and not is_static:
            eagerly.append((batch.shape.ext, batch.shape.block))
        return steps(self, batch, aux, is_static)

    monkeypatch.setattr(DraftSteps, "__call__", counted)
    script = [(prompt, 9, 8)] + [
        (n, last, 1 if i % 3 == 0 else max(B, 2)) for i, (n, last, B) in enumerate(_script(50, seed=8)[1:])
    ]
    want, n_eager = _drive(eager, script)
    got, n_static = _drive(static, script)
    assert got == want and n_static == n_eager
    assert sum(d.tokens == () for d in got) == 17  # the extensions alone drafted nothing, as eagerly
    assert eagerly == ([(prompt, 0)] if prompt > 16 else [])  # every later call (1..16 rows) fused, block size 1 too


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
    assert any(st.captured for st in graphed.model.steps.graphs.steps.values())
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
def test_the_device_mask_through_the_tables_is_block_mask(keep, is_causal):
    """The step's device-built mask over a block's table (ring slots or full pages, then the block's
    lanes) shows exactly the keys ``context.block_mask`` -- the host rule MLX uses -- shows a block
    of the same context: through ring wraps, with padded lanes never keys."""
    from kakeya.backends.torch.graphs import unpack
    from kakeya.drafter.context import ContextLayout, block_mask
    from kakeya.drafter.torch_backend.batch_step import Batch, PooledAttention

    kind = "sliding_attention" if keep else "full_attention"
    model = _model(0, (kind,), None if keep is None else keep + 1, causal=is_causal)
    model.use_graphs(STATIC_CPU)
    cache, spec = model.make_cache(), model.layers[0].self_attn.spec
    layout = ContextLayout(keep)
    for n, B in [(1, 2), (2, 5), (5, 16), (9, 3), (30, 11), (2, 2), (40, 7)]:
        layout.append(n)
        C = cache.length + n
        batch = Batch(model.pool, [(cache, _aux(n, 0))], [(cache, [1] * B)], static=n <= 16)
        assert batch.shape.block >= B
        f = unpack(torch.from_numpy(batch.packed), batch.shape.fields(model.pool.page))
        _, _, kpos, _, mask = PooledAttention(model.pool, batch.shape, f)._group("ring" if keep else "full", spec)
        view = layout.block(B)
        want = block_mask(view, B, is_causal=is_causal, window=spec.window)
        rel = kpos[0].numpy() - C  # each slot's position relative to the block's first query
        col = rel + view.n_ctx  # its column in block_mask's keys (the visible context, then the block)
        held = (kpos[0].numpy() >= 0) & (col >= 0) & (col < view.n_ctx + B)
        for q in range(B):
            expect = held.copy()
            if want is not None:
                expect[held] = want[q, col[held]]
            assert np.array_equal(mask[0, 0].expand(batch.shape.block, -1)[q].numpy(), expect), (n, B, q)
