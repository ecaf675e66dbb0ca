"""Streamed text chunks add up to the decoded whole, whatever the chunking."""

import random

import pytest

from kakeya.checkpoints.tiny import demo_pair
from kakeya.orchestrator.text import StreamDecoder, TextCodec


@pytest.mark.parametrize("seed", range(5))
def test_stream_chunks_concatenate_to_the_full_decode(tiny_pair, seed):
    rng = random.Random(seed)
    for pair in (tiny_pair, demo_pair()):
        codec = TextCodec(pair.target)
        text = "def f(x):\n    return x * 2  # é ü 中文 ✓\n" * 3
        ids = codec.encode(text)[1:] + [rng.randrange(5, codec.vocab_size) for _ in range(200)]
        dec, out, i = StreamDecoder(codec), [], 0
        while i < len(ids):
            n = rng.randint(1, 9)
            out.append(dec.add(ids[i : i + n]))
            i += n
        out.append(dec.flush())
        assert "".join(out) == codec.decode(ids)


def test_a_tokens_bytes_join_to_the_texts_bytes_even_inside_a_character(tiny_pair):
    """``TextCodec.token`` (what logprobs list): each token's exact bytes, joined, are the text's UTF-8, also
    where one character spans several tokens (whose text alone is U+FFFD); a special token is named."""
    for pair in (tiny_pair, demo_pair()):
        codec = TextCodec(pair.target)
        text = "def f(x):\n    return x * 2  # é ü 中文 ✓\n"
        ids = codec.encode(text)
        pieces = [codec.token(t) for t in ids[1:]]
        assert b"".join(raw for _, raw in pieces) == text.encode()
        assert any(t == "\ufffd" for t, _ in pieces)  # a character split over tokens
        assert all(t == raw.decode() for t, raw in pieces if t != "\ufffd")
        assert codec.token(ids[0])[0] == codec.tokenizer.id_to_token(ids[0])  # <bos>, named


def test_byte_fallback_pieces_are_their_byte(tmp_path):
    """A SentencePiece-style tokenizer (Gemma's) spells a byte it has no piece for as ``<0xC3>``: its bytes are
    that byte, its text U+FFFD."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {f"<0x{b:02X}>": b for b in range(256)} | {"a": 256, "<bos>": 257}
    tok = Tokenizer(models.BPE(vocab, [], byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tok.save(str(tmp_path / "tokenizer.json"))
    codec = TextCodec(tmp_path)
    ids = tok.encode("aé", add_special_tokens=False).ids
    assert ids == [256, 0xC3, 0xA9]
    assert [codec.token(t) for t in ids] == [("a", b"a"), ("\ufffd", b"\xc3"), ("\ufffd", b"\xa9")]
