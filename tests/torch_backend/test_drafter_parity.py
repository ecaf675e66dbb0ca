"""Torch DFlash drafter == the ``dflash`` package's torch draft model (and == the MLX drafter).

Reference: ``dflash.model.DFlashDraftModel`` (dflash==0.1.0) loaded with
``from_pretrained`` from the same draft directory. It takes the block's token
embedding from its caller; we hand it OUR convention explicitly (Gap-B, BRIEF
§3): the target's RAW embedding row x ``input_embedding_scale`` -- which is also
what the reference's own torch loop (``_raw_input_embeddings``) does.
It runs the whole context at once, without a cache; ours extends its context
cache step by step.
"""

from __future__ import annotations

import json
import shutil
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kakeya.drafter.backend import extend
from kakeya.drafter.torch_backend.load import load_dflash_torch

ATOL = 1e-4  # observed: 0 on the tiny pair, ~1e-6 with sliding layers / scales

STEPS = [13, 1, 5, 2, 1, 8, 3, 30, 1, 4, 7]


@pytest.fixture(scope="module")
def variants(tiny, tmp_path_factory):
    """The tiny draft as is, and a copy with sliding + full layers and non-unit scales."""
    mixed = tmp_path_factory.mktemp("torch_draft_mixed") / "draft"
    shutil.copytree(tiny.draft, mixed)
    cfg = json.loads((mixed / "config.json").read_text())
    cfg["layer_types"] = ["sliding_attention", "full_attention"]
    cfg["sliding_window"] = 8
    cfg["use_sliding_window"] = True
    cfg["dflash_config"].update(input_embedding_scale=1.5, output_multiplier=0.7)
    cfg["final_logit_softcapping"] = 20.0
    (mixed / "config.json").write_text(json.dumps(cfg))
    return {"tiny": tiny.draft, "mixed": mixed}


def _reference(draft_dir):
    from dflash.model import DFlashDraftModel

    return DFlashDraftModel.from_pretrained(str(draft_dir), dtype=torch.float32).eval()


def _reference_logits(ref, ours, aux, block):
    """The reference over the whole context at once, our embedding convention handed in."""
    C, B = aux.shape[0], block.shape[0]
    scale = float(ours.config.input_embedding_scale)
    noise = F.embedding(block[None], ours.target.embed) * scale  # RAW row x input_embedding_scale
    with torch.no_grad():
        h = ref(position_ids=torch.arange(C + B)[None], noise_embedding=noise, target_hidden=aux[None])
        return ref.compute_logits(h[:, 1:], lambda x: F.linear(x, ours.target.head))[0]


@pytest.mark.parametrize("fused", [False, True], ids=["as-loaded", "fused"])
@pytest.mark.parametrize("name", ["tiny", "mixed"])
def test_incremental_cache_matches_reference(variants, tiny, name, fused):
    ours = load_dflash_torch(variants[name], tiny.target, "cpu", "float32")
    if fused:  # what TorchDrafter serves: q/k/v and gate/up as one GEMM each
        ours.fuse_projections()
    ref = _reference(variants[name])
    aux = torch.from_numpy(
        np.random.default_rng(0).standard_normal((sum(STEPS), ours.config.aux_width)).astype(np.float32)
    )
    cache, pos = ours.make_cache(), 0
    for i, n in enumerate(STEPS):
        extend(ours, [cache], [aux[pos : pos + n]])
        pos += n
        B = [2, 5, 8, 16][i % 4]
        block = torch.tensor([100 + 37 * i] + [ours.config.mask_token_id] * (B - 1))
        mine = ours.block_logits([(cache, block.tolist())])
        theirs = _reference_logits(ref, ours, aux[:pos], block)
        err = float((mine - theirs).abs().max())
        assert err <= ATOL, f"{name} step {i} (ctx {pos}): max |diff| {err}"
        assert torch.equal(mine.argmax(-1), theirs.argmax(-1))
    assert cache.length == pos


def test_gap_b_embedding_convention(tiny, torch_drafter):
    """Block embedding = the target's RAW row x input_embedding_scale, never x sqrt(hidden)."""
    from dflash.model import _raw_input_embeddings
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny.target, dtype=torch.float32).eval()
    model = torch_drafter.model
    ids = torch.tensor([5, 77, model.config.mask_token_id])
    ours = model.target.embed_rows(ids) * model.config.input_embedding_scale
    assert torch.equal(ours, _raw_input_embeddings(hf, ids, model.config.input_embedding_scale))
    with torch.no_grad():
        gemma_scaled = hf.get_input_embeddings()(ids)  # what the target itself feeds its layers
    assert torch.allclose(gemma_scaled, ours * hf.config.hidden_size**0.5, atol=1e-5)
    assert not torch.allclose(gemma_scaled, ours, atol=1e-2)


