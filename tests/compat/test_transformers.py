"""Gemma-4 targets saved by transformers' ``save_pretrained`` (four families, float32 sharded with an index
file, bfloat16 in one file), each with a drafter saved by the dflash package: greedy speculative output ==
transformers' own greedy ``generate``, >= 160 tokens past >= 3 ring wraps, at block 8 and auto, on torch
and on MLX.

bfloat16 files: torch serves them in float32 (bf16 -> f32 is exact, so transformers' float32 ``generate`` of
the same file is still the token-for-token reference). MLX computes in the file's bfloat16, where a block
of 8 rows and a single row round differently from transformers (and from mlx-lm's own one-row decoding): the
cell asserts what holds there -- the pair loads, and the speculative output equals this MLX target's own
greedy AR through the same caches (block size 1), token for token.

Identity holds when the writing tool's own decoding rounds as ours does; a bfloat16 file compared with
transformers' bfloat16 ``generate`` would differ within a few dozen tokens on any backend (measured: 4 to 12
of 168 tokens agree between transformers' float32 and bfloat16 decoding of the same file).
"""

from __future__ import annotations

import json

import pytest

from .cells import BLOCKS, N, ring_wraps, speculative, transformers_greedy

FAMILY_NAMES = ("e", "moe", "dense", "mm")


def test_the_files_are_the_tools_own(checkpoints):
    """float32 saves are sharded with an index; transformers >= 5.2 wrote per_layer_config; the drafters carry
    z-lab's two layouts; mm is the multimodal wrapper without a top-level vocab_size."""
    for name in FAMILY_NAMES:
        d = checkpoints("float32", name)
        assert (d / "model.safetensors.index.json").is_file() and len(list(d.glob("model-*.safetensors"))) > 1
        assert (checkpoints("bfloat16", name) / "model.safetensors").is_file()
        cfg = json.loads((d / "config.json").read_text())
        text = cfg.get("text_config", cfg)
        assert "per_layer_config" in text and "global_head_dim" not in text
        assert ring_wraps(d) >= 3
    assert "vocab_size" not in json.loads((checkpoints("float32", "mm") / "config.json").read_text())
    may = json.loads((checkpoints("draft", "e") / "config.json").read_text())
    june = json.loads((checkpoints("draft", "moe") / "config.json").read_text())
    assert may["block_size"] == 8 and "block_size" not in may["dflash_config"]
    assert june["dflash_config"]["block_size"] == 8 and "sliding_attention" in june["layer_types"]


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("backend", ["torch", "mlx"])
@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_float32_equals_transformers_generate(checkpoints, name, backend, block):
    target, draft = checkpoints("float32", name), checkpoints("draft", name)
    ref = transformers_greedy(target, name)
    assert len(ref) == N >= 160
    assert speculative(backend, target, draft, block) == list(ref)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_bfloat16_on_torch_equals_transformers_generate(checkpoints, name, block):
    target, draft = checkpoints("bfloat16", name), checkpoints("draft", name)
    assert speculative("torch", target, draft, block) == list(transformers_greedy(target, name))


@pytest.mark.parametrize("block", BLOCKS)
def test_bfloat16_moe_on_mlx_cpu_is_served_in_float32_and_equals_transformers_generate(checkpoints, block):
    """MLX's CPU expert product computes float32 only ("[GatherMM::eval] Currently only supports float32"): a
    bfloat16 MoE is upcast there (exactly), so it equals transformers' float32 decoding of the same file."""
    from .cells import pair

    target, draft = checkpoints("bfloat16", "moe"), checkpoints("draft", "moe")
    assert pair("mlx", target, draft)[0].target.dtype_name == "float32"
    assert speculative("mlx", target, draft, block) == list(transformers_greedy(target, "moe"))


@pytest.mark.parametrize("name", ["e", "dense", "mm"])
def test_bfloat16_on_mlx_equals_its_own_ar(checkpoints, name):
    from kakeya.orchestrator.decode.loop import run

    from .cells import pair, sizer
    from .conftest import PROMPT

    target, draft = checkpoints("bfloat16", name), checkpoints("draft", name)
    verifier, drafter = pair("mlx", target, draft)
    assert verifier.target.dtype_name == "bfloat16"
    ar = run(verifier.open_session(), None, PROMPT, N, 1).token_ids
    for block in BLOCKS:
        assert run(verifier.open_session(), drafter.open_session(), PROMPT, N, sizer(block)).token_ids == ar
