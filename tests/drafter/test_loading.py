"""Loading: draft strict load, only the target's embedding / LM head, dtype, quantized tables."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

from kakeya.drafter.backend import extend
from kakeya.drafter.mlx_backend.model import load_dflash_mlx, load_target_head

from .conftest import random_aux, target_tensors


def test_reads_only_embedding_and_head(pairs):
    full, mixed = pairs["full"], pairs["mixed"]
    untied = load_target_head(full.target)
    assert set(untied.embed) == {"weight"} and set(untied.head) == {"weight"}
    assert not untied.tied
    raw = target_tensors(0, tied=False)
    assert np.array_equal(np.array(untied.embed["weight"]), raw["embed"])
    assert np.array_equal(np.array(untied.head["weight"]), raw["lm_head"])
    # multimodal-style names (model.language_model.*), tied: head is the embedding
    tied = load_target_head(mixed.target)
    assert tied.tied and tied.head["weight"] is tied.embed["weight"]
    assert tied.vocab_size == 1024 and tied.hidden_size == 64


def test_tied_logits_use_embedding(pairs):
    p = pairs["mixed"]
    m = load_dflash_mlx(p.draft, p.target)
    h = mx.random.normal((3, 64), key=mx.random.key(0))
    want = h @ m.target.embed["weight"].T * p.variant.output_multiplier
    cap = p.variant.softcap
    want = mx.tanh(want / cap) * cap
    assert mx.allclose(m.compute_logits(h), want, atol=1e-5).item()


def test_strict_draft_load(pairs, tmp_path):
    from safetensors.numpy import load_file, save_file

    p = pairs["full"]
    draft = tmp_path / "draft"
    shutil.copytree(p.draft, draft)
    t = load_file(str(draft / "model.safetensors"))
    t.pop("layers.1.mlp.up_proj.weight")
    save_file(t, str(draft / "model.safetensors"))
    with pytest.raises(ValueError):
        load_dflash_mlx(draft, p.target)


def test_dtype_follows_weights(pairs, tmp_path):
    p = pairs["full"]
    draft = tmp_path / "draft"
    draft.mkdir()
    shutil.copy(p.draft / "config.json", draft / "config.json")
    w = mx.load(str(p.draft / "model.safetensors"))
    mx.save_safetensors(str(draft / "model.safetensors"), {k: v.astype(mx.bfloat16) for k, v in w.items()})
    m = load_dflash_mlx(draft, p.target)
    assert m.dtype == mx.bfloat16 and m.target.embed["weight"].dtype == mx.bfloat16
    cache = m.make_cache()
    extend(m, [cache], [random_aux(10, m.config.aux_width)])
    assert cache.view(0)[0].dtype == mx.bfloat16
    block = mx.array([5] + [4] * 7)
    assert m.block_logits([(cache, block.tolist())]).dtype == mx.bfloat16
    # float32 override of a bf16 checkpoint
    assert load_dflash_mlx(draft, p.target, dtype=mx.float32).dtype == mx.float32


def test_quantized_target_tables(pairs, tmp_path):
    """mlx-lm quantized embed / lm_head (weight, scales, biases) work without a full dequantize."""
    p = pairs["full"]
    target = tmp_path / "target"
    target.mkdir()
    raw = target_tensors(0, tied=False)
    tensors, deq = {}, {}
    for name, key in [("model.embed_tokens", "embed"), ("lm_head", "lm_head")]:
        wq, s, b = mx.quantize(mx.array(raw[key]), group_size=32, bits=8)
        tensors.update({f"{name}.weight": wq, f"{name}.scales": s, f"{name}.biases": b})
        deq[key] = mx.dequantize(wq, s, b, group_size=32, bits=8)
    mx.save_safetensors(str(target / "model.safetensors"), tensors)
    cfg = json.loads((p.target / "config.json").read_text())
    cfg["quantization"] = {"group_size": 32, "bits": 8}
    (target / "config.json").write_text(json.dumps(cfg))

    mq = load_dflash_mlx(p.draft, target)
    assert mq.target.embed["weight"].dtype == mx.uint32 and mq.target.hidden_size == 64
    mf = load_dflash_mlx(p.draft, p.target)
    mf.target.embed["weight"], mf.target.head["weight"] = deq["embed"], deq["lm_head"]
    aux = random_aux(12, mf.config.aux_width)
    block = mx.array([17] + [4] * 7)
    out = []
    for m in (mq, mf):
        c = m.make_cache()
        extend(m, [c], [aux])
        out.append(m.block_logits([(c, block.tolist())]))
    assert float(mx.abs(out[0] - out[1]).max()) < 1e-3
