"""Targets quantized by ``mlx_lm.convert`` (4 and 8 bits, group sizes 32 and 64), the four families, each with
its dflash-package drafter reading the quantized embedding and LM head: greedy speculative output on MLX ==
mlx-lm's own greedy decoding of the same quantized model (loaded by mlx-lm alone), >= 160 tokens past >= 3
ring wraps, at block 8 and auto. The torch backend refuses MLX-quantized weights by name."""

from __future__ import annotations

import importlib

import pytest

from .cells import BLOCKS, N, mlx_lm_greedy, pair, ring_wraps, speculative

# family, bits, group size: every family once, every (bits, group) pair at least once
CELLS = [("e", 4, 32), ("moe", 4, 64), ("dense", 8, 32), ("mm", 8, 64), ("e", 8, 64)]


def test_mlx_lm_convert_alone_cannot_read_transformers_per_layer_config(checkpoints, tmp_path):
    """Why the suite hands mlx_lm.convert Kakeya's reading: unaided, mlx-lm 0.32 builds the full layers at its
    default global_head_dim (512) from a transformers >= 5.2 save and fails on the first weight it loads."""
    from .conftest import FAMILIES, save_tokenizer

    src = checkpoints("float32", "e")
    if not (src / "tokenizer.json").is_file():
        save_tokenizer(src, FAMILIES["e"].text["vocab_size"])
    convert = importlib.import_module("mlx_lm.convert").convert
    with pytest.raises(ValueError, match=r"Expected shape .* but received shape .*q_proj"):
        convert(str(src), str(tmp_path / "q"), quantize=True, q_bits=4, q_group_size=32)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("name,bits,group", CELLS, ids=[f"{n}-q{b}g{g}" for n, b, g in CELLS])
def test_quantized_equals_mlx_lm(checkpoints, name, bits, group, block):
    import json

    target, draft = checkpoints("mlx", name, bits, group), checkpoints("draft", name)
    q = json.loads((target / "config.json").read_text())["quantization"]
    assert (q["bits"], q["group_size"]) == (bits, group) and ring_wraps(target) >= 3
    ref = mlx_lm_greedy(target)
    assert len(ref) == N
    assert speculative("mlx", target, draft, block) == list(ref)
    head = pair("mlx", target, draft)[1].model.target
    packed = {"group_size": group, "bits": bits, "mode": "affine"}
    assert head.embed_quant == head.head_quant == packed  # the drafter reads them packed, not dequantized


def test_torch_refuses_mlx_quantized_weights_by_name(checkpoints):
    from kakeya.drafter.local import TorchDrafter
    from kakeya.verifier.torch_backend.target import TargetTorch

    target, draft = checkpoints("mlx", "e", 4, 32), checkpoints("draft", "e")
    with pytest.raises(ValueError, match=r"MLX-quantized weights .* MLX backend only"):
        TargetTorch.load(target, "cpu", "float32")
    with pytest.raises(ValueError, match=r"MLX-quantized embedding / LM head .* --backend mlx"):
        TorchDrafter(draft, target, "cpu", "float32")
