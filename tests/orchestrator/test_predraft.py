"""Pre-drafting on the trained demo pair, in process: the same tokens as without it, and pre-drafts that are used.

The demo pair's drafter accepts long runs, so some blocks are accepted in full
with the next token guessed: those blocks open with their pre-draft (the
drafter's forward over ``[block, mask * B]``, its context short of the block's
own aux). Both backends; the verifier alone is the reference.
"""

from __future__ import annotations

import pytest

from kakeya.core.request import Request
from kakeya.orchestrator.decode.engine import RunOptions

PROMPT = "import os\nimport sys\n\ndef main(argv):\n    "


@pytest.fixture(scope="module", params=["torch", "mlx"])
def engine(request, demo_pair):
    from kakeya.orchestrator.assembly import build_local_engine

    return build_local_engine(str(demo_pair.target), str(demo_pair.draft), request.param)


@pytest.mark.parametrize("block_size", [2, 4, 16, 0])
def test_predrafted_blocks_commit_the_verifiers_own_tokens(engine, block_size):
    prompt = engine.codec.encode(PROMPT)
    alone = engine.generate(Request(prompt, max_tokens=64, block_size=1, ignore_eos=True))
    req = Request(prompt, max_tokens=64, block_size=block_size, ignore_eos=True)
    plain = engine.generate(req, RunOptions(predraft=False))
    ahead = engine.generate(req, RunOptions(predraft=True))
    assert plain.token_ids == ahead.token_ids == alone.token_ids
    assert plain.predrafts == 0
    drafted = [b for b in ahead.blocks[1:] if b.drafted]
    assert ahead.predrafts <= len(drafted)  # only a drafted block has a next one to pre-draft
    if block_size:  # auto may choose AR (no draft, nothing to pre-draft) where drafting does not pay
        assert ahead.predrafts > 0
    used = [b for b in ahead.blocks[1:] if b.predrafted]
    if block_size in (2, 4):  # short blocks are accepted in full often: their pre-drafts get used
        assert used
    if block_size == 2:  # and a used one is accepted in turn (at 4 that depends on how good the pair is)
        assert max(b.accepted for b in used) > 0


@pytest.mark.parametrize("block_size", [4, 8, 0])
def test_predrafts_prepared_for_rejections_commit_the_verifiers_own_tokens(engine, block_size):
    """With alternatives the next block is also prepared for a rejection at each candidate with the
    drafter's next likeliest tokens there: the drafter's second choice is often the verifier's."""
    prompt = engine.codec.encode(PROMPT)
    alone = engine.generate(Request(prompt, max_tokens=64, block_size=1, ignore_eos=True))
    req = Request(prompt, max_tokens=64, block_size=block_size, ignore_eos=True)
    ahead = engine.generate(req, RunOptions(predraft=True, predraft_alternatives=2, ngram=False))
    assert ahead.token_ids == alone.token_ids
    after_rejection = [b for a, b in zip(ahead.blocks[1:], ahead.blocks[2:]) if b.predrafted and a.accepted < a.drafted]
    if block_size:
        assert after_rejection


def test_alternatives_out_of_range_are_refused_before_any_drafter_sees_them(engine):
    """A drafter server refuses more than 4, and a refused pre-draft would back the drafter off for every request."""
    from kakeya.orchestrator.decode.engine import Engine

    req = Request(engine.codec.encode(PROMPT), max_tokens=8, block_size=4, ignore_eos=True)
    with pytest.raises(ValueError, match="predraft_alternatives"):
        engine.generate(req, RunOptions(predraft=True, predraft_alternatives=5))
    with pytest.raises(ValueError, match="predraft_alternatives"):
        Engine(engine.verifier, engine.drafter, engine.codec, predraft=True, predraft_alternatives=-1)


def test_a_malformed_predraft_answer_is_the_drafters_failure():
    from kakeya.orchestrator.remote.drafter import predrafts_from_proto
    from kakeya.wire.kakeya.v1 import drafter_pb2 as pb

    good = pb.DrafterResponse.Predrafted(
        token_ids=[5, 6, 7],
        outcomes=[pb.DrafterResponse.Predrafted.Outcome(accepted=1, next_token=9, token_ids=[10, 11])],
    )
    found = predrafts_from_proto(good, pending=3, block_size=3, vocab=100)
    assert found.after(3, 5) == (6, 7) and found.after(1, 9) == (10, 11) and found.after(0, 9) is None
    for bad in (
        pb.DrafterResponse.Predrafted(token_ids=[5, 6, 7, 8]),  # more candidates than the block holds
        pb.DrafterResponse.Predrafted(token_ids=[5, 100]),  # outside the vocabulary
        pb.DrafterResponse.Predrafted(outcomes=[pb.DrafterResponse.Predrafted.Outcome(accepted=4, next_token=1)]),
    ):
        with pytest.raises(ValueError, match="malformed"):
            predrafts_from_proto(bad, pending=3, block_size=3, vocab=100)
