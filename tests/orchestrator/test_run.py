"""The one request path: ``Engine.start`` -> ``Run``, against scripted verifier/drafter endpoints (no model)."""

import dataclasses
import threading
import time

import pytest

from kakeya.core.contract import Cancellation, KVBytes, ModelInfo, SessionOptions, VerifierStats
from kakeya.core.request import CachePolicy, Request
from kakeya.orchestrator.decode.block_sizing import AdaptivePolicy, CostCurve
from kakeya.orchestrator.decode.engine import Engine, RunOptions
from kakeya.orchestrator.decode.loop import one_by_one_drafts, one_by_one_verdicts
from kakeya.runtime.compute import ComputeThread

from .test_loop import CONT, ScriptedDrafter, ScriptedVerifier

PROMPT = [1, 2, 3]


class Session(ScriptedVerifier):
    """A scripted verifier session that remembers how it was opened and whether it was closed or aborted."""

    def __init__(self, options: SessionOptions, fail_verify_at: int | None = None):
        super().__init__(len(PROMPT), CONT)
        self.options, self.fail_verify_at = options, fail_verify_at
        self.closed = self.aborted = False
        self.verifies = 0
        if options.cancel is not None:  # as a remote session does
            options.cancel.on_cancel(self.abort)

    def decide(self, last, draft):
        self.verifies += 1
        if self.verifies == self.fail_verify_at:
            raise ConnectionError("verifier gone")
        return super().decide(last, draft)

    def stats(self):
        return VerifierStats(kv_bytes=KVBytes(sliding=7, full=self.pos))

    def close(self):
        self.closed = True

    def abort(self):
        self.aborted = True


class Verifier:
    """The ``Verifier`` protocol over scripted sessions."""

    def __init__(self, fail_verify_at: int | None = None):
        self.info = ModelInfo("scripted", 1024, (), 8, 2, 32, "scripted")
        self.aux_layers = (0,)
        self.policy = CachePolicy()
        self.fail_verify_at = fail_verify_at
        self.sessions: list[Session] = []

    def open_session(self, policy=None, sampling=None, options=None):
        self.sessions.append(Session(options or SessionOptions(), self.fail_verify_at))
        return self.sessions[-1]

    def healthy(self, timeout=1.0):
        return True

    decide_batch = staticmethod(one_by_one_verdicts)


class DrafterSession(ScriptedDrafter):
    def __init__(self, verifier_session, dies_at: int | None):
        super().__init__(verifier_session, wrong_every=None)
        self.dies_at, self.closed = dies_at, False

    def draft(self, new_aux, last, B):
        if self.calls + 1 == self.dies_at:
            raise ConnectionError("drafter gone")
        return super().draft(new_aux, last, B)

    def close(self):
        self.closed = True


class Drafter:
    block_size, target_layer_ids, backend = 8, (0,), "scripted"

    def __init__(self, verifier: Verifier, dies_at: int | None = None):
        self.verifier, self.dies_at = verifier, dies_at
        self.sessions: list[DrafterSession] = []

    def open_session(self, sampling=None, options=None):
        self.sessions.append(DrafterSession(self.verifier.sessions[-1], self.dies_at))
        return self.sessions[-1]

    def status(self):
        return {}

    draft_batch = staticmethod(one_by_one_drafts)


class Codec:
    """Token t reads as "<t>"."""

    def decode(self, ids):
        return "".join(f"<{t}>" for t in ids)


def _engine(fail_verify_at=None, dies_at=None, codec=None) -> Engine:
    v = Verifier(fail_verify_at)
    return Engine(v, Drafter(v, dies_at), codec=codec)


def _sessions(engine):
    return engine.verifier.sessions[-1], engine.drafter.sessions[-1]


