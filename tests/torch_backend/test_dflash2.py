"""The DFlash2 drafter (``drafter/torch_backend/dflash2.py``) against a reference forward written here from
the public description (vLLM's ``qwen3_dflash2.py`` and ``spec_decode/dflash2/speculator.py``; see
docs/dflash2.md), and greedy speculative output with it == the target's greedy AR.

The checkpoint is written the way DFlash2's own test-model writer writes one: ``architectures``
``["DFlash2DraftModel"]``, no ``model_type``, ``rope_parameters`` only, ``block_size`` and the conv and
selector fields inside ``dflash_config``, every layer ``sliding_attention``, ``is_causal`` false.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kakeya.core.request import CachePolicy
from kakeya.drafter.backend import extend
from kakeya.drafter.torch_backend.load import load_dflash_torch
from kakeya.orchestrator.decode.loop import run
from kakeya.verifier.local import LocalVerifier

from ..policy_reference import torch_greedy
from .conftest import AUX_LAYERS, PROMPT

TAPS, GROUP, RANK, TOP_K, WINDOW = 3, 16, 8, 6, 12


@pytest.fixture(scope="module")
def dflash2_dir(tiny, tmp_path_factory):
    from safetensors.numpy import load_file, save_file

    base = json.loads((tiny.draft / "config.json").read_text())
    n = base["num_hidden_layers"]
    cfg = {
        "architectures": ["DFlash2DraftModel"],
        "dtype": "float32",
        "is_causal": False,
        **{k: base[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")},
        **{k: base[k] for k in ("num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps", "hidden_act")},
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention"] * n,
        "max_position_embeddings": 1048576,
        "rope_parameters": {"rope_theta": 1000000},
        "dflash_config": {
            "block_size": 8,
            "conv_kernel_size": TAPS,
            "conv_group_size": GROUP,
            "target_layer_ids": base["dflash_config"]["target_layer_ids"],
            "mask_token_id": base["dflash_config"]["mask_token_id"],
            "selector_rank": RANK,
            "selector_top_k": TOP_K,
        },
    }
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    w = dict(load_file(str(tiny.draft / "model.safetensors")))
    rng = np.random.default_rng(7)

    def rand(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    for i in range(n):
        for name in ("attention_conv", "mlp_conv"):
            base_kernel = rand(2, TAPS, h, scale=0.2)
            base_kernel[:, 0] += 1.0  # near identity, as a trained one starts, with real mixing of earlier rows
            w[f"layers.{i}.{name}.base_kernel"] = base_kernel
            w[f"layers.{i}.{name}.kernel_projection.weight"] = rand(2 * TAPS * (h // GROUP), h, scale=0.05)
    w["candidate_selector.hidden_projection.weight"] = rand(RANK, h, scale=h**-0.5)
    w["candidate_selector.predecessor_codebook"] = rand(v, RANK, scale=2.0)
    w["candidate_selector.successor_codebook"] = rand(v, RANK, scale=2.0)
    d = tmp_path_factory.mktemp("dflash2") / "draft"
    d.mkdir()
    save_file(w, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(cfg))
    return d


# --------------------------------------------------------------------------- the reference, from the description


def _rms(x, w, eps):
    x = x.double()
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w.double()


def _rope(x, positions, theta):
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = positions.double()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    return x * cos + torch.cat([-x[..., hd // 2 :], x[..., : hd // 2]], -1) * sin


def _conv(x, coeff, base):
    """x [B, h]; coeff [B, taps, groups]; base [taps, h]: row p mixes rows p, p-1, .. of the block."""
    c = base[None] + coeff.repeat_interleave(GROUP, -1)
    out = torch.zeros_like(x)
    for p in range(x.shape[0]):
        for t in range(TAPS):
            if p - t >= 0:
                out[p] += c[p, t] * x[p - t]
    return out


def _reference(cfg, W, embed, head, aux, block):
    """Realized rows [B-1, vocab] and walk tokens of one block after context ``aux`` (float64, no cache)."""
    eps, nq, nkv, hd = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    theta = cfg["rope_parameters"]["rope_theta"]
    W = {k: v.double() for k, v in W.items()}
    C, B = aux.shape[0], len(block)
    ctx = _rms(aux.double() @ W["fc.weight"].T, W["hidden_norm.weight"], eps)
    x = embed.double()[block]
    pos_ctx, pos_blk = torch.arange(C), torch.arange(C, C + B)
    keypos = torch.cat([pos_ctx, pos_blk])
    visible = (pos_blk[:, None] - keypos[None]).abs() < WINDOW
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        a = _rms(x, W[p + "input_layernorm.weight"], eps)
        ca = (a @ W[p + "attention_conv.kernel_projection.weight"].T).view(B, 2, TAPS, -1)
        ab = _conv(a, ca[:, 0], W[p + "attention_conv.base_kernel"][0])

        def heads(rows, name, n, p=p):
            return (rows @ W[p + f"self_attn.{name}_proj.weight"].T).view(rows.shape[0], n, hd)

        q = _rope(_rms(heads(ab, "q", nq), W[p + "self_attn.q_norm.weight"], eps), pos_blk, theta)
        k = torch.cat(
            [
                _rope(_rms(heads(rows, "k", nkv), W[p + "self_attn.k_norm.weight"], eps), ps, theta)
                for rows, ps in ((ctx, pos_ctx), (ab, pos_blk))
            ]
        )
        v = torch.cat([heads(ctx, "v", nkv), heads(ab, "v", nkv)])
        k, v = k.repeat_interleave(nq // nkv, 1), v.repeat_interleave(nq // nkv, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) * hd**-0.5
        s = s.masked_fill(~visible[None], float("-inf"))
        o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(B, -1) @ W[p + "self_attn.o_proj.weight"].T
        x = x + _conv(o, ca[:, 1], W[p + "attention_conv.base_kernel"][1])
        m = _rms(x, W[p + "post_attention_layernorm.weight"], eps)
        cm = (m @ W[p + "mlp_conv.kernel_projection.weight"].T).view(B, 2, TAPS, -1)
        mb = _conv(m, cm[:, 0], W[p + "mlp_conv.base_kernel"][0])
        act = F.silu(mb @ W[p + "mlp.gate_proj.weight"].T) * (mb @ W[p + "mlp.up_proj.weight"].T)
        x = x + _conv(act @ W[p + "mlp.down_proj.weight"].T, cm[:, 1], W[p + "mlp_conv.base_kernel"][1])
    hn = _rms(x, W["norm.weight"], eps)[1:]
    logits = hn @ head.double().T
    logits = torch.tanh(logits / cfg["final_logit_softcapping"]) * cfg["final_logit_softcapping"]
    unary, cand = torch.topk(logits, TOP_K, -1)
    g = hn @ W["candidate_selector.hidden_projection.weight"].T
    mask = cfg["dflash_config"]["mask_token_id"]
    realized, tokens = torch.full_like(logits, float("-inf")), []
    choice = 0
    for r in range(B - 1):
        known = r == 0 or block[r] != mask  # the token before drafted row r (block row r)
        preds = [block[r]] * TOP_K if known else cand[r - 1].tolist()
        prev = 0 if known else choice
        pred = W["candidate_selector.predecessor_codebook"][preds[prev]]
        succ = W["candidate_selector.successor_codebook"][cand[r]]
        row = unary[r] + (succ * (pred * g[r])).sum(-1)
        choice = int(torch.argmax(row))
        realized[r, cand[r]] = row
        tokens.append(int(cand[r, choice]))
    return realized, tokens, logits


@pytest.fixture(scope="module")
def model(dflash2_dir, tiny):
    return load_dflash_torch(dflash2_dir, tiny.target, "cpu", "float32")


def test_loads_as_dflash2(model):
    from kakeya.drafter.torch_backend.dflash2 import DFlash2DraftModel

    assert isinstance(model, DFlash2DraftModel)
    assert model.config.dflash2.selector_top_k == TOP_K and model.config.block_size == 8


def test_missing_dflash2_field_is_named(dflash2_dir):
    from kakeya.drafter.config import DFlashConfig

    cfg = json.loads((dflash2_dir / "config.json").read_text())
    del cfg["dflash_config"]["selector_top_k"]
    with pytest.raises(ValueError, match="dflash_config.selector_top_k"):
        DFlashConfig.from_dict(cfg)
    cfg["dflash_config"].update(selector_top_k=4, conv_group_size=7)
    with pytest.raises(ValueError, match="conv_group_size 7 does not divide hidden_size"):
        DFlashConfig.from_dict(cfg)


def _blocks(model, mask):
    """Two sessions' caches, contexts of 19 and 27 rows (past the window), and three blocks: plain ones
    of 8 and 5 rows, and a pre-draft's block whose pending candidates are known tokens."""
    cfg = model.config
    g = torch.Generator().manual_seed(3)
    auxs = [torch.randn(n, cfg.aux_width, generator=g) for n in (19, 27)]
    caches = [model.make_cache(), model.make_cache()]
    extend(model, caches, auxs)
    blocks = [(caches[0], [40] + [mask] * 7), (caches[1], [41] + [mask] * 4), (caches[0], [40, 50, 51, mask, mask])]
    return auxs, [auxs[0], auxs[1], auxs[0]], blocks


