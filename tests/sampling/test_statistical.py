"""Speculative sampling, under either rule, is distributed exactly as AR sampling from p: a
chi-square test that fails when the sampler is wrong.

On the vocab-48 pair, the exact distribution of the first three generated tokens under AR sampling from the
processed p is enumerated with the model (no sampling), p computed by transformers' own logits warpers
(``hf_reference.py``), not by the code under test. Then N independent seeded speculative generations (block
size 4, the random drafter disagreeing most of the time) are drawn in-process, side by side in batches of 200
(each its own sessions and seed), and their first three tokens tested against it: Pearson's chi-square, cells
with expected count < 5 pooled, at ALPHA = 1e-3. The same test must reject a deliberately broken rule (every
candidate accepted, i.e. the drafter's distribution), so it has the power to catch a wrong sampler.
Half the generations stop at 3 tokens (a block of 2: the bonus draw decides
token 3), half at 4 (a block of 3: two acceptance tests, residuals at either).
Under the coupled rule each seed's tokens are fixed by its noise: over the
seeds they must still be distributed as p.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import replace

import numpy as np
import pytest
import torch

from kakeya.core import sampling as lossless
from kakeya.core.request import COUPLED, SAMPLING_RULES
from kakeya.orchestrator.decode import loop
from kakeya.verifier import session as verifier_session

from .conftest import BACKENDS, PROMPT, SETTINGS
from .hf_reference import hf_process

ALPHA = 1e-3
N_EXACT = 1200  # generations tested against the exact distribution
N_BROKEN = 400  # generations of the broken rule (it is far off: fewer suffice)
TOKENS = 3


def next_distribution(verifier, prefix, params) -> np.ndarray:
    """The processed p after ``prefix`` (transformers' warpers on the backend's own logits)."""
    s = verifier.open_session()
    out = s._forward(prefix)
    logits = verifier.target.logits(out.hidden)[0, -1]
    s.close()
    logits = logits.float().cpu().numpy() if isinstance(logits, torch.Tensor) else np.asarray(logits, np.float32)
    return hf_process(logits, params)


def exact_distribution(verifier, params) -> dict[tuple[int, ...], float]:
    """P(first TOKENS tokens) under AR sampling, enumerated over p's support."""
    out = {(): 1.0}
    for _ in range(TOKENS):
        nxt = {}
        for prefix, mass in out.items():
            p = next_distribution(verifier, PROMPT + list(prefix), params)
            for t in np.flatnonzero(p):
                nxt[prefix + (int(t),)] = mass * p[t]
        out = nxt
    return out


def decode_together(verifier, drafter, starts: Iterable[tuple], block_size: int, chunk: int = 200) -> Iterator:
    """The generations of ``starts`` (each ``(verifier session, drafter session, prompt ids, max tokens)``), in
    order, decoded side by side ``chunk`` at a time: every round drafts and verifies the chunk's blocks through the
    engine's own batch calls (``draft_batch`` / ``decide_batch``, what a server runs for concurrent streams), each
    session with its own seed, rule and caches, and the chunk's prompts run as one forward (``prefill_together``).
    Thousands of short generations then pay the small model's per-op cost once per round, not once per generation
    (a third of the time, and the batched prompts halved what was left); each is still one independent draw, its
    first token drawn by its own prefill and its blocks kept by the same acceptance code (``choose``, ``accept``,
    ``assemble``) as a generation decoded alone."""
    starts = iter(starts)
    while group := list(itertools.islice(starts, chunk)):
        decodes: list[loop.Decode] = []
        prefill_together(verifier, [(vs, prompt) for vs, _, prompt, _ in group])
        for vs, ds, prompt, max_tokens in group:
            decode = loop.Decode(vs, ds, prompt, loop.DecodeOptions(max_tokens, block_size))
            first, aux = vs.prefill(prompt)  # its own prefill: the forward above, then its first token drawn
            del vs._forward
            decode.prefilled(first, aux, 0.0)
            decodes.append(decode)
        while not all(d.done for d in decodes):
            loop.advance(decodes, drafter.draft_batch, verifier.decide_batch)
        for decode in decodes:
            if decode.error is not None:
                raise decode.error
            decode.verifier.close()
            decode.drafter.close()
            yield decode.generation


