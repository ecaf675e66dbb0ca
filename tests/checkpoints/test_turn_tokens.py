"""Gemma's turn markers as single special tokens (``checkpoints/turn_tokens.py``): what the shipped demo pair has."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file

from kakeya.checkpoints.turn_tokens import EMBED, LM_HEAD, TURN_TOKENS, add_turn_tokens, has_turn_tokens, main
from kakeya.core.request import Request
from kakeya.orchestrator.assembly import build_local_engine
from kakeya.orchestrator.text import TextCodec

CHAT = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"},
        {"role": "assistant", "content": "    return a + b\n"}, {"role": "user", "content": "and sub?"}]  # fmt: skip
PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    "


@pytest.fixture(scope="module")
def pairs(tiny_pair, tmp_path_factory):
    """The tiny pair as shipped, and a copy given the turn tokens."""
    root = tmp_path_factory.mktemp("turn")
    shutil.copytree(tiny_pair.target, root / "target")
    shutil.copytree(tiny_pair.draft, root / "draft")
    ids = add_turn_tokens(root / "target", (root / "draft",))
    return tiny_pair, root, ids


def test_markers_get_the_next_ids_and_encode_as_one_token_each(pairs):
    tiny, root, ids = pairs
    old, new = TextCodec(tiny.target), TextCodec(root / "target")
    assert ids == {"<start_of_turn>": old.vocab_size, "<end_of_turn>": old.vocab_size + 1}
    assert (
        new.vocab_size == old.vocab_size + 2 and not has_turn_tokens(tiny.target) and has_turn_tokens(root / "target")
    )
    ids_new, ids_old = new.encode_chat(CHAT), old.encode_chat(CHAT)  # the model's turn opened at the end
    assert ids_new.count(ids["<start_of_turn>"]) == 5 and ids_new.count(ids["<end_of_turn>"]) == 4
    assert len(ids_new) < len(ids_old) - 9 * 5  # each marker was 7-8 BPE pieces
    # the messages' own text tokenizes as before, and decoding drops only the (special) markers
    body = old.tokenizer.encode("You write Python.", add_special_tokens=False).ids
    assert any(ids_new[i : i + len(body)] == body for i in range(len(ids_new)))
    assert new.decode(ids_new) == old.decode(ids_old).replace("<start_of_turn>", "").replace("<end_of_turn>", "")
    # text without the markers is untouched
    assert new.encode(PROMPT) == old.encode(PROMPT)


def test_weights_grow_by_two_rows_and_nothing_else_changes(pairs):
    tiny, root, ids = pairs
    old, new = load_file(str(tiny.target / "model.safetensors")), load_file(str(root / "target" / "model.safetensors"))
    assert old.keys() == new.keys()
    for name in old:
        if name in (EMBED, LM_HEAD):
            np.testing.assert_array_equal(new[name][: len(old[name])], old[name])
            assert new[name].shape == (old[name].shape[0] + 2, old[name].shape[1])
        else:
            np.testing.assert_array_equal(new[name], old[name])
    assert not new[LM_HEAD][-2:].any()  # a zero row: logit exactly 0, never above a trained token that scores > 0
    codec = TextCodec(tiny.target)
    for token, i in ids.items():
        pieces = codec.tokenizer.encode(token, add_special_tokens=False).ids
        np.testing.assert_allclose(new[EMBED][i], old[EMBED][pieces].mean(axis=0), rtol=1e-6)


def test_end_of_turn_ends_a_generation_as_in_an_instruction_tuned_gemma(pairs):
    tiny, root, ids = pairs
    import json

    assert json.loads((root / "target" / "generation_config.json").read_text())["eos_token_id"] == [
        1,
        ids["<end_of_turn>"],
    ]
    assert json.loads((tiny.target / "generation_config.json").read_text())["eos_token_id"] == 1


def test_running_again_changes_nothing(pairs):
    _, root, ids = pairs
    before = {p.name: p.read_bytes() for d in ("target", "draft") for p in (root / d).iterdir()}
    assert add_turn_tokens(root / "target", (root / "draft",)) == ids
    assert {p.name: p.read_bytes() for d in ("target", "draft") for p in (root / d).iterdir()} == before


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_greedy_output_on_text_is_unchanged_and_a_chat_prompt_runs(pairs, backend):
    """The grown pair loads (the drafter checks its vocabulary against the target's embedding), gives the same
    tokens and acceptance on a text prompt as before, and runs a chat prompt that holds the new ids."""
    tiny, root, _ = pairs
    kw = {"device": "cpu"} if backend == "torch" else {}
    old = build_local_engine(str(tiny.target), str(tiny.draft), backend, **kw)
    new = build_local_engine(str(root / "target"), str(root / "draft"), backend, **kw)
    req = Request(old.codec.encode(PROMPT), max_tokens=32, block_size=4, ignore_eos=True)
    a, b = old.generate(req), new.generate(req)
    assert a.token_ids == b.token_ids and a.acceptance_lengths == b.acceptance_lengths
    chat = new.generate(Request(new.codec.encode_chat(CHAT, add_generation_prompt=True), max_tokens=16, block_size=4,
                                ignore_eos=True))  # fmt: skip
    ar = new.generate(Request(list(chat.prompt_ids), max_tokens=16, block_size=1, ignore_eos=True))
    assert chat.token_ids == ar.token_ids


def test_the_other_loaders_read_the_markers_alike(pairs):
    _, root, ids = pairs
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(root / "target"))
    codec = TextCodec(root / "target")
    want = hf.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert list(want) == codec.encode_chat(CHAT, add_generation_prompt=True)
    assert [hf.convert_tokens_to_ids(t) for t in TURN_TOKENS] == list(ids.values())
    mlx_lm = pytest.importorskip("mlx_lm")
    model, tok = mlx_lm.load(str(root / "target"))
    assert tok.encode("<start_of_turn>user\n", add_special_tokens=False)[0] == ids["<start_of_turn>"]
    assert model.args.vocab_size == codec.vocab_size


def test_refuses_a_checkpoint_whose_parts_disagree(tiny_pair, tmp_path):
    shutil.copytree(tiny_pair.target, tmp_path / "target")
    shutil.copytree(tiny_pair.draft, tmp_path / "draft")
    cfg = (tmp_path / "draft" / "config.json").read_text().replace('"vocab_size": 1024', '"vocab_size": 1000')
    (tmp_path / "draft" / "config.json").write_text(cfg)
    before = {p.name: p.read_bytes() for p in (tmp_path / "target").iterdir()}
    with pytest.raises(ValueError, match="drafter vocab_size 1000"):
        main([str(tmp_path / "target"), str(tmp_path / "draft")])
    assert {p.name: p.read_bytes() for p in (tmp_path / "target").iterdir()} == before  # refused before any write


def test_the_demo_pair_ships_with_them(demo_pair):
    """What the chat benchmark's cached share rests on: the demo pair's turn markers are one token each."""
    assert has_turn_tokens(demo_pair.target)
    from kakeya.checkpoints.config import load_target_config

    assert load_target_config(demo_pair.target)["eos_token_id"] == [1, 1025]
    codec = TextCodec(demo_pair.target)
    ids = codec.encode_chat(CHAT)
    assert [codec.tokenizer.id_to_token(i) for i in ids[:2]] == ["<bos>", "<start_of_turn>"]
