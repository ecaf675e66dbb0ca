"""The byte-level BPE tokenizer of the tiny checkpoints."""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from kakeya.checkpoints import tokenizer as tk
from kakeya.orchestrator.text import TextCodec

TEXTS = [
    "def foo(x):\n    return x ** 2  # squared\n",
    "  leading spaces, trailing spaces  \n\n\t tabs\r\nCRLF",
    "unicode: héllo wörld ✓ 日本語 🙂 \u200b zero-width",
    "",
]
SPECIAL_LOOKING = "<bos> text with literal <mask> and <eos> markers"


def test_special_ids(tiny_pair):
    tok = Tokenizer.from_file(str(tiny_pair.target / "tokenizer.json"))
    assert tok.get_vocab_size() == 1024
    for i, t in enumerate(tk.SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i
    assert [tok.id_to_token(i) for i in range(5)] == ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_tokenizers(tiny_pair, text):
    tok = Tokenizer.from_file(str(tiny_pair.target / "tokenizer.json"))
    ids = tok.encode(text).ids
    assert ids[0] == tk.BOS_ID
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_special_token_strings_parse_as_specials(tiny_pair):
    # as in Gemma: literal "<mask>" in text is the special token, and decodes back
    tok = Tokenizer.from_file(str(tiny_pair.target / "tokenizer.json"))
    ids = tok.encode(SPECIAL_LOOKING).ids
    assert ids[:2] == [tk.BOS_ID, tk.BOS_ID] and tk.MASK_ID in ids and tk.EOS_ID in ids
    assert tok.decode(ids[1:], skip_special_tokens=False) == SPECIAL_LOOKING


def test_transformers_auto_tokenizer(tiny_pair):
    transformers = importlib.import_module("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(tiny_pair.target))
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id, tok.unk_token_id, tok.mask_token_id) == (
        0,
        1,
        2,
        3,
        4,
    )
    for text in TEXTS:
        ids = tok(text)["input_ids"]
        assert ids[0] == tk.BOS_ID and tk.EOS_ID not in ids
        assert tok.decode(ids, skip_special_tokens=True) == text


@pytest.mark.parametrize("config", ["none", "without bos_token"])
def test_a_tokenizer_json_alone_encodes_as_transformers_does(tiny_pair, tmp_path, config):
    """A checkpoint holding tokenizer.json but no tokenizer_config.json (or one naming no bos_token): its
    post-processor prepends <bos> for transformers and mlx-lm; the served prompt lacked it, so greedy output
    differed from the reference's."""
    shutil.copy(tiny_pair.target / "tokenizer.json", tmp_path)
    if config != "none":
        cfg = json.loads((tiny_pair.target / "tokenizer_config.json").read_text())
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "bos_token"}))
    reference = importlib.import_module("transformers").AutoTokenizer.from_pretrained(str(tmp_path))
    for text in TEXTS:
        assert TextCodec(tmp_path).encode(text) == reference(text)["input_ids"]


def test_mlx_lm_tokenizer(tiny_pair):
    tokenizer_utils = importlib.import_module("mlx_lm.tokenizer_utils")
    tok = tokenizer_utils.load(Path(tiny_pair.target))
    assert tok.bos_token_id == tk.BOS_ID and tok.eos_token_ids == {tk.EOS_ID}
    # mlx-lm's BPEStreamingDetokenizer drops one leading space of the first
    # segment (its OpenAI-BPE convention), so texts start with a non-space here.
    for text in [t for t in TEXTS if t and not t.startswith(" ")]:
        ids = tok.encode(text)
        assert ids[0] == tk.BOS_ID
        detok = tok.detokenizer
        detok.reset()
        for i in ids[1:]:
            detok.add_token(i)
        detok.finalize()
        assert detok.text == text


SMALL_CORPUS = 300_000  # keeps the extra training runs short


def test_training_is_deterministic(tmp_path):
    first = tk.train_tokenizer(vocab_size=512, max_bytes=SMALL_CORPUS)
    tk._train_json.cache_clear()  # force a real second training run
    second = tk.train_tokenizer(vocab_size=512, max_bytes=SMALL_CORPUS)
    assert first.to_str() == second.to_str()
    tk.write_tokenizer(first, tmp_path / "a")
    tk.write_tokenizer(second, tmp_path / "b")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_vocab_size_is_configurable():
    tok = tk.train_tokenizer(vocab_size=512, max_bytes=SMALL_CORPUS)
    assert tok.get_vocab_size() == 512 and tok.token_to_id("<mask>") == tk.MASK_ID
    with pytest.raises(ValueError, match="vocab_size"):
        tk.train_tokenizer(vocab_size=100)
