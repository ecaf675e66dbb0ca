"""An orchestrator engine: a verifier, a drafter and a tokenizer, and the one path a request takes.

Every front (the CLI, both APIs through ``service.py``, niah, the benchmarks) starts a :class:`Run` with
:meth:`Engine.start` and iterates it, so all of them check, open, size, fall back, stop, cut text and close
alike, and end with the same ``Report``. Whether the backends are in-process or remote is ``assembly.py``'s
choice; the engine never looks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Self

from kakeya.core.contract import Cancellation, Drafter, SessionOptions, Verifier, replica_lost
from kakeya.core.generation import Block, Generation, Report
from kakeya.core.request import MAX_BLOCK_SIZE, REJECTION, CheckedRequest, InvalidRequest, Request
from kakeya.orchestrator.decode.block_sizing import AdaptivePolicy, BlockSizer, measure_costs
from kakeya.orchestrator.decode.checks import Limits, check_request
from kakeya.orchestrator.decode.loop import Decode, DecodeOptions
from kakeya.orchestrator.decode.scheduler import Scheduler, here
from kakeya.orchestrator.decode.takeover import reprefill, take_over
from kakeya.orchestrator.proposers import RANKED, open_guide
from kakeya.orchestrator.text import TextCodec, text_stream

log = logging.getLogger("kakeya.orchestrator")


class Engine:
    """``prefix_cache``: every run resumes the longest cached prefix of its prompt (``core/prefix.py``) and
    leaves a snapshot when it ends. ``ngram``: a context that repeats is drafted by copy (``proposers.py``)."""

    def __init__(
        self,
        verifier: Verifier,
        drafter: Drafter | None,
        codec: TextCodec | None,
        target: str = "",
        draft: str = "",
        device: str | None = None,
        prefix_cache: bool = False,
        ngram: bool = True,
    ):
        self.verifier, self.drafter, self.codec = verifier, drafter, codec
        self.target, self.draft = target, draft
        self.prefix_cache = prefix_cache
        self.device = device  # what reports print (in-process torch: "cpu"/"cuda"; None: not known here)
        self.ngram = ngram
        self.adaptive: AdaptivePolicy | None = None  # measured on the first request that asks for it
        self._calibrating = threading.Lock()
        self._schedulers: dict[Callable, Scheduler] = {}  # one per model-thread runner (a server has one)

    @property
    def default_block_size(self) -> int:
        """The drafter's trained block size (what ``ModelInfo`` reports; requests default to auto)."""
        return self.drafter.block_size if self.drafter is not None else 1

    def max_block_size(self, policy=None) -> int:
        """The largest block a session under ``policy`` (None: the verifier's) can verify and roll back exactly."""
        if self.drafter is None:
            return 1
        resolved = (policy or self.verifier.policy).resolve(self.verifier.info.sliding_window)
        return min(MAX_BLOCK_SIZE, resolved.slack, resolved.window if resolved.restore else MAX_BLOCK_SIZE)

    def scheduler(self, step: Callable, queued: Callable[[], int] | None = None) -> Scheduler:
        """The scheduler of the requests whose model work runs through ``step`` (``queued``: jobs waiting for it)."""
        with self._calibrating:
            if step not in self._schedulers:
                drafts = self.drafter.draft_batch if self.drafter is not None else None
                self._schedulers[step] = Scheduler(drafts, self.verifier.decide_batch, step, self._round_done, queued)
            return self._schedulers[step]

    def _round_done(self, sessions: int, rows: int, seconds: float) -> None:
        if self.adaptive is not None:  # what a round costs prices the blocks of the next (``block_sizing.RoundCosts``)
            self.adaptive.rounds.observe(sessions, rows, seconds)

    def calibrate(self) -> AdaptivePolicy:
        """Measure the cost of a block at each size on this engine's endpoints (once)."""
        with self._calibrating:
            if self.adaptive is None:
                costs = measure_costs(self.verifier, self.drafter)  # without a drafter: size 1 alone
                self.adaptive = AdaptivePolicy(costs, initial=self.default_block_size)
        return self.adaptive

    def block_sizer(self, req: Request) -> int | BlockSizer:
        """A fixed size, or for ``block_size`` 0 (auto) a sizer primed with what this engine has seen."""
        if req.block_size or self.drafter is None:
            return req.block_size or 1
        return self.calibrate().sizer(min(req.max_block_size, self.max_block_size(req.cache_policy)))

    def stop_ids(self, req: Request) -> frozenset[int]:
        """The tokens that end ``req``'s generation (included in it)."""
        eos = () if req.ignore_eos else self.verifier.info.eos_token_ids
        return frozenset(req.stop_ids) | frozenset(eos)

    def check(self, req: Request, limits: Limits = Limits()) -> CheckedRequest:
        """``req`` as it will run, checked against the model and ``limits`` (``checks.py``)."""
        return check_request(req, self, limits)

    def start(self, req: Request, options: RunOptions | None = None) -> Run:
        """Check ``req`` against ``options.limits`` (unless it was) and return its :class:`Run`, begun."""
        options = options or RunOptions()
        run = Run(self, req if isinstance(req, CheckedRequest) else self.check(req, options.limits), options)
        run.begin()
        return run

    def generate(self, req: Request, options: RunOptions | None = None) -> Generation:
        """:meth:`start` ``req`` and run it to the end."""
        with self.start(req, options) as run:
            for _ in run:
                pass
        return run.result


