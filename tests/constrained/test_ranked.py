"""Grammar-aware drafting among the drafter's ranks: a greedy constrained request's drafter returns each
candidate's likeliest ids (``Draft.ranked``), and the loop takes at each position the best-ranked id the grammar
allows after the committed tokens and the ids chosen before it (``orchestrator/proposers.py``)."""

from __future__ import annotations

import pytest

from kakeya.core.constraints import Constraint, Grammar, tokenizer
from kakeya.core.contract import Draft, SessionOptions
from kakeya.core.request import Request, SamplingParams
from kakeya.orchestrator.decode.engine import RunOptions
from kakeya.orchestrator.decode.loop import Decode, DecodeOptions, alone
from kakeya.orchestrator.proposers import RANKED, open_guide

from .cases import PROMPTS, constraints


def _grammar(engine, c: Constraint) -> Grammar:
    info = engine.verifier.info
    return Grammar(c.grammar(), tokenizer(engine.codec.tokenizer_json, info.vocab_size, (info.eos_token_ids[0],)))


def test_choose_takes_each_positions_best_ranked_allowed_id(engine):
    """The walk skips refused ids, keeps the first allowed one per position, stops where none is, and leaves
    the grammar's state as it was."""
    g = _grammar(engine, Constraint("regex", r"[0-9]{3}x"))
    digit = [engine.codec.encode(str(d))[-1] for d in range(10)]
    letter = engine.codec.encode("q")[-1]
    assert g.allowed_prefix([letter]) == 0 and g.allowed_prefix([digit[7]]) == 1
    ranked = [(letter, digit[7], digit[1]), (digit[2],), (letter, letter), (digit[3],)]
    assert g.choose(ranked) == [digit[7], digit[2]]  # position 3 has no allowed id: the block ends there
    assert g.choose([(letter,)]) == []
    g.advance([digit[5]])  # the state was left where it was: the whole regex is still ahead
    assert g.allowed_prefix([digit[1], digit[2]]) == 2


def test_drafter_returns_ranks_only_when_asked(engine):
    """``SessionOptions.ranked`` = k: every greedy draft carries k ids a candidate, the candidate first; an
    unconstrained session's draft carries none; a sampling session cannot ask."""
    prompt = engine.codec.encode(PROMPTS[0])
    v = engine.verifier.open_session()
    first, aux = v.prefill(prompt)
    plain = engine.drafter.open_session()
    ranked = engine.drafter.open_session(options=SessionOptions(ranked=5))
    a, b = plain.draft(aux, first, 8), ranked.draft(aux, first, 8)
    assert a.ranked is None and a.tokens == b.tokens
    assert len(b.ranked) == 7 and all(len(row) == 5 and row[0] == t for row, t in zip(b.ranked, b.tokens))
    assert all(len(set(row)) == 5 for row in b.ranked)
    for s in (v, plain, ranked):
        s.close()
    with pytest.raises(ValueError, match="ranked"):
        engine.drafter.open_session(SamplingParams(temperature=1.0, seed=1), SessionOptions(ranked=4))
    with pytest.raises(ValueError, match="ranked must be 0..16"):
        engine.drafter.open_session(options=SessionOptions(ranked=17))


def test_a_batched_draft_ranks_only_the_sessions_that_asked(engine):
    """One batched step over a ranked and an unranked session (different blocks): each gets what it gets alone."""
    from kakeya.drafter.session import draft_together

    prompts = [engine.codec.encode(PROMPTS[0]), engine.codec.encode(PROMPTS[1])]
    opened = []
    for prompt in prompts:
        v = engine.verifier.open_session()
        opened.append((v, *v.prefill(prompt)))
    alone, batched = [], []
    for out in (alone, batched):
        sessions = [engine.drafter.open_session(options=SessionOptions(ranked=r)) for r in (RANKED, 0)]
        calls = [s.check(aux, first, b) for s, (_, first, aux), b in zip(sessions, opened, (8, 5))]
        out += [draft_together([call])[0] for call in calls] if out is alone else draft_together(calls)
        for s in sessions:
            s.close()
    for v, *_ in opened:
        v.close()
    assert [d.tokens for d in batched] == [d.tokens for d in alone]
    assert batched[0].ranked == alone[0].ranked and len(batched[0].ranked) == 7
    assert batched[1].ranked is None and len(batched[1].tokens) == 4