def test_a_checked_request_is_its_own_type_and_a_run_is_cheap_until_it_begins():
    """Engine.check makes a CheckedRequest (ids, defaults filled in); a Run takes only that, opens nothing when
    made, and begins (sessions, prefill) as an explicit step; an unbegun run closes without model work."""
    from kakeya.core.request import CheckedRequest
    from kakeya.orchestrator.decode.engine import Run

    engine = _engine()
    req = Request(PROMPT, max_tokens=8, block_size=4)
    assert not hasattr(req, "prompt_ids")  # an unchecked request has no ids to read
    checked = engine.check(req)
    assert isinstance(checked, CheckedRequest) and checked.prompt_ids == list(PROMPT) and checked.request_id
    with pytest.raises(TypeError, match="CheckedRequest"):
        Run(engine, req, RunOptions())
    run = Run(engine, checked, RunOptions())
    assert engine.verifier.sessions == [] and engine.drafter.sessions == []  # nothing opened, nothing prefilled
    with pytest.raises(RuntimeError, match="begin"):
        next(run)
    run.close()
    assert run.result.finish_reason == "abort" and run.result.token_ids == [] and engine.verifier.sessions == []
    run = Run(engine, checked, RunOptions())
    run.begin()
    vs, ds = _sessions(engine)
    assert vs.options.max_positions == len(PROMPT) + 8
    with pytest.raises(RuntimeError, match="begun already"):
        run.begin()
    assert [t for b in run for t in b.tokens] == CONT[:8] and vs.closed and ds.closed


def test_a_run_yields_its_blocks_then_its_result_and_closes_both_sessions():
    engine = _engine()
    run = engine.start(Request(PROMPT, max_tokens=20, block_size=4, request_id="r1"))
    vs, ds = _sessions(engine)
    assert vs.options.request_id == "r1" and vs.options.max_positions == len(PROMPT) + 20
    blocks = []
    for block in run:
        with pytest.raises(RuntimeError, match="not over"):
            run.result  # noqa: B018 - a result only once the run is over
        blocks.append(block)
    gen = run.result
    assert [t for b in blocks for t in b.tokens] == gen.token_ids == CONT[:20]
    assert gen.finish_reason == "length" and gen.verifier_stats.kv_bytes.full == 19
    assert vs.closed and ds.closed and not vs.aborted
    assert list(run) == []  # over: nothing more, nothing reopened


def test_closing_early_keeps_what_was_committed_and_frees_the_sessions():
    engine = _engine()
    with engine.start(Request(PROMPT, max_tokens=50, block_size=4)) as run:
        first, second = next(run), next(run)
    vs, ds = _sessions(engine)
    gen = run.result
    assert gen.finish_reason == "abort" and gen.token_ids == first.tokens + second.tokens
    assert gen.verifier_stats.kv_bytes.sliding == 7  # what the cache held when it ended
    assert vs.closed and ds.closed


def test_a_stop_string_cuts_the_block_that_completed_it_and_ends_the_run():
    engine = _engine(codec=Codec())
    stop = f"<{CONT[2]}"  # completed by the second block's second token (102); the text ends before it
    run = engine.start(Request(PROMPT, max_tokens=50, block_size=4, stop_strings=(stop,)))
    first, second = next(run), next(run)
    assert first.tokens == CONT[:1] and second.tokens == CONT[1:3] and list(run) == []
    gen = run.result
    assert gen.finish_reason == "stop" and gen.token_ids == CONT[:3] and gen.acceptance_lengths == [2]
    assert first.text + second.text == run.report().text == f"<{CONT[0]}><{CONT[1]}>"
    assert _sessions(engine)[0].closed


