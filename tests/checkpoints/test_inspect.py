"""``kakeya inspect``: what a directory holds, whether a pair fits, what it needs in memory -- on checkpoints
written by ``kakeya make-tiny``, by transformers' ``save_pretrained`` and by ``mlx_lm.convert``, and the
refusals (a mismatched pair, a missing or garbled config or safetensors file), each named."""

from __future__ import annotations

import json
import shutil

import pytest

from kakeya.app.main import main
from kakeya.core.request import CachePolicy

CONTEXT = 512  # a multiple of the MLX caches' 256-position step: a live session holds exactly this


def _inspect(capsys, *argv) -> tuple[int, dict | str, str]:
    rc = main(["inspect", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, (json.loads(out) if "--json" in argv and out else out), err


@pytest.fixture(scope="module")
def hf_target(tmp_path_factory):
    """A tiny random MoE Gemma-4 saved by transformers in bfloat16, sharded with an index: its
    full-attention shapes only in ``per_layer_config`` (transformers >= 5.2's spelling)."""
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    torch.manual_seed(0)
    cfg = Gemma4TextConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        global_head_dim=16,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        sliding_window=16,
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=16,
        hidden_size_per_layer_input=0,
    )
    out = tmp_path_factory.mktemp("hf") / "target"
    Gemma4ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out, max_shard_size="20KB")
    return out


@pytest.fixture(scope="module")
def q4_target(tiny_pair, tmp_path_factory):
    from mlx_lm import convert

    out = tmp_path_factory.mktemp("q4") / "target"
    convert(str(tiny_pair.target), mlx_path=str(out), quantize=True, q_bits=4, q_group_size=32)
    return out


def test_tiny_pair(capsys, tiny_pair):
    rc, r, _ = _inspect(
        capsys, tiny_pair.target, "--draft", tiny_pair.draft, "--context", CONTEXT, "--sessions", 3, "--json"
    )
    assert rc == 0
    t, d, m = r["target"], r["draft"], r["memory"]
    assert (t["model_type"], t["layer_pattern"], t["sliding_window"]) == ("gemma4_text", "(2 sliding, 1 full) x 2", 32)
    assert t["experts"] is None and t["quantization"] is None and t["tensor_dtypes"] == {"F32": t["tensors"]}
    assert (d["target_layer_ids"], d["block_size"], d["mask_token_id"]) == ([1, 4], 8, 4)
    assert d["layout"].startswith("DFlash (") and r["fit"] == {"ok": True, "problems": []}
    # The verifier's K/V: what a live session of this target holds at this context (KVBytes).
    from kakeya.verifier.mlx_backend.target import TargetMLX
    from kakeya.verifier.session import LocalVerifierSession

    session = LocalVerifierSession(TargetMLX.load(tiny_pair.target), (1, 4), CachePolicy())
    session.prefill([(5 * i) % 1000 + 5 for i in range(CONTEXT)])
    assert m["target_kv_per_session"] == session.stats().kv_bytes.as_dict()
    per = sum(m["target_kv_per_session"].values()) + m["draft_context_per_session"]
    assert m["draft_context_per_session"] == 2 * CONTEXT * 2 * 2 * 16 * 4  # 2 full layers, 2 kv heads x 16, f32
    weights = m["target_weights_bytes"] + m["draft_weights_bytes"] + m["draft_target_head_bytes"]
    assert m["per_session_bytes"] == per and m["total_bytes"] == weights + 3 * per
    assert m["target_weights_bytes"] == sum(f.stat().st_size for f in tiny_pair.target.glob("*.safetensors")) - sum(
        8 + int.from_bytes(f.read_bytes()[:8], "little") for f in tiny_pair.target.glob("*.safetensors")
    )
    rc, text, _ = _inspect(capsys, tiny_pair.target, "--draft", tiny_pair.draft)
    assert rc == 0 and "fit: yes" in text and "6 layers: (2 sliding, 1 full) x 2; sliding window 32" in text


def test_drafter_alone(capsys, tiny_pair):
    rc, r, _ = _inspect(capsys, tiny_pair.draft, "--json")
    assert rc == 0 and set(r) == {"draft"} and r["draft"]["layer_pattern"] == "2 full"


def test_save_pretrained_checkpoint(capsys, hf_target):
    assert "per_layer_config" in json.loads((hf_target / "config.json").read_text())  # the spelling under test
    rc, r, _ = _inspect(capsys, hf_target, "--context", 64, "--json")
    assert rc == 0
    t, m = r["target"], r["memory"]
    assert t["experts"] == {"num_experts": 4, "top_k": 2} and t["dtype"] == "bfloat16"
    assert t["sharded"] and t["files"] > 1 and set(t["tensor_dtypes"]) == {"BF16"} and t["tied_lm_head"]
    assert t["layer_pattern"] == "3 sliding, 1 full" and t["sliding_window"] == 16
    assert m["full_attention"] == {"kv_heads": 1, "head_dim": 16}  # from per_layer_config
    assert m["target_kv_per_session"] == {"sliding": 3 * (15 + 16) * 2 * 2 * 8 * 2, "full": 64 * 2 * 1 * 16 * 2}


