"""Constrained greedy decoding inside the speculative loop: spec == constrained AR (block_size 1), token for token.

The demo pair on torch (colocated, CPU): every constraint kind, fixed blocks and auto, the batched verify
(several constrained and unconstrained sessions in one forward) against each session alone, and every output
that ended at EOS parses and satisfies its constraint.
"""

from __future__ import annotations

import numpy as np
import pytest

from kakeya.core.contract import Draft, SessionOptions
from kakeya.core.request import Request
from kakeya.verifier.session import decide_batch

from .cases import PROMPTS, assert_matches, constraints

CASES = constraints()
MAX_TOKENS = 64


@pytest.mark.parametrize("name", sorted(CASES))
def test_speculative_equals_constrained_ar(engine, name):
    c = CASES[name]
    finished = 0
    for text in PROMPTS:
        prompt = engine.codec.encode(text)
        ar = engine.generate(Request(prompt, max_tokens=MAX_TOKENS, block_size=1, constraint=c))
        free = engine.generate(Request(prompt, max_tokens=MAX_TOKENS, block_size=1))
        assert ar.token_ids != free.token_ids, "the constraint changed nothing: this test would prove little"
        for b in (4, 8, 0):
            spec = engine.generate(Request(prompt, max_tokens=MAX_TOKENS, block_size=b, constraint=c))
            assert spec.token_ids == ar.token_ids, (name, text, b)
        if ar.token_ids[-1] in engine.verifier.info.eos_token_ids:
            finished += 1
            assert_matches(name, c, engine.codec.decode(ar.token_ids[:-1]))
    assert finished, f"{name}: no output reached EOS within {MAX_TOKENS} tokens; nothing was validated"


def test_an_unfinished_grammar_never_ends_early(engine):
    """The grammar holds EOS back until it is complete: a 6-digit regex yields exactly its 6 digits, then EOS."""
    from kakeya.core.constraints import Constraint

    c = Constraint("regex", r"[0-9]{6}")
    g = engine.generate(Request(engine.codec.encode(PROMPTS[0]), max_tokens=30, block_size=8, constraint=c))
    text = engine.codec.decode(g.token_ids[:-1])
    assert g.token_ids[-1] in engine.verifier.info.eos_token_ids and len(text) == 6 and text.isdigit(), text


def _session(engine, prompt, constraint):
    s = engine.verifier.open_session(options=SessionOptions(constraint=constraint))
    first, _ = s.prefill(prompt)
    return s, first


def test_batched_verify_applies_each_sessions_masks(engine):
    """Three constrained sessions and one free one decided in one batched forward == each decided alone,
    round after round, with drafts that are right, partly right, and outside the grammar."""
    cs = [CASES["person"], CASES["phone"], None, CASES["nested"]]
    prompt = engine.codec.encode(PROMPTS[1])
    rng = np.random.default_rng(0)
    # each session's own constrained AR output: the drafts copy it (with planted errors)
    truth = [engine.generate(Request(prompt, max_tokens=40, block_size=1, constraint=c)).token_ids[1:] for c in cs]
    batched = [_session(engine, prompt, c) for c in cs]
    alone = [_session(engine, prompt, c) for c in cs]
    last = [first for _, first in batched]
    assert last == [first for _, first in alone]
    done = [0] * len(cs)
    for round_ in range(6):
        drafts = []
        for k in range(len(cs)):
            d = list(truth[k][done[k] : done[k] + 5]) or [5]
            if round_ % 2 and len(d) > 2:
                d[2] = int(rng.integers(5, 1000))  # a wrong candidate mid-block
            drafts.append(Draft(d))
        together = decide_batch([(s, last[k], drafts[k]) for k, (s, _) in enumerate(batched)])
        for k, (s, _) in enumerate(alone):
            v = s.decide(last[k], drafts[k])
            assert (together[k].accepted, together[k].next_token) == (v.accepted, v.next_token), (round_, k)
            done[k] += v.accepted + 1
            last[k] = v.next_token
    for s, _ in batched + alone:
        s.close()
    assert sum(done) > 4 * 6, "the drafts were never accepted: the masks of later rows went untested"


def test_forced_runs_are_drafted_without_the_drafter_and_change_no_token(engine):
    """A JSON schema's keys, quotes and brackets are forced: those blocks are the grammar's run (no drafter
    guess), all accepted, and the output is the constrained AR output with or without them."""
    from kakeya.orchestrator.decode.engine import RunOptions

    c = CASES["person"]
    prompt = engine.codec.encode(PROMPTS[0])
    ar = engine.generate(Request(prompt, max_tokens=MAX_TOKENS, block_size=1, constraint=c))
    req = Request(prompt, max_tokens=MAX_TOKENS, block_size=8, constraint=c)
    guided = engine.generate(req)
    blind = engine.generate(req, RunOptions(guided=False))
    assert guided.token_ids == blind.token_ids == ar.token_ids
    forced = [b for b in guided.blocks if b.forced]
    assert len(forced) >= 3 and not any(b.forced for b in blind.blocks)
    assert all(b.accepted >= 1 for b in forced)  # the target took the grammar's tokens (at least the first)
    assert len(guided.blocks) < len(blind.blocks)  # fewer blocks for the same tokens
    # the drafter's blocks were cut before a candidate the grammar refuses: fewer positions verified in all
    drafted = [b.drafted for b in guided.blocks[1:] if not b.forced]
    assert any(n < 7 for n in drafted) and all(b.drafted == 7 for b in blind.blocks[1:-1])


def test_formats_llguidance_has_no_regex_for_are_plain_strings(engine):
    """A pydantic model's schema (``SecretStr``'s ``password``, ``bytes``' ``binary``, ``Path``'s ``path``,
    ``ipv4network``, ``ipvanyaddress`` beside the ``uri`` and ``uuid`` llguidance enforces), as pydantic and the
    ``openai`` SDK's ``parse`` send it: compiled, held (those two formats enforced), and spec == constrained AR."""
    import openai

    from kakeya.core.constraints import Constraint
    from tests.orchestrator.tool_models import SignUp

    prompt = engine.codec.encode(PROMPTS[1])
    strict = openai.lib._pydantic.to_strict_json_schema(SignUp)  # what parse(response_format=SignUp) sends
    for schema in (SignUp.model_json_schema(), strict):
        c = Constraint("json_schema", schema)
        ar = engine.generate(Request(prompt, max_tokens=MAX_TOKENS, block_size=1, constraint=c))
        for b in (4, 0):
            spec = engine.generate(Request(prompt, max_tokens=MAX_TOKENS, block_size=b, constraint=c))
            assert spec.token_ids == ar.token_ids, b
        text = engine.codec.decode(ar.token_ids)
        assert text.startswith('{"login": "') and '"home": "' in text, text  # past three plain-string formats