def test_a_stop_string_found_while_another_requests_round_runs_keeps_no_token_after_it():
    """Found by a batch of HTTP requests: a stop string ends run A while request B's round, which A is part of, is in
    flight; that round's block (and, under load, every later round's) was added to A after A was cut, so its usage
    and token ids counted tokens past the stop that it had not alone."""
    engine = _engine(codec=Codec())
    stop = f"<{CONT[2]}"  # completed in A's first round block (CONT[1:5]): A keeps CONT[:3], as alone
    a = engine.start(Request(PROMPT, max_tokens=50, block_size=4, stop_strings=(stop,)))
    b = engine.start(Request(PROMPT, max_tokens=50, block_size=4))
    next(a), next(b)  # both prefilled and joined
    next(b)  # B drives a round with A in it: A's stop block waits in A's queue
    in_round, a_leaving = threading.Event(), threading.Event()
    scheduler = engine.scheduler(RunOptions().step)  # the one both runs share
    draft_many, leave = scheduler._draft_many, scheduler.leave

    def drafting(items):  # B's next round (A still in it) waits until A's run is leaving the scheduler
        in_round.set()
        assert a_leaving.wait(10)
        return draft_many(items)

    def leaving(decode):
        a_leaving.set()
        leave(decode)

    scheduler._draft_many, scheduler.leave = drafting, leaving
    driver = threading.Thread(target=next, args=(b,))
    driver.start()
    assert in_round.wait(10)
    assert next(a).tokens == CONT[1:3] and list(a) == []
    driver.join(10)
    b.close()
    gen = a.result
    assert gen.finish_reason == "stop" and gen.token_ids == CONT[:3] and a.report().token_ids == tuple(CONT[:3])


@pytest.fixture(scope="module")
def demo_engine(demo_pair):
    from kakeya.orchestrator.assembly import build_local_engine

    return build_local_engine(demo_pair.target, demo_pair.draft, "torch", "cpu")


@pytest.mark.parametrize("end", ["length", "stop token", "stop string"])
def test_a_resume_holding_the_whole_generation_gets_its_end_and_no_block(demo_engine, end):
    """A stream that broke after its last token, before its Complete: resumed with every token, the run streams
    nothing again and ends as the uninterrupted one did (its finish reason, every token counted). Tokens past
    that end are no stream this request could have sent: refused naming the field."""
    base = Request("def fibonacci(n):", max_tokens=24, block_size=8, ignore_eos=True)
    free = demo_engine.generate(base)
    ends = {
        "length": {"max_tokens": 12},
        "stop token": {"stop_ids": (free.token_ids[9],)},
        "stop string": {"stop_strings": (demo_engine.codec.decode(free.token_ids[7:10]).strip()[-3:],)},
    }
    req = dataclasses.replace(base, **ends[end])
    whole = demo_engine.generate(req)
    assert whole.finish_reason == ("length" if end == "length" else "stop") and len(whole.token_ids) <= 12
    run = demo_engine.start(dataclasses.replace(req, resume_ids=tuple(whole.token_ids)))
    assert list(run) == []
    assert (run.result.token_ids, run.result.finish_reason) == (whole.token_ids, whole.finish_reason)
    with pytest.raises(ValueError, match="resume_token_ids"):
        demo_engine.start(dataclasses.replace(req, resume_ids=(*whole.token_ids, free.token_ids[0])))


def test_a_resumed_runs_decode_speed_counts_only_the_tokens_it_decoded(demo_engine):
    """``decode_tok_s`` (gRPC SpecStats, HTTP, the CLI) is this run's speed: the tokens a client resumed with were
    decoded by another run, so a resume holding the whole generation decoded none (it reported millions a second)."""
    req = Request("def fibonacci(n):", max_tokens=20, block_size=8, ignore_eos=True)
    whole = demo_engine.generate(req)
    with demo_engine.start(dataclasses.replace(req, resume_ids=tuple(whole.token_ids))) as run:
        list(run)
        assert run.report().decode_tok_s == 0.0
    with demo_engine.start(dataclasses.replace(req, resume_ids=tuple(whole.token_ids[:12]))) as run:
        list(run)
        report = run.report()
    assert report.decode_s > 0 and report.decode_tok_s == pytest.approx(8 / report.decode_s)