class _Recording:
    """A verifier session that records every draft it decides (what the loop proposed)."""

    def __init__(self, session):
        self._session, self.drafts = session, []

    def decide(self, last, draft: Draft):
        self.drafts.append((last, draft))
        return self._session.decide(last, draft)

    def __getattr__(self, name):
        return getattr(self._session, name)


@pytest.mark.parametrize("name", ["nested", "phone"])
def test_every_candidate_is_allowed_and_the_output_is_unchanged(engine, name, monkeypatch):
    """Every candidate the verifier sees is one the grammar allows there, each position's best-ranked allowed
    id; some replaced the drafter's own refused argmax; the output is constrained AR's, token for token (the
    engine's run asks its drafter for the ranks)."""
    c = constraints()[name]
    prompt = engine.codec.encode(PROMPTS[0])
    ar = engine.generate(Request(prompt, max_tokens=64, block_size=1, constraint=c))
    info = engine.verifier.info
    verifier = _Recording(engine.verifier.open_session(options=SessionOptions(constraint=c)))
    drafter, drafts = engine.drafter.open_session(options=SessionOptions(ranked=RANKED)), []
    draft = drafter.draft
    drafter.draft = lambda *a: drafts.append(draft(*a)) or drafts[-1]
    guide = open_guide(c, engine.codec.tokenizer_json, info.vocab_size, info.eos_token_ids)
    decode = Decode(verifier, drafter, prompt, DecodeOptions(64, 8, frozenset(info.eos_token_ids), guide=guide))
    blocks = list(alone(decode))
    verifier.close(), drafter.close()
    assert decode.generation.token_ids == ar.token_ids
    g, proposed = _grammar(engine, c), verifier.drafts
    assert len(proposed) == len(blocks) - 1  # a block a round, after the prefill's
    g.advance(blocks[0].tokens)
    own_blocks = iter(d for d in drafts if d.tokens)  # the drafter's own blocks, in order (a forced run drafts none)
    gained = 0
    for (_, proposal), block in zip(proposed, blocks[1:]):
        assert g.allowed_prefix(proposal.tokens) == len(proposal.tokens), (name, proposal.tokens)
        if not block.forced:
            own = next(own_blocks)
            assert own.ranked is not None and all(row[0] == t for row, t in zip(own.ranked, own.tokens))
            assert proposal.tokens == tuple(g.choose(own.ranked))
            gained += len(proposal.tokens) > g.allowed_prefix(own.tokens)  # more than cutting the argmax keeps
        g.advance(block.tokens)
    assert gained, "no ranked id ever replaced a refused argmax: the ranks went untested"

    opened = []

    def drafter_session(*args, **kw):
        opened.append(open_drafter(*args, **kw))
        return opened[-1]

    open_drafter = engine.drafter.open_session
    monkeypatch.setattr(engine.drafter, "open_session", drafter_session)
    got = engine.generate(Request(prompt, max_tokens=64, block_size=8, constraint=c))
    blind = engine.generate(Request(prompt, max_tokens=64, block_size=8, constraint=c), RunOptions(guided=False))
    assert got.token_ids == blind.token_ids == ar.token_ids
    assert [s.ranked for s in opened] == [RANKED, 0]  # a blind run pays nothing for ranks


def test_mlx_ranked_drafting_equals_constrained_ar(demo_pair):
    """The same on MLX (its drafter's ranks by argpartition, its packed masks expanded by mx): guided == blind ==
    constrained AR, the guided run in fewer blocks."""
    pytest.importorskip("mlx.core")
    from kakeya.orchestrator.assembly import build_local_engine

    mlx = build_local_engine(demo_pair.target, demo_pair.draft, "mlx", None)
    c = constraints()["nested"]
    prompt = mlx.codec.encode(PROMPTS[0])
    ar = mlx.generate(Request(prompt, max_tokens=64, block_size=1, constraint=c))
    req = Request(prompt, max_tokens=64, block_size=8, constraint=c)
    guided, blind = mlx.generate(req), mlx.generate(req, RunOptions(guided=False))
    assert guided.token_ids == blind.token_ids == ar.token_ids
    assert len(guided.blocks) < len(blind.blocks)