def test_matches_reference_forward(model, dflash2_dir):
    from safetensors.torch import load_file

    cfg = json.loads((dflash2_dir / "config.json").read_text())
    cfg["final_logit_softcapping"] = model.config.final_logit_softcapping or 1e9
    W = load_file(str(dflash2_dir / "model.safetensors"))
    mask = cfg["dflash_config"]["mask_token_id"]
    _, ctx, blocks = _blocks(model, mask)
    ours = model.block_logits(blocks)
    tokens = model.argmax(ours, [])
    at, walked_off_argmax = 0, 0
    for aux, (_, block) in zip(ctx, blocks):
        realized, ref_tokens, plain = _reference(cfg, W, model.target.embed, model.target.head, aux, block)
        got = ours[at : at + len(block) - 1]
        assert torch.equal(torch.isinf(got), torch.isinf(realized))  # the same candidates in every row
        finite = torch.isfinite(realized)
        np.testing.assert_allclose(got[finite].double(), realized[finite], rtol=1e-4, atol=1e-4)
        assert tokens[at : at + len(block) - 1] == ref_tokens
        walked_off_argmax += sum(t != int(a) for t, a in zip(ref_tokens, plain.argmax(-1)))
        at += len(block) - 1
    assert walked_off_argmax > 0, "the selector never changed a token: the test would not see it"