def test_a_resume_ending_in_a_stop_token_adds_none_of_its_text(demo_engine):
    """A stop token's text is never output (as vLLM's), also when it ends a resumed stream's tokens: here that
    text begins a stop string, so a text stream fed the stop token would hold it back and flush it at the end.
    What the resumed run adds is exactly the text the broken stream still owed (held back until its end)."""
    base = Request("def fibonacci(n):", max_tokens=24, block_size=8, ignore_eos=True)
    stop = demo_engine.generate(base).token_ids[9]
    req = dataclasses.replace(base, stop_ids=(stop,), stop_strings=(demo_engine.codec.decode([stop]) + "\x00",))
    with demo_engine.start(req) as run:
        streamed = "".join(block.text for block in run)  # what a stream broken before its Complete had sent
        whole = run.report()
    assert whole.finish_reason == "stop" and whole.token_ids[-1] == stop
    run = demo_engine.start(dataclasses.replace(req, resume_ids=whole.token_ids))
    assert list(run) == [] and run.result.finish_reason == "stop"
    assert streamed + run.report().text == whole.text


def test_a_stream_broken_after_any_block_and_resumed_gets_exactly_the_text_it_was_owed(demo_engine):
    """Text held back at a stop string's possible start (here any text ending in a space) is owed, not lost:
    whichever block the stream broke after, what it had sent and what the resumed run sends make the whole text."""
    req = Request("def fibonacci(n):", max_tokens=40, block_size=4, ignore_eos=True, stop_strings=(" \x00",))
    with demo_engine.start(req) as run:
        sent = [(block.text, len(block.tokens)) for block in run]
        whole = run.report()
    assert whole.text == demo_engine.codec.decode(whole.token_ids) and len(sent) > 3
    for k in range(1, len(sent)):
        had = sum(n for _, n in sent[:k])
        with demo_engine.start(dataclasses.replace(req, resume_ids=whole.token_ids[:had])) as run:
            list(run)
            assert "".join(t for t, _ in sent[:k]) + run.report().text == whole.text, k  # the blocks' and the end's


def test_cancel_from_another_thread_aborts_remote_streams_and_ends_the_iteration():
    engine = _engine()
    run = engine.start(Request(PROMPT, max_tokens=200, block_size=4))
    next(run)
    canceller = threading.Thread(target=run.cancel)  # say, a gRPC cancel callback
    canceller.start()
    canceller.join()
    vs, ds = _sessions(engine)
    assert run.cancelled and vs.aborted and not vs.closed  # the stream ends at once, the session at the next step
    assert list(run) == [] and run.result.finish_reason == "abort"
    assert vs.closed and ds.closed
    assert run.result.verifier_stats == VerifierStats()  # a cancelled run asks its backends nothing more


def test_a_failing_verifier_ends_the_run_with_the_error_after_closing_the_sessions():
    engine = _engine(fail_verify_at=3)
    run = engine.start(Request(PROMPT, max_tokens=50, block_size=4))
    with pytest.raises(ConnectionError):
        for _ in run:
            pass
    vs, ds = _sessions(engine)
    assert run.result.finish_reason == "error" and len(run.result.blocks) == 3  # the prefill's and two more
    assert vs.closed and ds.closed and run.result.verifier_stats == VerifierStats()


def test_a_failing_drafter_fails_the_run_unless_the_front_asks_for_the_fallback():
    with pytest.raises(ConnectionError, match="drafter gone"):
        _engine(dies_at=3).generate(Request(PROMPT, max_tokens=40, block_size=4))
    gen = _engine(dies_at=3).generate(Request(PROMPT, max_tokens=40, block_size=4), RunOptions(drafter_fallback=True))
    assert gen.token_ids == CONT[:40] and gen.drafter_fallback and gen.finish_reason == "length"