def prefill_together(verifier, sessions: list[tuple]) -> None:
    """The prompts' forwards of ``sessions`` (each ``(verifier session, prompt ids)``, none prefilled yet) run as one
    batched forward of the target (the call ``verify_batch`` makes for a round's blocks), and each session's next
    ``_forward`` of its prompt returns its row of it. Its ``prefill`` then runs as ever (its own code draws the
    first token from those logits with its own seed and rule), so a generation is still one independent draw, but
    the small model's per-op cost is paid once per chunk, not once per generation: the prompts' forwards one by
    one were ~55% (MLX) and ~70% (torch) of these tests' time. The caller deletes each ``_forward`` after."""
    planned = [(vs, vs.forward_plan(prompt)) for vs, prompt in sessions]
    outs = verifier.target.forward([segment for _, segment in planned])
    for (vs, segment), out in zip(planned, outs):

        def forward(ids, vs=vs, segment=segment, out=out):
            assert list(ids) == list(segment.ids), "a prompt's forward other than the planned one"
            vs.forward_done(segment, out)
            return out

        vs._forward = forward


def speculative_counts(verifier, drafter, params, seeds) -> collections.Counter:
    """One seeded generation per seed (its own sessions), decoded side by side in batches (``decode_together``)."""
    sessions = ((seed, replace(params, seed=seed)) for seed in seeds)
    starts = (
        (verifier.open_session(sampling=sp), drafter.open_session(sampling=sp), PROMPT, TOKENS + seed % 2)
        for seed, sp in sessions
    )
    gens = decode_together(verifier, drafter, starts, 4)
    return collections.Counter(tuple(gen.token_ids[:TOKENS]) for gen in gens)


def chi_square(counts: collections.Counter, dist: dict, n: int) -> tuple[float, int, float]:
    """(statistic, degrees of freedom, p-value); sequences outside ``dist`` land in the pooled cell."""
    cells = sorted(dist, key=dist.get)
    pooled, i = 0.0, 0
    while i < len(cells) and (dist[cells[i]] * n < 5 or pooled * n < 5):
        pooled += dist[cells[i]]
        i += 1
    kept = cells[i:]
    observed = [counts[c] for c in kept]
    expected = [dist[c] * n for c in kept]
    observed.append(n - sum(observed))  # the pooled cell, with every impossible sequence seen
    expected.append(n - sum(expected))
    o, e = np.array(observed, float), np.array(expected, float)
    stat = float(((o - e) ** 2 / e).sum())
    return stat, len(o) - 1, chi_square_p(o, e)


def chi_square_p(observed, expected) -> float:
    """Pearson's chi-square p-value of ``observed`` counts against ``expected`` ones (same total)."""
    o, e = np.asarray(observed, float), np.asarray(expected, float)
    stat, df = float(((o - e) ** 2 / e).sum()), len(o) - 1
    return float(
        torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64))
    )


@pytest.mark.parametrize("rule", SAMPLING_RULES)
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_speculative_sampling_is_exact_and_a_broken_rule_is_caught(backend, setting, rule, small_models, monkeypatch):
    verifier, drafter = small_models[backend]
    params = replace(SETTINGS[setting], rule=rule)
    dist = exact_distribution(verifier, params)
    assert abs(sum(dist.values()) - 1) < 1e-9

    counts = speculative_counts(verifier, drafter, params, range(N_EXACT))
    stat, df, pval = chi_square(counts, dist, N_EXACT)
    print(f"\n{backend} {setting} {rule}: exact rule chi2={stat:.1f} df={df} p={pval:.3g}", end="")
    assert df >= 5, "too few cells to test anything"
    assert pval > ALPHA, f"speculative samples differ from AR sampling: chi2={stat:.1f}, df={df}, p={pval:.2g}"

    if rule == COUPLED:  # the verifier session's acceptance keeps every candidate, whatever it chose
        monkeypatch.setattr(
            verifier_session, "accept", lambda candidates, choices: (len(candidates), int(choices[len(candidates)]))
        )
    else:  # the verifier sessions call it through the module: patch it to accept everything
        exact = lossless.assemble
        monkeypatch.setattr(
            lossless, "assemble", lambda cands, accepted, samples: exact(cands, [True] * len(cands), samples)
        )
    counts = speculative_counts(verifier, drafter, params, range(N_EXACT, N_EXACT + N_BROKEN))
    stat, df, pval = chi_square(counts, dist, N_BROKEN)
    print(f"; always-accept chi2={stat:.1f} df={df} p={pval:.3g}", end="")
    assert pval < ALPHA, f"the test did not catch an always-accept rule: chi2={stat:.1f}, df={df}, p={pval:.2g}"
