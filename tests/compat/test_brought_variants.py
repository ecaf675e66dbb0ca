"""Variants of what users bring beyond the matrix's cells (``test_transformers.py``), each served losslessly: greedy
speculative output equals the writing tool's own greedy decoding token for token, at block 8 and auto.

* a target saved by transformers in float16 (one file): torch serves it in float32 (an exact upcast), equal to
  transformers' float32 ``generate`` of the same file; MLX computes in float16, equal to its own greedy AR;
* drafters saved by the dflash package with another shape than the cells' (block 4 with one layer reading the
  target's last layer, which the E family shares K/V into; block 16 with four June-layout layers reading four target
  layers; bfloat16 weights), on both backends against the float32 ``e`` target;
* the same directories reached through a symlink and a trailing slash;
* a target whose full layers have the sliding layers' shape (transformers writes ``per_layer_config: {}`` and no
  ``global_head_dim``), in the default layer pattern.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace

import pytest

from .cells import BLOCKS, N, pair, sizer, speculative, transformers_greedy
from .conftest import FAMILIES, PROMPT, save_drafter

BACKENDS = ("torch", "mlx")
DRAFTERS = {  # name -> save_drafter options (family e: 7 layers, the last one KV-shared)
    "block4-1layer-last": dict(layers=1, block=4, ids=(6,)),
    "block16-4layers-june": dict(layers=4, block=16, ids=(0, 2, 4, 6)),
    "bfloat16": dict(dtype="bfloat16"),
}


@pytest.fixture(scope="module")
def drafters(compat_dir):
    built = {}

    def get(name: str):
        if name not in built:
            fam = FAMILIES["e"]
            if name == "block16-4layers-june":
                fam = replace(fam, drafter="june")
            built[name] = save_drafter(fam, compat_dir / f"e-draft-{name}", **DRAFTERS[name])
        return built[name]

    return get


@pytest.mark.parametrize("block", BLOCKS)
def test_float16_on_torch_equals_transformers_generate(checkpoints, block):
    target, draft = checkpoints("float16", "e"), checkpoints("draft", "e")
    assert (target / "model.safetensors").is_file()
    assert pair("torch", target, draft)[0].target.dtype_name == "float32"
    assert speculative("torch", target, draft, block) == list(transformers_greedy(target, "e"))


def test_float16_on_mlx_equals_its_own_ar(checkpoints):
    from kakeya.orchestrator.decode.loop import run

    target, draft = checkpoints("float16", "e"), checkpoints("draft", "e")
    verifier, drafter = pair("mlx", target, draft)
    assert verifier.target.dtype_name == "float16"
    ar = run(verifier.open_session(), None, PROMPT, N, 1).token_ids
    assert len(set(ar)) >= 16
    for block in BLOCKS:
        assert run(verifier.open_session(), drafter.open_session(), PROMPT, N, sizer(block)).token_ids == ar


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(DRAFTERS))
def test_other_drafter_shapes_are_lossless(checkpoints, drafters, name, backend, block):
    from kakeya.checkpoints.config import load_draft_config

    draft = drafters(name)
    dflash = load_draft_config(draft)["dflash_config"]
    assert dflash["block_size"] == DRAFTERS[name].get("block", 8)
    target = checkpoints("float32", "e")
    assert speculative(backend, target, draft, block) == list(transformers_greedy(target, "e"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_symlinked_directory_and_a_trailing_slash_are_the_same_checkpoint(checkpoints, tmp_path, backend):
    target, draft = checkpoints("float32", "e"), checkpoints("draft", "e")
    (tmp_path / "linked").symlink_to(target, target_is_directory=True)
    linked, slashed = f"{tmp_path / 'linked'}/", f"{draft}/"  # as a shell completes them
    assert speculative(backend, linked, slashed, 8) == list(transformers_greedy(target, "e"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_hub_cache_snapshot_whose_files_are_links_into_blobs_is_the_same_checkpoint(checkpoints, tmp_path, backend):
    """``huggingface-cli download``'s layout: ``models--org--name/snapshots/<commit>/<file>``, each file a relative
    link to ``../../blobs/<hash>`` -- a sharded target and its drafter, read through the links."""
    pair = {"target": checkpoints("float32", "e"), "draft": checkpoints("draft", "e")}
    snapshots = {}
    for name, source in pair.items():
        repo = tmp_path / f"models--org--{name}"
        (repo / "blobs").mkdir(parents=True)
        snapshots[name] = repo / "snapshots" / "0123abc"
        snapshots[name].mkdir(parents=True)
        for i, f in enumerate(sorted(source.iterdir())):
            (repo / "blobs" / f"{i:040x}").write_bytes(f.read_bytes())
            (snapshots[name] / f.name).symlink_to(f"../../blobs/{i:040x}")
    got = speculative(backend, snapshots["target"], snapshots["draft"], 8)
    assert got == list(transformers_greedy(pair["target"], "e"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_unquantized_mlx_convert_of_the_multimodal_target_equals_transformers_on_its_source(checkpoints, backend):
    """``mlx_lm.convert`` without -q renames the text model ``language_model.model.*`` (and keeps float32)."""
    converted, source = checkpoints("mlx", "mm"), checkpoints("float32", "mm")
    assert "language_model.model.embed_tokens.weight" in (converted / "model.safetensors.index.json").read_text()
    draft = checkpoints("draft", "mm")
    assert speculative(backend, converted, draft, 8) == list(transformers_greedy(source, "mm"))


@pytest.fixture(scope="module")
def mixed_target(checkpoints, compat_dir):
    """``mlx_lm.convert -q --quant-predicate mixed_3_6`` (mlx-community's mixed recipes) of the float32 ``e`` target."""
    from .conftest import mlx_convert

    checkpoints("mlx", "e")  # the source gets its tokenizer
    target = compat_dir / "e-mlx-mixed_3_6"
    if not target.exists():
        mlx_convert(checkpoints("float32", "e"), target, 0, 0, quantize=True, quant_predicate="mixed_3_6")
    return target


def test_a_mixed_precision_mlx_convert_equals_mlx_lm(checkpoints, mixed_target):
    """A mixed convert writes a quantization entry per module, each with ``group_size: null`` (the mode's default,
    as mlx-lm reads it) -- the embedding's too."""
    import json

    from .cells import mlx_lm_greedy

    target = mixed_target
    spec = json.loads((target / "config.json").read_text())["quantization"]["model.embed_tokens"]
    assert spec["bits"] == 3 and spec["group_size"] is None
    for block in BLOCKS:
        assert speculative("mlx", target, checkpoints("draft", "e"), block) == list(mlx_lm_greedy(target))


def test_inspect_of_a_mixed_precision_convert_counts_the_modules_per_bits(mixed_target, capsys):
    """What the checkpoint holds, module by module: mixed_3_6 keeps v_proj and down_proj of some layers at 6 bits,
    the rest at 3; no module at the 4 bits the config's top level names as the default."""
    import json

    from kakeya.app.main import main

    spec = json.loads((mixed_target / "config.json").read_text())["quantization"]
    bits = Counter(v["bits"] for v in spec.values() if isinstance(v, dict))
    assert set(bits) == {3, 6} and spec["bits"] == 4  # the recipe under test
    assert main(["inspect", str(mixed_target), "--json"]) == 0
    q = json.loads(capsys.readouterr().out)["target"]["quantization"]
    assert q["modules_per_bits"] == {f"{b}-bit/64": n for b, n in sorted(bits.items())} and "bits" not in q
    assert main(["inspect", str(mixed_target)]) == 0
    out = capsys.readouterr().out
    assert f"quantization mode affine, modules_per_bits {{'3-bit/64': {bits[3]}, '6-bit/64': {bits[6]}}};" in out


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_full_layers_of_the_sliding_shape_equal_transformers_generate(checkpoints, backend, block):
    """Read as an absent field, ``per_layer_config: {}`` gave the full layers transformers' 512 default head size
    and both backends refused the checkpoint."""
    target, draft = checkpoints("float32", "plain"), checkpoints("draft", "plain")
    assert json.loads((target / "config.json").read_text())["per_layer_config"] == {}
    assert speculative(backend, target, draft, block) == list(transformers_greedy(target, "plain"))
