"""Checkpoint directories as users hand them over, damaged or named oddly: ``kakeya generate`` refuses a damaged one in
one line naming the file (exit 2, no traceback) on both backends, and a served model is named after the directory
however its path is spelled.

The directories are the transformers and dflash saves of ``conftest.py`` (the ``e`` family: a float32 target sharded
with an index, a bfloat16 target in one file), copied and then damaged as a download or a copy leaves them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kakeya.app.main import main

from .conftest import FAMILIES, save_tokenizer

BACKENDS = ("torch", "mlx")


def generate(target, draft, backend: str, capsys) -> tuple[int, str]:
    """``kakeya generate`` of two tokens: its exit status and its stderr."""
    argv = ["generate", "--target", str(target), "--draft", str(draft), "--backend", backend, "--prompt", "t5 t9"]
    code = main([*argv, "--max-tokens", "2", "--ignore-eos"])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_shard_the_index_names_but_the_directory_lacks_is_named(checkpoints, tmp_path, capsys, backend):
    """An interrupted download of a sharded target: the index names a shard that is not there."""
    target = shutil.copytree(checkpoints("float32", "e"), tmp_path / "target")
    gone = sorted(target.glob("model-*.safetensors"))[2]
    gone.unlink()
    code, err = generate(target, checkpoints("draft", "e"), backend, capsys)
    assert code == 2 and "Traceback" not in err
    assert f"names missing shards ['{gone.name}']" in err


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("which", ["target", "draft"])
def test_a_truncated_safetensors_file_is_named(checkpoints, tmp_path, capsys, which, backend):
    """A download cut short: the header is whole, the tensors it lists run past the end of the file."""
    pair = {"target": checkpoints("bfloat16", "e"), "draft": checkpoints("draft", "e")}
    pair[which] = shutil.copytree(pair[which], tmp_path / which)
    cut = pair[which] / "model.safetensors"
    with open(cut, "r+b") as fh:
        fh.truncate(cut.stat().st_size // 2)
    code, err = generate(pair["target"], pair["draft"], backend, capsys)
    assert code == 2 and "Traceback" not in err
    assert f"kakeya: error: {cut}: truncated" in err


@pytest.mark.parametrize(
    "spelling",
    [
        ".",
        "./",
        "../gemma-4-E2B-it",
        "gemma-4-E2B-it/",
        "gemma-4-E2B-it/.",
    ],
)
def test_the_served_model_is_named_after_the_directory_however_it_is_spelled(tmp_path, monkeypatch, spelling):
    """``kakeya serve ... --target .`` from inside the checkpoint served the model ``""``: a client naming the
    directory got model_not_found."""
    from kakeya.orchestrator.fronts.http_server import served_model_name

    (tmp_path / "gemma-4-E2B-it").mkdir()
    monkeypatch.chdir(tmp_path / ("gemma-4-E2B-it" if spelling.startswith(".") else ""))
    assert served_model_name(spelling) == "gemma-4-E2B-it"
    assert served_model_name(str(tmp_path / "gemma-4-E2B-it" / "target")) == "gemma-4-E2B-it"  # a make-tiny pair


@pytest.mark.parametrize("snapshot", ["0123abc", "0123abc/"])
def test_a_hub_cache_snapshot_is_served_as_its_repo_id(tmp_path, monkeypatch, snapshot):
    """``--target ~/.cache/huggingface/hub/models--google--gemma-4-E2B-it/snapshots/<commit>`` (the directory
    ``huggingface-cli download`` fills, its files links into ``blobs/``) was served as the model ``<commit>``, a
    name no client sends; the repo id is what vLLM serves a hub model as."""
    from kakeya.orchestrator.fronts.http_server import served_model_name

    repo = tmp_path / "hub" / "models--google--gemma-4-E2B-it" / "snapshots"
    assert served_model_name(str(repo / snapshot)) == "google/gemma-4-E2B-it"
    repo.mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "hub")  # a relative path too
    assert served_model_name(f"models--google--gemma-4-E2B-it/snapshots/{snapshot}") == "google/gemma-4-E2B-it"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_malformed_index_is_named(checkpoints, tmp_path, capsys, backend):
    target = shutil.copytree(checkpoints("float32", "e"), tmp_path / "target")
    index = target / "model.safetensors.index.json"
    index.write_text(index.read_text()[:40])  # cut short
    code, err = generate(target, checkpoints("draft", "e"), backend, capsys)
    assert code == 2 and "Traceback" not in err
    assert f"kakeya: error: {index}: unreadable" in err


def test_a_tensor_the_torch_target_lacks_is_named(checkpoints, tmp_path, capsys):
    """The index (which the torch target reads tensors through) lists no down projection for one layer."""
    target = shutil.copytree(checkpoints("float32", "e"), tmp_path / "target")
    index = target / "model.safetensors.index.json"
    listed = json.loads(index.read_text())
    del listed["weight_map"]["model.layers.3.mlp.down_proj.weight"]
    index.write_text(json.dumps(listed))
    code, err = generate(target, checkpoints("draft", "e"), "torch", capsys)
    assert code == 2 and "Traceback" not in err
    assert f"target checkpoint {target}: no tensor 'model.layers.3.mlp.down_proj.weight'" in err


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_untied_config_without_an_lm_head_is_refused_naming_both(checkpoints, tmp_path, capsys, backend):
    """A tied checkpoint (no lm_head.weight) whose config.json was edited to say the head is untied."""
    target = shutil.copytree(checkpoints("bfloat16", "e"), tmp_path / "target")
    cfg = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps(cfg | {"tie_word_embeddings": False}))
    code, err = generate(target, checkpoints("draft", "e"), backend, capsys)
    assert code == 2 and "Traceback" not in err
    assert "lm_head.weight" in err and (backend == "mlx" or "tie_word_embeddings" in err)


def test_inspect_refuses_an_untied_config_without_an_lm_head_as_a_load_does(checkpoints, tmp_path, capsys):
    target = shutil.copytree(checkpoints("bfloat16", "e"), tmp_path / "target")
    cfg = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps(cfg | {"tie_word_embeddings": False}))
    code, load_err = generate(target, checkpoints("draft", "e"), "torch", capsys)
    assert code == 2
    assert main(["inspect", str(target)]) == 2
    err = capsys.readouterr().err
    assert err == load_err and f"{target}: tie_word_embeddings is false, yet no lm_head.weight" in err


def test_compare_ar_reports_no_transformers_verdict_on_weights_transformers_cannot_read(checkpoints, capsys):
    """``mlx_lm.convert`` without -q of a multimodal target names its tensors ``language_model.model.*`` (mlx-lm's
    layout), which torch serves (the same tokens as transformers on the source) but transformers' loader skips:
    ``--compare-ar`` said 'OTHER tokens than ours' -- a lossless run reported as lossy."""
    target, draft = checkpoints("mlx", "mm"), checkpoints("draft", "mm")
    assert "language_model.model.embed_tokens.weight" in (target / "model.safetensors.index.json").read_text()
    argv = ["generate", "--target", str(target), "--draft", str(draft), "--backend", "torch", "--prompt", "t5 t9"]
    assert main([*argv, "--max-tokens", "12", "--ignore-eos", "--compare-ar", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["lossless"] is True
    assert "hf_identical" not in out and out["hf_reference"].startswith("not run: transformers")


def test_compare_ar_on_shards_without_their_index_reports_no_transformers_verdict(checkpoints, tmp_path, capsys):
    """Shards copied without model.safetensors.index.json: both backends serve them (each file's header lists its
    tensors), but transformers finds no weights file and --compare-ar ended in its OSError."""
    target = shutil.copytree(checkpoints("float32", "e"), tmp_path / "target")
    (target / "model.safetensors.index.json").unlink()
    save_tokenizer(target, FAMILIES["e"].text["vocab_size"])
    argv = ["generate", "--target", str(target), "--draft", str(checkpoints("draft", "e")), "--backend", "torch"]
    assert main([*argv, "--prompt", "t5 t9", "--max-tokens", "12", "--ignore-eos", "--compare-ar", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["lossless"] is True and out["hf_reference"].startswith("not run: transformers")


def test_a_split_orchestrator_started_elsewhere_reads_the_verifiers_relative_target_as_the_verifier(
    mlx_target, tiny_pair, tmp_path, monkeypatch
):
    """``kakeya serve verifier --target target`` run in the pair's directory, the orchestrator in another one that has
    a ``target/`` of its own: the orchestrator names the served model and finds the tokenizer (``split_engine``) by
    the path the verifier publishes in GetInfo, which must be the verifier's directory wherever it is read."""
    from kakeya.orchestrator.fronts.http_server import served_model_name
    from kakeya.verifier.local import LocalVerifier
    from kakeya.wire.convert import verifier_info_to_proto

    monkeypatch.chdir(tiny_pair.target.parent)
    published = verifier_info_to_proto(LocalVerifier(mlx_target, "target", (1,)).info, (1,)).model_name
    elsewhere = tmp_path / "elsewhere"
    save_tokenizer(elsewhere / "target", 64)  # another model's tokenizer, where the relative path points from here
    monkeypatch.chdir(elsewhere)
    assert served_model_name(published) == tiny_pair.target.parent.name
    assert (Path(published) / "tokenizer.json").samefile(tiny_pair.target / "tokenizer.json")


