"""The compiled-grammar cache (``core/constraints.py`` ``CompiledGrammars``): a grammar compiles once per
tokenizer, each user gets its own matcher, the bound holds, and a request compiles its constraint once."""

from __future__ import annotations

import pytest

from kakeya.core import constraints
from kakeya.core.constraints import CompiledGrammars, Constraint, ConstraintError
from kakeya.core.request import Request

from .cases import PROMPTS


@pytest.fixture(scope="module")
def tok(engine):
    info = engine.verifier.info
    return constraints.tokenizer(engine.codec.tokenizer_json, info.vocab_size, (info.eos_token_ids[0],))


def test_a_second_compile_hits_and_each_matcher_is_its_own(engine, tok):
    cache = CompiledGrammars(maxsize=2)
    digits = Constraint("regex", r"[0-9]{4}").grammar()
    a = cache.matcher(digits, tok)
    b = cache.matcher(digits, tok)
    assert (cache.misses, cache.hits, len(cache)) == (1, 1, 1)
    one = engine.codec.encode("1")[-1]
    assert a.consume_token(one) and a.validate_tokens([one] * 4) == 3  # a advanced ...
    assert b.validate_tokens([one] * 4) == 4  # ... b did not
    assert cache.matcher(digits, tok).validate_tokens([one] * 4) == 4  # nor the cached one


def test_the_bound_holds_and_the_oldest_goes(tok):
    cache = CompiledGrammars(maxsize=2)
    grammars = [Constraint("regex", f"[a-z]{{{n}}}").grammar() for n in (1, 2, 3)]
    for g in grammars:
        cache.matcher(g, tok)
    cache.matcher(grammars[1], tok)  # used again: the newest
    cache.matcher(grammars[2], tok)
    assert (len(cache), cache.misses, cache.hits) == (2, 3, 2)
    cache.matcher(grammars[0], tok)  # evicted: compiled again, evicting the least recently used
    assert (len(cache), cache.misses) == (2, 4)
    cache.matcher(grammars[2], tok)
    assert cache.hits == 3
    cache.matcher(grammars[1], tok)
    assert cache.misses == 5


def test_a_grammar_that_does_not_compile_is_refused_and_not_kept(tok):
    cache = CompiledGrammars(maxsize=2)
    for _ in range(2):
        with pytest.raises(ConstraintError):
            cache.matcher('start: "a" undefined_rule', tok)
    assert (len(cache), cache.misses) == (0, 2)


def test_a_request_compiles_its_constraint_once(engine):
    """Checked, the verifier's session and the loop's guide: one compile; the same schema again: none."""
    c = Constraint("json_schema", {"type": "object", "properties": {"q": {"type": "integer"}}, "required": ["q"]})
    prompt = engine.codec.encode(PROMPTS[0])
    before = (constraints.COMPILED.misses, constraints.COMPILED.hits)
    first = engine.generate(Request(prompt, max_tokens=16, block_size=4, constraint=c))
    middle = (constraints.COMPILED.misses, constraints.COMPILED.hits)
    assert middle == (before[0] + 1, before[1] + 2)
    again = engine.generate(Request(prompt, max_tokens=16, block_size=4, constraint=c))
    assert (constraints.COMPILED.misses, constraints.COMPILED.hits) == (middle[0], middle[1] + 3)
    assert again.token_ids == first.token_ids
