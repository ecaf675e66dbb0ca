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