def test_an_index_that_puts_a_tensor_in_the_wrong_shard_is_named(checkpoints, tmp_path, capsys):
    """A hand-merged sharded target whose index names another shard for one tensor: torch reads each tensor where
    the index says it is (MLX reads every shard's header, as mlx-lm does, and is not misled)."""
    target = shutil.copytree(checkpoints("float32", "e"), tmp_path / "target")
    index = target / "model.safetensors.index.json"
    listed = json.loads(index.read_text())
    name = "model.layers.3.mlp.down_proj.weight"
    wrong = next(f for f in sorted(set(listed["weight_map"].values())) if f != listed["weight_map"][name])
    index.write_text(json.dumps(listed | {"weight_map": listed["weight_map"] | {name: wrong}}))
    code, err = generate(target, checkpoints("draft", "e"), "torch", capsys)
    assert code == 2 and "Traceback" not in err
    assert f"kakeya: error: {index}: weight_map puts '{name}' in {wrong}, which does not hold it\n" in err


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_home_relative_path_no_shell_expanded_is_the_same_checkpoint(
    checkpoints, tmp_path, monkeypatch, capsys, backend
):
    """``--target=~/models/e``: no shell expands a ``~`` after ``=`` (nor one in a unit file or a script's
    quotes). config.json was read from the home directory but the weights were looked for in ``./~``: 'no
    *.safetensors in checkpoint ~/models/e'."""
    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copytree(checkpoints("float32", "e"), tmp_path / "models" / "e")
    save_tokenizer(tmp_path / "models" / "e", FAMILIES["e"].text["vocab_size"])
    shutil.copytree(checkpoints("draft", "e"), tmp_path / "models" / "e-draft")
    argv = ["generate", "--backend", backend, "--prompt", "t5 t9", "--max-tokens", "6", "--ignore-eos", "--json"]
    runs = []
    for target, draft in [("~/models/e", "~/models/e-draft"), (tmp_path / "models" / "e", checkpoints("draft", "e"))]:
        assert main([*argv, f"--target={target}", f"--draft={draft}"]) == 0, capsys.readouterr().err
        runs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"])
    assert runs[0] == runs[1]
    assert main(["inspect", "~/models/e", "--draft=~/models/e-draft"]) == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_garbled_tokenizer_config_is_named(checkpoints, tmp_path, capsys, backend):
    """A tokenizer_config.json cut short (or hand-edited into invalid JSON) beside a whole tokenizer.json and the
    chat template in chat_template.jinja (so nothing reads the config for its template first)."""
    target = shutil.copytree(checkpoints("bfloat16", "e"), tmp_path / "target")
    save_tokenizer(target, FAMILIES["e"].text["vocab_size"])
    (target / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0]['content'] }}")
    config = target / "tokenizer_config.json"
    config.write_text('{"add_bos_token": tru')
    code, err = generate(target, checkpoints("draft", "e"), backend, capsys)
    assert code == 2 and "Traceback" not in err
    assert f"kakeya: error: target checkpoint {config}: unreadable tokenizer_config.json" in err
