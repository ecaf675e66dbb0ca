"""``kakeya train-ftheta --retrieval-frac / --retrieval-max-example / --answer-weight``: f_theta learns on recall
text too (the all-sliding recall target's band needles; docs/ftheta.md, "The recall pair")."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from kakeya.training.ftheta import REPORT_FILE, Batches, TrainArgs, train

SEQ = 96  # the tiny target's window is 32; a needle, question and answer need ~65 tokens
SMALL = dict(rank=8, batch=2, seq_len=SEQ, data_tokens=12_000, eval_seqs=2, lr=3e-3, warmup=2, log_every=100)
RECALL = dict(retrieval_frac=0.5, retrieval_max_example=SEQ, answer_weight=5.0)
quiet = dict(log=lambda m: None)


@pytest.fixture(scope="module")
def recall_text(tiny_pair):
    from kakeya.orchestrator.text import TextCodec
    from kakeya.training.retrieval import RetrievalText

    codec = TextCodec(tiny_pair.target)
    return codec, RetrievalText(codec.tokenizer, SEQ, max_bytes=2_000_000)


def test_recall_rows_and_answer_weights_are_a_function_of_seed_and_step(recall_text):
    codec, text = recall_text
    ids = np.arange(20_000, dtype=np.int32) % 500
    data = Batches(ids, codec.bos_id, SEQ, batch=3, eval_seqs=2, seed=7)
    batch, w, qw = data.step(5, 32, (text, 2, 20.0))
    again, w2, qw2 = data.step(5, 32, (text, 2, 20.0))
    other, _, _ = data.step(6, 32, (text, 2, 20.0))
    assert np.array_equal(np.array(batch), np.array(again)) and w == w2 and np.array_equal(np.array(qw), np.array(qw2))
    assert not np.array_equal(np.array(batch[:2]), np.array(other[:2]))
    batch, qw = np.array(batch), np.array(qw)
    assert batch.shape == qw.shape == (3, SEQ)
    plain, _, none = data.step(5, 32)
    assert none is None and np.array_equal(batch[2], np.array(plain)[2])  # the last row stays stdlib text
    assert set(np.unique(qw[2])) == {1.0} and set(np.unique(qw[:2])) == {1.0, 20.0}
    for row, weights in zip(batch[:2], qw[:2]):
        text_row = codec.decode(row.tolist())
        assert "The secret code is" in text_row and "Question:" in text_row
        # the weighted queries are those whose next token is an answer's: " NNNN.\n", token after token
        answers = codec.decode([int(row[t + 1]) for t in np.flatnonzero(weights == 20.0)])
        assert re.fullmatch(r"( \d{4}\.\n)*( \d{0,4}\.?\n?)?", answers) and re.search(r"\d", answers), answers
        assert weights[-1] == 1.0


def test_answer_weight_changes_the_attention_loss_on_the_same_batch(tiny_pair, tmp_path):
    first = {}
    for weight in (1.0, 5.0):
        args = TrainArgs(steps=1, save_every=100, **SMALL, retrieval_frac=0.5, answer_weight=weight)
        report = train(tiny_pair.target, tiny_pair.draft, tmp_path / str(weight), args, **quiet)
        first[weight] = report["loss_curve"][0]
        assert "recall text" in report["data"]["source"] and report["eval_recall"]["sliding"]["rel_mse_k"] > 0
    # the same parameters and batch at step 1: only the answers' queries' weight differs
    assert first[1.0]["dir"] == first[5.0]["dir"] and first[1.0]["attn"] != first[5.0]["attn"]


def test_resume_with_recall_text_is_exact_and_refuses_other_recall_flags(tiny_pair, tmp_path):
    straight = train(tiny_pair.target, tiny_pair.draft, tmp_path / "a", TrainArgs(steps=6, **SMALL, **RECALL), **quiet)
    out = tmp_path / "b"
    assert train(tiny_pair.target, tiny_pair.draft, out, TrainArgs(steps=6, **SMALL, **RECALL), stop_at=3, **quiet)
    with pytest.raises(ValueError, match="retrieval_frac was 0.5"):
        train(tiny_pair.target, tiny_pair.draft, out, TrainArgs(steps=6, **SMALL), resume=True, **quiet)
    other = RECALL | {"answer_weight": 2.0}
    with pytest.raises(ValueError, match="answer_weight was 5.0"):
        train(tiny_pair.target, tiny_pair.draft, out, TrainArgs(steps=6, **SMALL, **other), resume=True, **quiet)
    resumed = train(tiny_pair.target, tiny_pair.draft, out, TrainArgs(steps=6, **SMALL, **RECALL), resume=True, **quiet)
    assert resumed["resumed_at"] == [3]
    a, b = [p["loss"] for p in straight["loss_curve"]], [p["loss"] for p in resumed["loss_curve"]]
    assert np.allclose(a, b, rtol=1e-4)
    assert json.loads((out / REPORT_FILE).read_text())["args"]["retrieval_frac"] == 0.5


@pytest.mark.parametrize(
    "flags, fragment",
    [({"retrieval_frac": 1.5}, "--retrieval-frac must lie in"), ({"answer_weight": 0.0}, "--answer-weight must be")],
)
def test_bad_recall_flags_are_refused_by_name(tiny_pair, tmp_path, flags, fragment):
    with pytest.raises(ValueError, match=fragment):
        train(tiny_pair.target, tiny_pair.draft, tmp_path, TrainArgs(steps=1, **SMALL, **flags), **quiet)
