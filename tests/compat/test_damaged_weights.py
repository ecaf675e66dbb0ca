"""Checkpoints whose tensors do not fit their config.json -- one missing, one extra, one renamed, one of another
shape, as a hand-edited or wrongly converted checkpoint has them -- and a tokenizer bigger than the model's
vocabulary: ``kakeya generate`` refuses each in one line naming the checkpoint (exit 2, no traceback), on both
backends, where torch ended in a RuntimeError / IndexError traceback and MLX printed mlx-lm's complaint over two
lines without the checkpoint's path (or, for the tokenizer, read past its embedding table silently).

The checkpoints are the transformers and dflash saves of ``conftest.py`` (the ``e`` family, the bfloat16 target in
one file), copied and then edited with safetensors' own reader and writer.
"""

from __future__ import annotations

import json
import shutil

import pytest

from .conftest import FAMILIES, save_tokenizer
from .test_brought_dirs import BACKENDS, generate


@pytest.fixture
def pair(checkpoints, capsys):
    """The ``e`` family's bfloat16 target and its drafter (their saves' progress bars read out of ``capsys``)."""
    target, draft = checkpoints("bfloat16", "e"), checkpoints("draft", "e")
    capsys.readouterr()
    return target, draft


def edited(src, out, edit):
    """A copy of the checkpoint at ``src`` whose ``model.safetensors`` holds ``edit(tensors)``."""
    from safetensors.torch import load_file, save_file

    out = shutil.copytree(src, out)
    save_file(edit(load_file(out / "model.safetensors")), out / "model.safetensors", metadata={"format": "pt"})
    return out


def without(name):
    return lambda sd: {k: v for k, v in sd.items() if k != name}


def extra(sd):
    return sd | {"model.layers.0.self_attn.gate.weight": next(iter(sd.values())).clone()}


def renamed(old, new):
    return lambda sd: {k.replace(old, new): v for k, v in sd.items()}


def cut(name, rows=True):
    return lambda sd: sd | {name: (sd[name][:-1] if rows else sd[name][..., :-1]).clone()}


TARGET_EDITS = {
    "missing": (without("model.layers.1.self_attn.q_norm.weight"), "model.layers.1.self_attn.q_norm.weight"),
    "renamed": (renamed("layers.2.self_attn.q_proj", "layers.2.self_attn.query"), "layers.2.self_attn.q"),
    "o_proj": (cut("model.layers.1.self_attn.o_proj.weight"), "layers.1"),
    "down_proj": (cut("model.layers.1.mlp.down_proj.weight", rows=False), "layers.1"),
    "layernorm": (cut("model.layers.1.input_layernorm.weight"), "layers.1"),
    "final norm": (cut("model.norm.weight"), "norm"),
    "per-layer table": (cut("model.embed_tokens_per_layer.weight"), "embed"),
}
DRAFT_EDITS = {
    "missing": (without("layers.0.self_attn.q_proj.weight"), "layers.0.self_attn.q_proj.weight"),
    "extra": (extra, "model.layers.0.self_attn.gate.weight"),
    "fc": (cut("fc.weight", rows=False), "fc.weight"),
}


EDITS = {("target", e): v for e, v in TARGET_EDITS.items()} | {("draft", e): v for e, v in DRAFT_EDITS.items()}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("which,edit", list(EDITS))
def test_a_tensor_missing_extra_or_of_another_shape_is_one_line_naming_the_checkpoint(
    pair, tmp_path, capsys, which, edit, backend
):
    change, named = EDITS[which, edit]
    dirs = dict(zip(("target", "draft"), pair, strict=True))
    dirs[which] = edited(dirs[which], tmp_path / which, change)
    code, err = generate(dirs["target"], dirs["draft"], backend, capsys)
    assert code == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith(f"kakeya: error: {which} checkpoint {dirs[which]}: ") and named in err, err


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_tokenizer_bigger_than_the_models_vocabulary_is_refused_naming_both(pair, tmp_path, capsys, backend):
    """Another model's tokenizer beside the weights: its ids past ``vocab_size`` have no embedding row."""
    vocab = FAMILIES["e"].text["vocab_size"]
    target = shutil.copytree(pair[0], tmp_path / "target")
    save_tokenizer(target, vocab + 80)
    assert json.loads((target / "tokenizer.json").read_text())["model"]["vocab"][f"t{vocab + 5}"] == vocab + 5
    code, err = generate(target, pair[1], backend, capsys)
    assert code == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err == f"kakeya: error: {target}: tokenizer.json has {vocab + 80} tokens, vocab_size is {vocab}\n"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_tokenizer_json_cut_short_is_named(pair, tmp_path, capsys, backend):
    """A download of tokenizer.json cut short (a 262k-entry file is the largest JSON a checkpoint has)."""
    target = shutil.copytree(pair[0], tmp_path / "target")
    save_tokenizer(target, FAMILIES["e"].text["vocab_size"])
    tok = target / "tokenizer.json"
    tok.write_text(tok.read_text()[:300])
    code, err = generate(target, pair[1], backend, capsys)
    assert code == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith(f"kakeya: error: {tok}: unreadable ("), err


def test_a_device_out_of_memory_while_loading_is_not_called_the_checkpoints_fault():
    """torch's OutOfMemoryError is a RuntimeError, as its misfit-tensor errors are: only the latter name the checkpoint."""
    import torch

    from kakeya.checkpoints.config import CheckpointError
    from kakeya.checkpoints.layout import loading

    with pytest.raises(torch.OutOfMemoryError), loading("/ckpt", "target"):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    with (
        pytest.raises(CheckpointError, match=r"^target checkpoint /ckpt: size mismatch for w: \[2\]$"),
        loading("/ckpt", "target"),
    ):
        raise RuntimeError("size mismatch for w:\n  [2]")