def test_auto_stays_within_the_requests_largest_block_and_learns_only_from_finished_runs():
    engine = _engine()
    engine.adaptive = AdaptivePolicy(CostCurve({1: 1.0, 16: 1.1}))  # cost flat in the size: the longest block wins
    gen = engine.generate(Request(PROMPT, max_tokens=60, block_size=0, max_block_size=4))
    assert gen.token_ids == CONT[:60] and max(b.drafted + 1 for b in gen.blocks[1:]) == 4
    learnt = sum(engine.adaptive.chain.reached)
    assert learnt > 0
    with engine.start(Request(PROMPT, max_tokens=60, block_size=0)) as run:
        next(run), next(run)
    assert sum(engine.adaptive.chain.reached) == learnt  # closed early: nothing learnt
    with pytest.raises(ValueError, match="max_block_size"):
        engine.start(Request(PROMPT, block_size=0, max_block_size=17))


def test_model_work_runs_through_the_fronts_step():
    engine, calls = _engine(), []

    def step(fn, *args):
        calls.append(getattr(fn, "__name__", ""))
        return fn(*args)

    engine.generate(Request(PROMPT, max_tokens=9, block_size=4), RunOptions(step=step))
    # One job to begin (size, open, the short prompt's whole prefill), one per round, one to finish: on a busy
    # engine every job waits for the round in flight, so a newcomer's first token waits for one round, not one
    # per call it makes.
    assert calls == ["_begin", "_advance", "_advance", "_finish"]  # two blocks of 4 after the prefill's token


def test_work_queued_during_a_rounds_draft_runs_before_its_verify():
    engine, calls = _engine(), []

    def step(fn, *args):
        calls.append(getattr(fn, "__name__", ""))
        return fn(*args)

    # as if another request's job had been queued for the model thread during every draft: each round's verify
    # becomes a job of its own, so that job runs after the draft instead of after the whole round
    gen = engine.generate(Request(PROMPT, max_tokens=9, block_size=4), RunOptions(step=step, queued=lambda: 1))
    assert gen.token_ids == CONT[:9]
    assert calls == ["_begin", *["_advance", "verify_round"] * 2, "_finish"]


def test_a_job_queued_on_the_model_thread_during_a_draft_runs_before_that_rounds_verify():
    """A colocated server's shape: rounds on a ComputeThread; a job another request queues while a round drafts
    (a newcomer's prefill) runs between the round's draft and its verify, not after the whole round."""
    compute, engine, order = ComputeThread("test"), _engine(), []
    draft_many, decide_many = engine.drafter.draft_batch, engine.verifier.decide_batch

    def drafting(items):
        order.append("draft")
        if order.count("draft") == 1:
            compute.submit(order.append, "queued job")
        return draft_many(items)

    def deciding(items):
        order.append("verify")
        return decide_many(items)

    engine.drafter.draft_batch, engine.verifier.decide_batch = drafting, deciding
    try:
        options = RunOptions(step=compute.run, queued=lambda: compute.queued)
        gen = engine.generate(Request(PROMPT, max_tokens=9, block_size=4), options)
    finally:
        compute.shutdown()
    assert gen.token_ids == CONT[:9]
    assert order == ["draft", "queued job", "verify", "draft", "verify"]


def test_a_long_prompt_prefills_one_chunk_per_job(monkeypatch):
    engine, calls = _engine(), []
    chunked = ScriptedVerifier.prefill_steps

    def three_chunks(session, prompt, reuse=()):  # as the verifier chunks a long prompt: a yield between chunks
        yield 1
        yield 2
        return (yield from chunked(session, prompt, reuse))

    def step(fn, *args):
        calls.append(getattr(fn, "__name__", ""))
        return fn(*args)

    monkeypatch.setattr(Session, "prefill_steps", three_chunks)
    gen = engine.generate(Request(PROMPT, max_tokens=9, block_size=4), RunOptions(step=step))
    assert gen.token_ids == CONT[:9]
    # the first chunk in the job that begins, each later one a job of its own (rounds of others run between)
    assert calls == ["_begin", "_chunk", "_chunk", "_advance", "_advance", "_finish"]