def test_greedy_speculative_equals_target_ar(tiny, torch_target, dflash2_dir):
    from kakeya.drafter.local import TorchDrafter

    n = 160  # window 32: the target's ring wraps 5 times
    verifier = LocalVerifier(torch_target, tiny.target, AUX_LAYERS)
    drafter = TorchDrafter(dflash2_dir, tiny.target, "cpu", "float32")
    reference = torch_greedy(torch_target, PROMPT, n)
    for block_size in (4, 8):
        gen = run(verifier.open_session(CachePolicy()), drafter.open_session(), PROMPT, n, block_size)
        assert gen.token_ids == reference


def test_static_step_equals_eager(model, dflash2_dir, tiny):
    """The padded layout a CUDA graph records (blocks padded to a lane bucket, packed drafted rows)."""
    from kakeya.backends.torch.graphs import BUCKETS, GraphOptions

    static = load_dflash_torch(dflash2_dir, tiny.target, "cpu", "float32")
    static.use_graphs(GraphOptions(capture=False, buckets=BUCKETS, static_extent=True))
    mask = model.config.mask_token_id
    eager_rows = model.block_logits(_blocks(model, mask)[2])
    static_rows = static.block_logits(_blocks(static, mask)[2])
    assert torch.equal(torch.isinf(eager_rows), torch.isinf(static_rows))
    finite = torch.isfinite(eager_rows)
    torch.testing.assert_close(static_rows[finite], eager_rows[finite], rtol=1e-5, atol=1e-5)
    assert model.argmax(eager_rows, []) == static.argmax(static_rows, [])


@pytest.mark.parametrize("rule", ["coupled", "rejection"])
def test_sampling_with_the_realized_rows(tiny, torch_target, dflash2_dir, rule):
    """A sampling session drafts from the realized rows (-inf off the candidates): coupled sampling
    stays AR sampling with the same seed token for token; the rejection rule runs its proposals."""
    from kakeya.core.request import SamplingParams
    from kakeya.drafter.local import TorchDrafter

    params = SamplingParams(0.8, top_k=40, seed=42, rule=rule)
    verifier = LocalVerifier(torch_target, tiny.target, AUX_LAYERS)
    drafter = TorchDrafter(dflash2_dir, tiny.target, "cpu", "float32")
    ar = run(verifier.open_session(None, params), None, PROMPT, 40, 1).token_ids
    gen = run(verifier.open_session(None, params), drafter.open_session(params), PROMPT, 40, 6)
    assert len(gen.token_ids) == 40 and max(gen.acceptance_lengths) <= 6
    if rule == "coupled":
        assert gen.token_ids == ar


def test_mlx_matches_torch(model, dflash2_dir, tiny):
    """The MLX DFlash2 drafter (the DFlash2 part of ``drafter/mlx_backend/model.py``) on the same blocks: the same
    realized rows and walk tokens as the torch one (which the reference above pins)."""
    import mlx.core as mx

    from kakeya.drafter.mlx_backend.model import load_dflash_mlx

    theirs = load_dflash_mlx(dflash2_dir, tiny.target)
    assert theirs.candidate_selector.top_k == TOP_K
    mask = model.config.mask_token_id
    auxs, _, blocks = _blocks(model, mask)
    caches = [theirs.make_cache(), theirs.make_cache()]
    extend(theirs, caches, [mx.array(a.numpy()) for a in auxs])
    mlx_blocks = [(caches[0 if c is blocks[0][0] else 1], ids) for c, ids in blocks]
    got = np.array(theirs.block_logits(mlx_blocks))
    want = model.block_logits(blocks).numpy()
    assert np.array_equal(np.isinf(got), np.isinf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-4, atol=1e-4)
    assert theirs.argmax(mx.array(got), caches) == model.argmax(torch.from_numpy(want), [])


def test_mlx_greedy_speculative_equals_target_ar(tiny, dflash2_dir):
    from kakeya.drafter.local import MLXDrafter
    from kakeya.verifier.local import mlx_verifier
    from kakeya.verifier.mlx_backend.reference import greedy_reference

    verifier = mlx_verifier(tiny.target, AUX_LAYERS)
    reference, _, _ = greedy_reference(verifier.target.model, PROMPT, 160)
    drafter = MLXDrafter(dflash2_dir, tiny.target)
    for block_size in (4, 8):
        gen = run(verifier.open_session(CachePolicy()), drafter.open_session(), PROMPT, 160, block_size)
        assert gen.token_ids == reference
