"""The training tests' one shared cost: the tokenized standard-library corpus, made once per tokenizer."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest

_CORPORA: dict[tuple, object] = {}


@pytest.fixture(autouse=True, scope="module")
def corpus_once():
    """``data.load_corpus`` answered from a cache keyed by the tokenizer's own JSON and the arguments: every
    ``train-target`` / ``train-drafter`` / ``drafter_eval`` call here tokenizes the whole standard library
    (a walk of the interpreter's lib directory, site-packages included, then BPE over the files), the same
    corpus each time within a run. The arrays are made read-only, so a caller that wrote into them would fail
    here rather than change another test's data; each caller gets its own Corpus object."""
    from kakeya.training import data

    real = data.load_corpus

    def load_corpus(tokenizer, heldout_pct: int = 5, max_bytes: int | None = None):
        key = (hashlib.sha256(tokenizer.to_str().encode()).hexdigest(), heldout_pct, max_bytes)
        if key not in _CORPORA:
            corpus = real(tokenizer, heldout_pct, max_bytes)
            corpus.train.setflags(write=False)
            corpus.heldout.setflags(write=False)
            _CORPORA[key] = corpus
        c = _CORPORA[key]
        return dataclasses.replace(c, train_files=list(c.train_files), heldout_files=list(c.heldout_files))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(data, "load_corpus", load_corpus)
        yield