@dataclass(frozen=True)
class RunOptions:
    """How a front runs a request (what to generate is the :class:`Request`)."""

    timeout: float | None = None  # the client's deadline in seconds: bounds the backend sessions; None: none
    step: Callable[..., Any] = here  # runs each piece of model work; a colocated server: on its compute thread
    queued: Callable[[], int] | None = None  # jobs waiting for step's thread: a round lets them run before its verify
    drafter_fallback: bool = False  # a failing drafter leaves the verifier to finish alone (servers), not fail loudly
    ngram: bool | None = None  # None: the engine's choice (``Engine.ngram``); the rejection rule never copies
    guided: bool = True  # a constrained request drafts its grammar's forced tokens (``proposers.py``)
    limits: Limits = Limits()  # what the request is checked against (a server's flags)
    # A replica's loss mid-stream: go on on another replica (``decode/takeover.py``) instead of failing;
    # ``on_takeover(role, pause_s, drained)`` hears each one (``drained``: a draining replica's hand-off).
    takeover: bool = False
    on_takeover: Callable[[str, float, bool], None] | None = None


class Run:
    """One request through an engine: iterate it for the committed blocks, then read ``result`` / ``report``.

    It owns everything between a request and its blocks: both sessions, the prefill (one chunk per model-thread job, so
    other requests' rounds run between chunks), the scheduler, the sizer, the drafter fallback, stop tokens and strings,
    and closing both sessions however the run ends (exhausted, ``close``d, failed, or ``cancel``led from any thread). A
    context manager. Making one is cheap; :meth:`begin` opens the sessions and runs the prefill's first chunk."""

    def __init__(self, engine: Engine, req: CheckedRequest, options: RunOptions):
        if not isinstance(req, CheckedRequest):
            raise TypeError("a Run takes a CheckedRequest: Engine.check (or Engine.start) makes one")
        self.request, self._engine, self._step, self._options = req, engine, options.step, options
        self._sampling = req.sampling  # checked: seeded, one seed for both sessions' streams, reported back
        self._text = text_stream(engine.codec, req.stop_strings)  # each block's text, cut at a stop string
        self._streamed: list[str] = []
        self._cancellation = Cancellation()
        self._result: Generation | None = None
        self._decode: Decode | None = None
        self._scheduler = engine.scheduler(options.step, options.queued)
        self._joined = False
        self.verifier_session = self.drafter_session = None  # read by a server's metrics (their backends' time)
        self._sizer = None
        self._prefill_t0, self._prefilling = 0.0, None  # the prefill as _begin left it (see _prefill)
        self._takeover, self._on_takeover = options.takeover and req.constraint is None, options.on_takeover
        self.takeovers: list[tuple[str, float]] = []  # (role, pause seconds) of each take-over (``takeover.py``)
        # a resumed stream: what the client has is context, not output (its text held back alike); one that
        # completes a stop string with its last token ends the run as soon as its prefill ran (``_prefill``)
        self._resumed_stop = False
        if req.resume_ids:
            ids = list(req.resume_ids)  # a stop token ending them: counted, its text no output (as in ``__next__``)
            ids = ids[:-1] if ids[-1] in engine.stop_ids(req) else ids
            kept, _, self._resumed_stop = self._text.add(ids)
            if len(kept) < len(ids):
                raise InvalidRequest("resume_token_ids", "tokens follow a stop string, where the generation ended")
        # the rejection rule needs the drafter's distribution beside each candidate: it never copies nor is guided
        self._exact = self._sampling.greedy or self._sampling.rule != REJECTION
        # a constrained request drafts with its grammar: greedy ones choose among the drafter's ranks
        self._guided = guided = req.constraint is not None and options.guided and self._exact
        self._session_options = SessionOptions(
            req.request_id,
            options.timeout,
            len(req.prompt_ids) + req.max_tokens,
            self._cancellation,
            logprobs=req.logprobs,
            constraint=req.constraint,
            ranked=RANKED if guided and self._sampling.greedy else 0,
            movable=self._takeover,  # a draining replica's sessions move at a round boundary (``takeover.py``)
        )

    def begin(self) -> None:
        """Open the sessions and run the prefill's first chunk; a failure closes what was opened and is raised."""
        if self._decode is not None:
            raise RuntimeError("the run has begun already")
        engine, req, options, sessions = self._engine, self.request, self._options, self._session_options
        # ONE model-thread job: on a busy engine each job waits for the round in flight
        try:
            with self._scheduler.starting():
                self._step(self._begin, sessions)
        except BaseException:
            self._step(self._close_sessions)
            raise
        ngram = (engine.ngram if options.ngram is None else options.ngram) and self._exact
        guide = None
        if self._guided:
            info = engine.verifier.info
            guide = open_guide(req.constraint, engine.codec.tokenizer_json, info.vocab_size, info.eos_token_ids)
        max_block = min(engine.max_block_size(req.cache_policy), req.max_block_size)
        decoding = DecodeOptions(
            req.max_tokens,
            self._sizer,
            engine.stop_ids(req),
            options.drafter_fallback,
            ngram,
            guide,
            max_block,
            self._takeover,
        )
        self._decode = Decode(self.verifier_session, self.drafter_session, req.prompt_ids, decoding)

    @property
    def drafter_error(self) -> Exception | None:
        """Why the drafter stopped, if it did and the verifier finished alone (a server counts it by reason)."""
        return self._decode.drafter_error if self._decode is not None else None

    def _open(self, options: SessionOptions) -> None:
        e, req = self._engine, self.request
        self.verifier_session = e.verifier.open_session(req.cache_policy, self._sampling, options)
        speculate = isinstance(self._sizer, BlockSizer) or self._sizer > 1
        if e.drafter is not None and speculate:
            self.drafter_session = e.drafter.open_session(self._sampling, options)

    def _begin(self, sessions: SessionOptions) -> None:
        """On the model thread: size, open both sessions, run the prefill's first chunk (its failure kept)."""
        self._sizer = self._engine.block_sizer(self.request)
        self._open(sessions)
        self._prefill_t0 = time.perf_counter()
        try:
            steps = self._prefill_steps(self._context())
            self._prefilling = (steps, self._chunk(steps))
        except Exception as exc:  # noqa: BLE001 - raised by the first ``next``
            self._prefilling = exc

    def _context(self) -> list[int]:
        """What the first prefill runs: the prompt, and a resumed stream's tokens but the last."""
        return self.request.prompt_ids + list(self.request.resume_ids[:-1])

    def _prefill_steps(self, ids):
        """The verifier's prefill generator of ``ids``, resuming from the longest cached prefix both the verifier
        and the drafter hold (both or neither, so the drafter's context never has a gap)."""
        ds, reuse = self.drafter_session, ()
        if self._engine.prefix_cache:
            reuse = None
            if ds is not None:
                try:
                    reuse = ds.cached_prefixes(ids)
                except Exception as exc:  # its first draft fails the same way: the fallback takes over there
                    if not self._options.drafter_fallback:
                        raise
                    log.warning("request %s: drafter prefix lookup failed (%s)", self.request.request_id or "-", exc)
                    reuse = []  # none usable: a lookup all the same (a miss), cold
        return self.verifier_session.prefill_steps(ids, reuse)

    def _chunk(self, steps):
        """One chunk of the prefill (a model-thread job): ``(first token, aux, cached tokens)`` once the prompt
        is done (the drafter resuming the same cached prefix in the same job), None before."""
        done = _chunk(steps)
        if done is not None and self.drafter_session is not None and self._engine.prefix_cache:
            self.drafter_session.resume(done[2])
        return done

    def _prefill(self) -> Block:
        """The rest of the prompt, one model-thread job per chunk; the first block (None: cancelled)."""
        prefilling, self._prefilling = self._prefilling, None
        try:
            if isinstance(prefilling, Exception):
                raise prefilling
            steps, done = prefilling
            while done is None:
                if self.cancelled:
                    steps.close()
                    return None
                done = self._step(self._chunk, steps)
        except Exception as exc:
            if not (self._takeover and replica_lost(exc)) or self.cancelled:
                raise
            done = reprefill(self, exc)  # the prefill's replica was lost: another one's
        first, aux, cached = done
        self._decode.generation.cached_tokens = min(cached, len(self.request.prompt_ids))  # resumed ones aren't prompt
        seconds = time.perf_counter() - self._prefill_t0
        if self.request.resume_ids:
            block = self._decode.resumed(self.request.resume_ids, aux, seconds)
            if self._resumed_stop:
                self._decode.generation.finish_reason = "stop"
            return block
        return self._decode.prefilled(first, aux, seconds)

    def _save(self) -> None:
        """Snapshot the prompt and every committed token but the last (which no forward has seen) in the prefix
        caches; the drafter's only if its context is whole."""
        gen = self._decode.generation
        ids = gen.prompt_ids + gen.token_ids[:-1]
        try:
            self.verifier_session.save(ids)
            if self.drafter_session is not None and not gen.drafter_fallback:
                self.drafter_session.save(ids, self._decode.unseen)
        except Exception:
            log.exception("request %s: saving the prefix snapshot", self.request.request_id or "-")

    def __iter__(self) -> Run:
        return self

    def __next__(self) -> Block:
        """The next committed block, its ``text`` the text it added (cut at a stop string, which ends the run)."""
        if self._result is not None:
            raise StopIteration
        if self._decode is None:
            raise RuntimeError("the run has not begun: call begin() first (Engine.start does)")
        block = None if self.cancelled else self._advance()
        if self.cancelled:
            self._end("abort")
        elif block is None:
            self._end(self._decode.generation.finish_reason, learn=True)
        else:
            tokens = block.tokens  # a stop token (``_emit`` cut the block after it) is counted, its text no output
            if tokens and tokens[-1] in self._decode.options.stop_ids:  # (EOS's and stop_token_ids', as vLLM's)
                tokens = tokens[:-1]
            ids, block.text, hit = self._text.add(tokens)
            self._streamed.append(block.text)
            if hit:
                self._stop_at(block, len(ids))
            return block
        raise StopIteration

    def _advance(self) -> Block | None:
        """The next block (the prefill's, then the scheduler's); None once decoding is over."""
        try:
            if not self._joined:
                block = self._prefill()
                self._joined = True
                if block is not None and not self._decode.done:
                    self._scheduler.join(self._decode)
                if block is None or not self.request.resume_ids:  # a resumed stream's first block: the rounds'
                    return block
            block = self._scheduler.next_block(self._decode, lambda: self.cancelled)
            while block is None and self._decode.lost is not None and not self.cancelled:
                take_over(self)  # on this request's thread: its batch-mates' rounds go on meanwhile
                block = self._scheduler.next_block(self._decode, lambda: self.cancelled)
        except Exception:
            if self.cancelled:  # a cancel ends the backends' streams under a step: not a failure
                return None
            self._end("error")
            raise
        if block is None and self._decode.error is not None and not self.cancelled:
            self._end("error")
            raise self._decode.error
        return block

    @property
    def result(self) -> Generation:
        """The finished :class:`Generation`: what was committed, how it ended, the verifier's stats."""
        if self._result is None:
            raise RuntimeError("the run is not over: iterate it to the end, or close it")
        return self._result

    def report(self, total_s: float = 0.0, error: str = "") -> Report:
        """The finished run as every front reports it (``total_s``: end to end as the caller measured it)."""
        gen, e, stats = self.result, self._engine, self.result.verifier_stats
        same = ("finish_reason", "cached_tokens", "decode_tok_s", "prefill_s", "decode_s", "drafter_fallback")
        return Report(
            target=e.target,
            draft=e.draft,
            backend=e.verifier.info.backend,
            device=e.device,
            error=error,
            prompt_token_ids=tuple(gen.prompt_ids),
            token_ids=tuple(gen.token_ids),
            text="".join(self._streamed),
            block_size=self.request.block_size,
            block_sizes=tuple(b.drafted + 1 for b in gen.blocks[1:]),
            acceptance_lengths=tuple(gen.acceptance_lengths),
            copied_blocks=sum(b.copied for b in gen.blocks),
            forced_blocks=sum(b.forced for b in gen.blocks),
            total_s=total_s,
            kv_bytes=stats.kv_bytes,
            cache_policy=stats.cache_policy,
            cache_bounded=stats.bounded,
            sampling=gen.sampling,
            **{k: getattr(gen, k) for k in same},
        )

    @property
    def cancelled(self) -> bool:
        return self._cancellation.cancelled

    def cancel(self) -> None:
        """End the run from any thread: remote streams end at once, the iteration ends at its next step."""
        self._cancellation.cancel()
        if self._decode is not None:
            self._decode.cancelled = True
        self._scheduler.wake()

    def close(self) -> None:
        """End the run now if it is not over; what was committed is the result (finish reason ``abort``)."""
        if self._result is None and self._decode is None:  # never begun: nothing was opened
            self._result = Generation(prompt_ids=self.request.prompt_ids, finish_reason="abort")
        elif self._result is None:
            self._end("abort")

    def _stop_at(self, block: Block, keep: int) -> None:
        """End the run at a stop string found in ``block``: keep its first ``keep`` tokens, no later block."""
        gen = self._decode.generation
        gen.finish_reason = "stop"  # done: no later round takes it, and the cut waits for the one in flight
        self._scheduler.leave(self._decode)
        at = next(i for i, b in enumerate(gen.blocks) if b is block)
        del gen.blocks[at + 1 :]
        block.cut(keep)
        gen.token_ids[:] = [t for b in gen.blocks for t in b.tokens]
        self._end("stop")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _end(self, finish_reason: str, learn: bool = False) -> None:
        decode = self._decode
        gen = decode.generation
        self._scheduler.leave(decode)  # no round runs on its sessions from here on (never joined: at once)
        gen.finish_reason, gen.sampling = finish_reason, self._sampling
        self._streamed.append(self._text.flush())  # text held back for a stop string or a partial character
        self._result = gen
        if decode.drafter_error is not None and not self.cancelled:  # a cancel ends the drafter's stream too
            log.info("request %s: the drafter stopped (%s); the verifier finished alone",
                     self.request.request_id or "-", decode.drafter_error)  # fmt: skip
        keep = finish_reason != "error" and not self.cancelled
        save = keep and self._engine.prefix_cache and finish_reason in ("stop", "length")
        self._step(self._finish, gen, keep, save)  # one job: each would wait for a round in flight
        if learn and isinstance(self._sizer, BlockSizer):
            self._engine.adaptive.learn(self._sizer)  # the next request starts from what this one saw

    def _finish(self, gen: Generation, keep: bool, save: bool) -> None:
        """On the model thread: the stats and snapshot (``keep``/``save``), then both sessions closed."""
        try:
            if keep:
                gen.verifier_stats = self.verifier_session.stats()
                if save:
                    self._save()
        finally:
            self._close_sessions()

    def _close_sessions(self) -> None:
        for session in (self.drafter_session, self.verifier_session):
            if session is not None:
                try:
                    session.close()
                except Exception:
                    log.exception("closing a backend session")


def _chunk(steps):
    """One step of a prefill generator; None until it returns its result."""
    try:
        next(steps)
    except StopIteration as done:
        return done.value
    return None
