"""Constrained sampling inside the speculative loop is constrained AR sampling.

The coupled rule with a seed gives constrained AR sampling's tokens with that seed, whatever the blocks
(demo pair). On a vocab-48 random pair with a one-character-per-token tokenizer, the first three tokens
under a regex are drawn by speculative sampling (either rule, block size 4, a random drafter that mostly
proposes tokens the grammar refuses) and tested with Pearson's chi-square against the enumerated
distribution: p from the target's own logits with every token the regex refuses at -inf (the allowed sets
written out by hand here, not taken from the grammar library), processed by transformers' warpers. The same
test must reject a deliberately broken mask (each row's first allowed token dropped), so it has the power
to catch a wrong restriction.
"""

from __future__ import annotations

import collections
import string
from dataclasses import replace

import numpy as np
import pytest
import torch

from kakeya.core import constraints as grammar_module
from kakeya.core.constraints import Constraint
from kakeya.core.contract import SessionOptions
from kakeya.core.request import COUPLED, SAMPLING_RULES, Request, SamplingParams

from ..sampling.hf_reference import hf_process
from ..sampling.test_statistical import chi_square, decode_together
from .cases import PROMPTS, assert_matches, constraints

ALPHA = 1e-3
N_EXACT, N_BROKEN = 1200, 400
CHARS = string.ascii_lowercase + string.digits + ' {}:,"-'
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
REGEX = "[a-f][0-9][x-z]"
ALLOWED = ["abcdef", "0123456789", "xyz"]  # what REGEX allows at each of its positions, one char a token
PROMPT = [2, 10, 20]
PARAMS = SamplingParams(2.0)  # flat enough that the random drafter's guesses are often refused or rejected


@pytest.mark.parametrize("name", ["person", "phone", "choice"])
def test_coupled_seed_gives_constrained_ar_samplings_tokens(engine, name):
    c = constraints()[name]
    prompt = engine.codec.encode(PROMPTS[0])
    for seed in (1, 2):
        sp = SamplingParams(temperature=0.9, seed=seed, rule=COUPLED)
        ar = engine.generate(Request(prompt, max_tokens=64, block_size=1, sampling=sp, constraint=c))
        for b in (4, 8):
            got = engine.generate(Request(prompt, max_tokens=64, block_size=b, sampling=sp, constraint=c))
            assert got.token_ids == ar.token_ids, (name, seed, b)
        if ar.token_ids[-1] in engine.verifier.info.eos_token_ids:
            assert_matches(name, c, engine.codec.decode(ar.token_ids[:-1]))


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A vocab-48 random pair whose tokenizer maps one character to one token; its verifier and drafter."""
    from tokenizers import Tokenizer, decoders, models

    from kakeya.checkpoints.config import load_draft_config
    from kakeya.checkpoints.tiny import make_tiny
    from kakeya.drafter.loader import local_drafter
    from kakeya.verifier.loader import local_verifier

    pair = make_tiny(tmp_path_factory.mktemp("small_constrained"), vocab_size=len(SPECIALS) + len(CHARS))
    tok = Tokenizer(
        models.BPE(vocab={t: i for i, t in enumerate(SPECIALS + list(CHARS))}, merges=[], unk_token="<unk>")
    )
    tok.add_special_tokens(SPECIALS)
    tok.decoder = decoders.ByteFallback()
    tok.save(str(pair.target / "tokenizer.json"))
    torch.set_num_threads(1)
    layers = load_draft_config(pair.draft)["dflash_config"]["target_layer_ids"]
    verifier = local_verifier(str(pair.target), layers, "torch")
    assert verifier.constrains
    return verifier, local_drafter(str(pair.draft), str(pair.target), "torch")


def _masked_p(verifier, prefix, allowed: str) -> np.ndarray:
    s = verifier.open_session()
    logits = verifier.target.logits(s._forward(prefix).hidden)[0, -1].float().numpy().copy()
    s.close()
    keep = np.zeros(logits.shape, bool)
    keep[[len(SPECIALS) + CHARS.index(ch) for ch in allowed]] = True
    logits[~keep] = -np.inf
    return hf_process(logits, PARAMS)


def exact_distribution(verifier) -> dict[tuple[int, ...], float]:
    out = {(): 1.0}
    for allowed in ALLOWED:
        nxt = {}
        for prefix, mass in out.items():
            p = _masked_p(verifier, PROMPT + list(prefix), allowed)
            for t in np.flatnonzero(p):
                nxt[prefix + (int(t),)] = mass * p[t]
        out = nxt
    return out


def speculative_counts(verifier, drafter, params, seeds) -> collections.Counter:
    """One seeded generation per seed (its own sessions), decoded side by side in batches (``decode_together``)."""
    options = SessionOptions(constraint=Constraint("regex", REGEX))
    sessions = ((seed, replace(params, seed=seed)) for seed in seeds)
    starts = (
        (verifier.open_session(sampling=sp, options=options), drafter.open_session(sampling=sp), PROMPT, 3 + seed % 2)
        for seed, sp in sessions
    )
    return collections.Counter(tuple(gen.token_ids[:3]) for gen in decode_together(verifier, drafter, starts, 4))


@pytest.mark.parametrize("rule", SAMPLING_RULES)
def test_constrained_sampling_is_exact_and_a_broken_mask_is_caught(small, rule, monkeypatch):
    verifier, drafter = small
    params = replace(PARAMS, rule=rule)
    dist = exact_distribution(verifier)
    assert abs(sum(dist.values()) - 1) < 1e-9
    counts = speculative_counts(verifier, drafter, params, range(N_EXACT))
    stat, df, pval = chi_square(counts, dist, N_EXACT)
    assert df >= 5, "too few cells to test anything"
    assert pval > ALPHA, f"constrained speculative samples differ from constrained AR: chi2={stat:.1f} df={df}"

    exact = grammar_module.Grammar.bitmask

    def broken(self, candidates):  # each row loses its first allowed token: a wrong restriction
        rows = exact(self, candidates)
        for row, allowed in zip(rows, grammar_module.unpack(rows, self.vocab)):
            on = np.flatnonzero(allowed)
            if len(on) > 1:
                row.view(np.uint32)[on[0] // 32] &= ~np.uint32(1 << int(on[0] % 32))
        return rows

    monkeypatch.setattr(grammar_module.Grammar, "bitmask", broken)
    counts = speculative_counts(verifier, drafter, params, range(N_EXACT, N_EXACT + N_BROKEN))
    stat, df, pval = chi_square(counts, dist, N_BROKEN)
    assert pval < ALPHA, f"the test did not catch a broken mask: chi2={stat:.1f}, df={df}, p={pval:.2g}"