def test_matches_mlx_drafter(tiny, torch_drafter):
    import mlx.core as mx

    from kakeya.drafter.mlx_backend.model import load_dflash_mlx

    ours, theirs = torch_drafter.model, load_dflash_mlx(tiny.draft, tiny.target)
    aux = np.random.default_rng(1).standard_normal((sum(STEPS), ours.config.aux_width)).astype(np.float32)
    c1, c2, pos = ours.make_cache(), theirs.make_cache(), 0
    for i, n in enumerate(STEPS):
        extend(ours, [c1], [torch.from_numpy(aux[pos : pos + n])])
        extend(theirs, [c2], [mx.array(aux[pos : pos + n])])
        pos += n
        block = [11 * i + 5] + [ours.config.mask_token_id] * 7
        a = ours.block_logits([(c1, block)]).numpy()
        b = np.asarray(theirs.block_logits([(c2, block)]))
        assert np.abs(a - b).max() <= ATOL, f"step {i}"
        assert (a.argmax(-1) == b.argmax(-1)).all()


def test_speculative_loop_matches_reference_loop(tiny, torch_target, torch_drafter, monkeypatch):
    """Our loop (torch verifier + torch drafter) proposes the same candidates, block by block,
    as the reference's ``dflash_generate`` on transformers' Gemma-4 with its draft model."""
    import dflash.model as dm
    from transformers import AutoModelForCausalLM

    from kakeya.orchestrator.decode.loop import run
    from kakeya.verifier.local import LocalVerifier

    from .conftest import AUX_LAYERS, PROMPT

    monkeypatch.setattr(dm, "_cuda_time", time.perf_counter)  # CPU run with return_stats
    ref = _reference(tiny.draft)
    drafted: list[list[int]] = []
    compute_logits = ref.compute_logits

    def recording(hidden, head):
        logits = compute_logits(hidden, head)
        drafted.append(logits.argmax(-1)[0].tolist())
        return logits

    monkeypatch.setattr(ref, "compute_logits", recording)
    hf = AutoModelForCausalLM.from_pretrained(tiny.target, dtype=torch.float32).eval()
    n, B = 80, 8
    st = dm.dflash_generate(ref, hf, torch.tensor([PROMPT]), n, None, block_size=B, return_stats=True)

    class Recorder:
        def __init__(self, session):
            self.session, self.drafted = session, []

        def draft(self, new_aux, last, block_size):
            out = self.session.draft(new_aux, last, block_size)
            self.drafted.append(out)
            return out

        def close(self):
            self.session.close()

    rec = Recorder(torch_drafter.open_session())
    gen = run(LocalVerifier(torch_target, tiny.target, AUX_LAYERS).open_session(), rec, PROMPT, n, B)
    assert gen.token_ids == st.output_ids[0, len(PROMPT) :].tolist()
    # the loops cut their last blocks differently at max_tokens: compare the full-size blocks
    mine = [list(d.tokens) for d in rec.drafted]
    k = sum(1 for a, b in zip(mine, drafted) if len(a) == len(b) == B - 1)
    assert k > 40
    assert mine[:k] == drafted[:k]
    assert gen.acceptance_lengths[:k] == st.acceptance_lengths[:k]


def test_fused_projections_are_views_of_one_weight(tiny):
    """Fusing adds no memory and keeps every checkpoint name and value; a second call is a no-op."""
    model = load_dflash_torch(tiny.draft, tiny.target, "cpu", "float32")
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def held_bytes():
        storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
        return sum(storages.values())

    bytes_before = held_bytes()
    model.fuse_projections()
    after = model.state_dict()
    assert set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    for part in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert part.weight.untyped_storage().data_ptr() == attn.wqkv.untyped_storage().data_ptr()
    assert mlp.up_proj.weight.untyped_storage().data_ptr() == mlp.w_gate_up.untyped_storage().data_ptr()
    assert held_bytes() == bytes_before
    wqkv, context = attn.wqkv, model.w_context_kv
    kv_rows = sum(l.self_attn.k_proj.weight.numel() + l.self_attn.v_proj.weight.numel() for l in model.layers)
    assert context.numel() == kv_rows  # the one copy: the layers' K/V rows
    model.fuse_projections()
    assert attn.wqkv is wqkv and model.w_context_kv is context


def test_fused_context_kv_equals_each_layers_own(tiny):
    """The context rows go through every layer's K/V projection, norm and RoPE at once."""
    model = load_dflash_torch(tiny.draft, tiny.target, "cpu", "float32")
    aux = torch.randn(7, model.config.aux_width, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        (each,) = model.context_kv([aux], [5])
        model.fuse_projections()
        (fused,) = model.context_kv([aux], [5])
    assert len(fused) == len(each) == len(model.layers)
    for (k, v), (k1, v1) in zip(fused, each):
        assert k.shape == k1.shape and v.shape == v1.shape
        torch.testing.assert_close(k, k1, rtol=0, atol=1e-6)
        torch.testing.assert_close(v, v1, rtol=0, atol=1e-6)