def test_a_cancellation_runs_each_hook_once_and_late_ones_at_once():
    c, seen = Cancellation(), []
    c.on_cancel(lambda: seen.append("early"))
    c.cancel()
    c.cancel()
    c.on_cancel(lambda: seen.append("late"))
    assert seen == ["early", "late"] and c.cancelled


def _newcomer_engine(prefill):
    """An engine whose second verifier session prefills through ``prefill(plain_steps)`` (a generator)."""
    engine = _engine()
    open_session = engine.verifier.open_session

    def opening(*args, **kwargs):
        session = open_session(*args, **kwargs)
        if len(engine.verifier.sessions) == 2:
            plain = session.prefill_steps
            session.prefill_steps = lambda prompt, reuse=(): prefill(plain(prompt, reuse))
        return session

    engine.verifier.open_session = opening
    return engine


def test_without_a_model_thread_a_round_verifies_after_the_prefill_of_a_request_starting_meanwhile():
    """The split's shape (rounds are calls, no model thread to queue on): a request that arrives while a round
    drafts has its prefill run before that round's verify, so its first token does not wait a whole verify."""
    order, entered, threads = [], threading.Event(), []

    def slow_prefill(steps):
        entered.set()
        time.sleep(0.02)  # the round's verify would go first without the wait
        order.append("prefill")
        return (yield from steps)

    engine = _newcomer_engine(slow_prefill)
    draft_many, decide_many = engine.drafter.draft_batch, engine.verifier.decide_batch

    def step(fn, *args):
        return fn(*args)

    def drafting(items):
        order.append("draft")
        if order.count("draft") == 1:  # a newcomer arrives during the first round's draft
            newcomer = Request(PROMPT, max_tokens=4, block_size=4)
            t = threading.Thread(target=engine.generate, args=(newcomer, RunOptions(step=step)))
            t.start()
            threads.append(t)
            assert entered.wait(5)
        return draft_many(items)

    def deciding(items):
        order.append("verify")
        return decide_many(items)

    engine.drafter.draft_batch, engine.verifier.decide_batch = drafting, deciding
    engine.scheduler(step)._round_s = 5.0  # bound the wait by far more than a loaded machine's thread start-up
    gen = engine.generate(Request(PROMPT, max_tokens=9, block_size=4), RunOptions(step=step))
    for t in threads:
        t.join(5)
    assert gen.token_ids == CONT[:9]
    assert order[:3] == ["draft", "prefill", "verify"]
    assert engine.scheduler(step).yields == 1


def test_a_request_stuck_starting_holds_up_one_round_at_most():
    """One whose start waits for something else (a full server's admission queue) costs one round's wait, not
    one per round: the running request finishes while it is still stuck."""
    release, entered, threads = threading.Event(), threading.Event(), []

    def stuck_prefill(steps):
        entered.set()
        release.wait(10)
        return (yield from steps)

    engine = _newcomer_engine(stuck_prefill)

    def step(fn, *args):
        return fn(*args)

    scheduler = engine.scheduler(step)
    with engine.start(Request(PROMPT, max_tokens=13, block_size=4), RunOptions(step=step)) as run:
        newcomer = Request(PROMPT, max_tokens=4, block_size=4)
        t = threading.Thread(target=engine.generate, args=(newcomer, RunOptions(step=step)))
        t.start()
        threads.append(t)
        assert entered.wait(5)
        scheduler._round_s = 0.01
        blocks = list(run)
    try:
        assert [t for b in blocks for t in b.tokens] == CONT[:13]
        assert scheduler.yields == 1  # three rounds ran while it was stuck; the first waited for it
    finally:
        release.set()
        for t in threads:
            t.join(5)
