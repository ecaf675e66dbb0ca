"""The run's prefix handshake against scripted endpoints: who is asked what, in which order, and when it is skipped."""

import pytest

from kakeya.core.request import Request
from kakeya.orchestrator.decode.engine import Engine, RunOptions

from ..orchestrator.test_run import PROMPT, Drafter, DrafterSession, Session, Verifier


class CachingSession(Session):
    def __init__(self, options, log, holds):
        super().__init__(options)
        self.log, self.holds = log, holds

    def prefill_steps(self, prompt, reuse=()):
        chosen = max((p for p in self.holds if reuse is None or p in reuse), default=0)
        if reuse != ():  # a lookup in the prefix cache (the default is a cold prefill)
            self.log.append(("verifier.resume", tuple(prompt), None if reuse is None else tuple(reuse), chosen))
        first, aux = self.prefill(prompt)
        yield from ()
        return first, aux[chosen:], chosen

    def save(self, ids):
        self.log.append(("verifier.save", tuple(ids)))
        return True


class CachingVerifier(Verifier):
    def __init__(self, holds=(2,)):
        super().__init__()
        self.log, self.holds = [], holds

    def open_session(self, policy=None, sampling=None, options=None):
        self.sessions.append(CachingSession(options, self.log, self.holds))
        return self.sessions[-1]


class CachingDrafterSession(DrafterSession):
    def __init__(self, verifier_session, log, offers, lookup_fails):
        super().__init__(verifier_session, None)
        self.log, self.offers, self.lookup_fails = log, offers, lookup_fails

    def cached_prefixes(self, prompt):
        if self.lookup_fails:
            raise ConnectionError("drafter gone")
        self.log.append(("drafter.cached_prefixes", tuple(prompt)))
        return list(self.offers)

    def resume(self, positions):
        self.log.append(("drafter.resume", positions))

    def save(self, ids, unseen):
        self.log.append(("drafter.save", tuple(ids), len(unseen)))
        return True


class CachingDrafter(Drafter):
    def __init__(self, verifier, offers=(2, 1), lookup_fails=False):
        super().__init__(verifier)
        self.offers, self.lookup_fails = offers, lookup_fails

    def open_session(self, sampling=None, options=None):
        v = self.verifier
        self.sessions.append(CachingDrafterSession(v.sessions[-1], v.log, self.offers, self.lookup_fails))
        return self.sessions[-1]


def test_the_drafter_offers_the_verifier_chooses_both_resume_the_same_and_both_save():
    v = CachingVerifier(holds=(1, 2))
    engine = Engine(v, CachingDrafter(v, offers=(1,)), codec=None, prefix_cache=True)
    gen = engine.generate(Request(list(PROMPT), max_tokens=10, block_size=4))
    assert gen.cached_tokens == 1
    ids = tuple(PROMPT + gen.token_ids[:-1])
    assert v.log[:3] == [
        ("drafter.cached_prefixes", tuple(PROMPT)),
        ("verifier.resume", tuple(PROMPT), (1,), 1),
        ("drafter.resume", 1),
    ]
    assert v.log[3] == ("verifier.save", ids) and v.log[4][:2] == ("drafter.save", ids)


def test_without_a_drafter_session_the_verifier_resumes_any_it_holds_and_saves_alone():
    v = CachingVerifier(holds=(2,))
    engine = Engine(v, CachingDrafter(v), codec=None, prefix_cache=True)
    gen = engine.generate(Request(list(PROMPT), max_tokens=5, block_size=1))
    assert gen.cached_tokens == 2
    assert [e[0] for e in v.log] == ["verifier.resume", "verifier.save"] and v.log[0][2] is None


def test_a_failing_lookup_runs_cold_with_the_fallback_and_fails_the_run_without_it():
    v = CachingVerifier(holds=(2,))
    engine = Engine(v, CachingDrafter(v, lookup_fails=True), codec=None, prefix_cache=True)
    gen = engine.generate(Request(list(PROMPT), max_tokens=5, block_size=4), RunOptions(drafter_fallback=True))
    assert gen.cached_tokens == 0 and v.log[0] == ("verifier.resume", tuple(PROMPT), (), 0)
    with pytest.raises(ConnectionError):
        engine.generate(Request(list(PROMPT), max_tokens=5, block_size=4))


def test_nothing_is_asked_or_saved_without_a_prefix_cache_or_after_an_abort():
    v = CachingVerifier()
    Engine(v, CachingDrafter(v), codec=None).generate(Request(list(PROMPT), max_tokens=5, block_size=4))
    assert v.log == []
    engine = Engine(v, CachingDrafter(v), codec=None, prefix_cache=True)
    with engine.start(Request(list(PROMPT), max_tokens=50, block_size=4)) as run:
        next(run)
    assert [e[0] for e in v.log] == ["drafter.cached_prefixes", "verifier.resume", "drafter.resume"]
