"""The tiny Gemma-4 target + DFlash drafter: format, determinism, loading in every backend."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from kakeya.checkpoints import tokenizer as tk
from kakeya.checkpoints.tiny import default_pair, make_tiny

PROMPT = "def main(argv):\n    parser = argparse.ArgumentParser()\n    return parser.parse_args(argv)\n"


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


def _config(d: Path) -> dict:
    return json.loads((d / "config.json").read_text())


# ---------------------------------------------------------------------------
# files and determinism


def test_layout(tiny_pair):
    assert sorted(_files(tiny_pair.target)) == [
        "chat_template.jinja",  # the tokenizer writer's minimal Gemma-style template (orchestrator/text.py)
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert sorted(_files(tiny_pair.draft)) == ["config.json", "model.safetensors"]
    # config.json is written with sorted keys
    text = (tiny_pair.target / "config.json").read_text()
    assert text == json.dumps(json.loads(text), indent=2, sort_keys=True) + "\n"
    t = _config(tiny_pair.target)
    assert t["model_type"] == "gemma4_text" and t["architectures"] == ["Gemma4ForCausalLM"]
    assert t["tie_word_embeddings"] is False and t["final_logit_softcapping"] == 30.0
    assert t["layer_types"].count("full_attention") == 2 and t["num_hidden_layers"] == 6
    d = _config(tiny_pair.draft)
    assert d["architectures"] == ["DFlashDraftModel"]
    assert d["hidden_size"] == t["hidden_size"] and d["num_target_layers"] == 6
    assert d["dflash_config"]["mask_token_id"] == tk.MASK_ID
    weights = load_file(str(tiny_pair.draft / "model.safetensors"))
    assert not any("embed" in k or "lm_head" in k for k in weights)
    assert all(v.dtype == np.float32 for v in weights.values())


def test_same_seed_is_byte_identical(tiny_pair, tmp_path):
    again = make_tiny(tmp_path / "again", seed=0, sliding_window=32)
    assert _files(again.target) == _files(tiny_pair.target)
    assert _files(again.draft) == _files(tiny_pair.draft)


def test_different_seed_changes_weights_only(tiny_pair, tmp_path):
    other = make_tiny(tmp_path / "other", seed=1, sliding_window=32)
    for a, b in ((tiny_pair.target, other.target), (tiny_pair.draft, other.draft)):
        assert _config(a) == _config(b)
        wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
        assert wa.keys() == wb.keys()
        projections = [k for k in wa if k.endswith("q_proj.weight")]
        assert projections and not any(np.array_equal(wa[k], wb[k]) for k in projections)


def test_embedded_default_pair_is_fresh(tiny_pair):
    """A stale services/models/tiny (generator changed, not regenerated) fails here."""
    pair = default_pair()
    manifest = json.loads((pair.target.parent / "manifest.json").read_text())
    assert manifest["args"] == {"seed": 0, "sliding_window": 32, "moe": False, "vocab_size": 1024}
    for shipped, fresh in ((pair.target, tiny_pair.target), (pair.draft, tiny_pair.draft)):
        assert _config(shipped) == _config(fresh), f"{shipped}/config.json is stale"
        ws, wf = (load_file(str(d / "model.safetensors")) for d in (shipped, fresh))
        assert ws.keys() == wf.keys(), f"{shipped}: tensor names are stale"
        for k in ws:
            assert ws[k].dtype == wf[k].dtype and np.array_equal(ws[k], wf[k]), f"{shipped}: {k} is stale"
    fresh_card = (tiny_pair.target.parent / "README.md").read_text()
    assert (pair.target.parent / "README.md").read_text() == fresh_card
    # The tokenizer depends on the standard library it was trained on: compare it
    # byte for byte when this interpreter's corpus is the one recorded.
    if manifest["tokenizer_corpus"]["sha256"] == tk.corpus_fingerprint():
        for name in (
            "tokenizer.json",
            "tokenizer_config.json",
            "special_tokens_map.json",
            "generation_config.json",
            "chat_template.jinja",
        ):
            assert (pair.target / name).read_bytes() == (tiny_pair.target / name).read_bytes(), name
    else:
        for name in (
            "tokenizer_config.json",
            "special_tokens_map.json",
            "generation_config.json",
            "chat_template.jinja",
        ):
            assert (pair.target / name).read_bytes() == (tiny_pair.target / name).read_bytes(), name


def test_embedded_default_pair_is_small():
    pair = default_pair()
    total = sum(p.stat().st_size for p in pair.target.parent.rglob("*") if p.is_file())
    assert total < 2_000_000


def test_cli_make_tiny(tmp_path, capsys):
    from kakeya.app.main import build_parser

    parser = build_parser()
    out = tmp_path / "cli"
    args = parser.parse_args(["make-tiny", "--out", str(out), "--seed", "3", "--sliding-window", "16"])
    assert args.func(args) == 0
    printed = capsys.readouterr()
    assert str(out / "target") in printed.out and str(out / "draft") in printed.out
    assert "tokenizer" in printed.err  # progress goes to stderr
    assert _config(out / "target")["sliding_window"] == 16


# ---------------------------------------------------------------------------
# loading: mlx-lm, transformers, dflash


def test_mlx_greedy_is_not_degenerate(mlx_target):
    mx = importlib.import_module("mlx.core")
    from mlx_lm.generate import generate_step

    model, tokenizer = mlx_target
    prompt = mx.array(tokenizer.encode("hello world"))
    out = [int(t) for (t, _), _ in zip(generate_step(prompt, model, max_tokens=300), range(300))]
    assert len(out) == 300
    assert len(set(out)) >= 100, f"only {len(set(out))} distinct ids in 300 greedy tokens"
    assert tk.EOS_ID not in out[:100]


def _mlx_logits(pair) -> tuple[list[int], np.ndarray]:
    mx = importlib.import_module("mlx.core")
    mlx_lm = importlib.import_module("mlx_lm")
    model, tokenizer = mlx_lm.load(str(pair.target))
    ids = tokenizer.encode(PROMPT)
    assert ids[0] == tk.BOS_ID and len(ids) > _config(pair.target)["sliding_window"]
    return ids, np.array(model(mx.array([ids]))[0].astype(mx.float32))


def _hf_logits(pair, ids) -> np.ndarray:
    torch = importlib.import_module("torch")
    transformers = importlib.import_module("transformers")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(pair.target), dtype=torch.float32, output_loading_info=True
    )
    assert type(model).__name__ == "Gemma4ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_transformers_matches_mlx(variant, tiny_pair, tiny_moe_pair):
    pair = tiny_pair if variant == "dense" else tiny_moe_pair
    ids, mlx_logits = _mlx_logits(pair)
    hf_logits = _hf_logits(pair, ids)
    assert hf_logits.shape == mlx_logits.shape == (len(ids), 1024)
    diff = float(np.abs(hf_logits - mlx_logits).max())
    assert diff < 1e-3, f"{variant}: max |hf - mlx| logit diff {diff}"
    assert (hf_logits.argmax(-1) == mlx_logits.argmax(-1)).all()


def test_dflash_reference_loads_draft(tiny_pair, local_hub):
    mlx_lm = importlib.import_module("mlx_lm")

    draft = local_hub.load_draft(str(tiny_pair.draft))
    cfg = draft.config
    assert cfg.target_layer_ids == (1, 4) and cfg.mask_token_id == tk.MASK_ID
    assert cfg.block_size == 8 and cfg.final_logit_softcapping == 30.0
    assert cfg.input_embedding_scale == 1.0 and cfg.output_multiplier == 1.0
    # a fresh target: stream_generate wraps the target's layers in capture hooks
    model, tokenizer = mlx_lm.load(str(tiny_pair.target))
    n = sum(len(r.tokens) for r in local_hub.stream_generate(model, draft, tokenizer, "hello", max_tokens=12))
    assert n == 12


def test_dflash_torch_loads_draft(tiny_pair):
    torch = importlib.import_module("torch")
    dflash_model = importlib.import_module("dflash.model")
    model, info = dflash_model.DFlashDraftModel.from_pretrained(
        str(tiny_pair.draft), dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert list(model.target_layer_ids) == [1, 4] and model.mask_token_id == tk.MASK_ID