def test_mlx_convert_4bit_checkpoint(capsys, q4_target, tiny_pair):
    rc, r, _ = _inspect(capsys, q4_target, "--draft", tiny_pair.draft, "--json")
    assert rc == 0 and r["fit"]["ok"]
    t = r["target"]
    assert t["quantization"]["bits"] == 4 and t["quantization"]["group_size"] == 32 and "U32" in t["tensor_dtypes"]
    assert t["backends"] == ["mlx"]
    # the drafter borrows the quantized embedding and head: packed weights + scales + biases
    head = r["memory"]["draft_target_head_bytes"]
    assert 0 < head < 2 * 1024 * 64 * 4 / 4


def test_mismatched_pair_is_refused(capsys, hf_target, tiny_pair):
    rc, text, err = _inspect(capsys, hf_target, "--draft", tiny_pair.draft)
    assert rc == 2 and "fit: NO" in text
    assert err.startswith("kakeya: error: draft ") and "does not fit target" in err
    assert "field 'hidden_size' is 64, target" in err and "'vocab_size' is 1024, target" in err
    assert "target_layer_ids' has [4] out of range" in err


def test_dflash2_drafter(capsys, q4_target, tiny_pair, tmp_path):
    draft = tmp_path / "draft2"
    shutil.copytree(tiny_pair.draft, draft)
    cfg = json.loads((draft / "config.json").read_text())
    cfg["architectures"] = ["DFlash2DraftModel"]
    cfg["dflash_config"].update(conv_kernel_size=2, conv_group_size=16, selector_rank=4, selector_top_k=4)
    (draft / "config.json").write_text(json.dumps(cfg))
    rc, r, _ = _inspect(capsys, tiny_pair.target, "--draft", draft, "--json")
    assert rc == 0 and r["draft"]["layout"].startswith("DFlash2") and r["draft"]["dflash2"]["selector_top_k"] == 4
    rc, r, _ = _inspect(capsys, q4_target, "--draft", draft, "--json")
    assert rc == 0 and r["fit"]["ok"] and r["target"]["backends"] == ["mlx"]


def test_missing_and_garbled_files_are_named(capsys, tiny_pair, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, _, err = _inspect(capsys, empty)
    assert rc == 2 and f"target checkpoint {empty}: no config.json" in err
    bad = tmp_path / "bad"
    shutil.copytree(tiny_pair.target, bad)
    (bad / "config.json").write_text('{"model_type": "gemma4_text", ')
    rc, _, err = _inspect(capsys, bad)
    assert rc == 2 and f"{bad / 'config.json'}: unreadable config.json" in err
    shutil.copy(tiny_pair.target / "config.json", bad / "config.json")
    (bad / "model.safetensors").write_bytes(b"\xff" * 16)
    rc, _, err = _inspect(capsys, bad)
    assert rc == 2 and f"{bad / 'model.safetensors'}: not a readable safetensors file" in err
    draft = tmp_path / "draft"
    shutil.copytree(tiny_pair.draft, draft)
    cfg = json.loads((draft / "config.json").read_text())
    del cfg["dflash_config"]["mask_token_id"]
    (draft / "config.json").write_text(json.dumps(cfg))
    rc, _, err = _inspect(capsys, tiny_pair.target, "--draft", draft)
    assert rc == 2 and "field 'dflash_config.mask_token_id' is missing" in err
    rc, _, err = _inspect(capsys, tiny_pair.target, "--context", 0)
    assert rc == 2 and "--context must be >= 1" in err


def test_reads_headers_only(capsys, tiny_pair, tmp_path):
    """Every tensor's data overwritten (the header alone left as it was): inspect says the same as on the whole file.
    (A file cut after its header is refused as truncated: test_a_truncated_safetensors_file_is_named.)"""
    cut = tmp_path / "cut"
    shutil.copytree(tiny_pair.target, cut)
    raw = (cut / "model.safetensors").read_bytes()
    header_end = 8 + int.from_bytes(raw[:8], "little")
    (cut / "model.safetensors").write_bytes(raw[:header_end] + b"\xff" * (len(raw) - header_end))
    rc, whole, _ = _inspect(capsys, tiny_pair.target, "--draft", tiny_pair.draft, "--json")
    rc_cut, headers, _ = _inspect(capsys, cut, "--draft", tiny_pair.draft, "--json")
    assert rc == rc_cut == 0
    for r in (whole, headers):
        r["target"].pop("path")
    assert headers == whole


@pytest.mark.parametrize("damage", ["tokenizer_config.json", "tokenizer.json"])
def test_a_tokenizer_a_load_refuses_is_refused_by_inspect_alike(capsys, tiny_pair, tmp_path, damage):
    """A target whose tokenizer file is cut short: ``kakeya generate`` refuses it in one line, ``kakeya inspect``
    printed 'runs on torch/mlx' and exit status 0. (A target with no tokenizer at all is fine: a verifier serves
    it, the orchestrator reading ``--tokenizer``.)"""
    target = shutil.copytree(tiny_pair.target, tmp_path / "target")
    (target / damage).write_text((target / damage).read_text()[:40])
    assert main(["generate", "--target", str(target), "--draft", str(tiny_pair.draft), "--max-tokens", "2"]) == 2
    load_err = capsys.readouterr().err
    rc, _, err = _inspect(capsys, target)
    assert rc == 2 and err == load_err and f"{target / damage}: unreadable" in err
