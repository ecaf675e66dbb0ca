"""Streamed text chunks add up to the decoded whole, whatever the chunking."""

import random

import pytest

from kakeya.checkpoints.tiny import demo_pair
from kakeya.orchestrator.text import StreamDecoder, TextCodec, text_stream


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
            out.append(dec.add(ids[i : i + n])[1])
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


def _byte_fallback_codec(path) -> tuple[TextCodec, object]:
    """A SentencePiece-style tokenizer (Gemma's): a byte it has no piece for is spelled ``<0xC3>``, and a run of
    such pieces that is no whole UTF-8 decodes to one U+FFFD per byte."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {f"<0x{b:02X}>": b for b in range(256)} | {"a": 256, "<bos>": 257}
    tok = Tokenizer(models.BPE(vocab, [], byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tok.save(str(path / "tokenizer.json"))
    return TextCodec(path), tok


def test_byte_fallback_pieces_are_their_byte(tmp_path):
    """A byte-fallback piece's bytes are that byte, its text U+FFFD."""
    codec, tok = _byte_fallback_codec(tmp_path)
    ids = tok.encode("aé", add_special_tokens=False).ids
    assert ids == [256, 0xC3, 0xA9]
    assert [codec.token(t) for t in ids] == [("a", b"a"), ("\ufffd", b"\xc3"), ("\ufffd", b"\xa9")]


def _first_stop(codec, ids, stops) -> tuple[str, int, bool]:
    """What a stream cut at ``stops`` must give: the text before the first stop in the text of the first tokens
    that hold one, how many tokens those are, and whether one was hit."""
    for k in range(1, len(ids) + 1):
        text = codec.decode(ids[:k])
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return text[: min(hits)], k, True
    return codec.decode(ids), len(ids), False


@pytest.mark.parametrize("seed", range(40))
def test_stop_strings_are_found_whatever_tokens_and_blocks_split_their_characters(tiny_pair, tmp_path, seed):
    """Streamed in blocks of any size, text cut at stop strings is the text up to the first stop, and no chunk
    carries U+FFFD for a character whose bytes span tokens or blocks: a CJK full stop or an emoji whose last byte
    comes in the next block is still found, on a byte-level BPE (the demo pair's) and a byte-fallback one (Gemma's).
    The ids sent end with the token that completed the stop; byte-fallback pieces decode to U+FFFDs until their whole
    run is UTF-8, so there the stop shows (and the stream ends) with the token that completes the run."""
    rng = random.Random(seed)
    text = "说中文。😀 ok👍🏽 é̃!\n" * 2
    for codec, exact in ((TextCodec(demo_pair().target), True), (_byte_fallback_codec(tmp_path)[0], False)):
        ids = codec.tokenizer.encode(text, add_special_tokens=False).ids
        stops = [rng.choice(["。", "😀", "👍🏽", "🏽", "文", "é̃", "!", "k👍"]) for _ in range(rng.randint(1, 3))]
        stream, chunks, sent, hit = text_stream(codec, stops), [], [], False
        while len(sent) < len(ids) and not hit:
            tokens, chunk, hit = stream.add(ids[len(sent) : len(sent) + rng.randint(1, 4)])
            sent += tokens
            chunks.append(chunk)
        chunks.append(stream.flush())
        cut, tokens, stopped = _first_stop(codec, ids, stops)
        assert ("".join(chunks), hit) == (cut, stopped)
        shows = [any(s in codec.decode(sent[:n]) for s in stops) for n in (len(sent) - 1, len(sent))]
        assert shows == [False, stopped] and (len(sent) == tokens or not exact)
        assert not any("\ufffd" in c for c in chunks)
