"""An orchestrator engine: a verifier, a drafter and a tokenizer, and the one path a request takes.

Every front (the CLI, the public gRPC server, niah, the benchmarks) starts a
:class:`Run` with :meth:`Engine.start` and iterates it, so all of them open,
size, fall back, stop and close alike, and report the same stats. Which
verifier/drafter the engine holds (in-process MLX, in-process torch, remote
gRPC) is decided by whoever builds it (``assembly.py``); the engine never looks.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Self

from kakeya.core.contract import Cancellation, Drafter, SessionOptions, Verifier, check_alternatives
from kakeya.core.request import REJECTION, Request
from kakeya.orchestrator import loop
from kakeya.orchestrator.adaptive import AdaptivePolicy, BlockSizer, measure_costs
from kakeya.orchestrator.quality import quality_report
from kakeya.orchestrator.text import TextCodec

log = logging.getLogger("kakeya.orchestrator")


class Engine:
    """``predraft``: greedy runs pre-draft each next block while the current one is verified (the
    loop's ``predraft``): worth it where the drafter works beside the verifier, i.e. split;
    ``predraft_alternatives``: the drafter's next likeliest tokens each pre-draft also prepares a
    rejection for at a candidate, the likeliest such verdicts (the loop's ``alternatives``).
    ``prefix_cache``: the verifier keeps a prefix cache (``core/prefix.py``), so every run asks it (and
    the drafter) to resume the longest cached prefix of its prompt and leaves a snapshot when it ends.
    ``ngram``: a block whose context ends in a run seen before is drafted by copy (the loop's ``ngram``;
    greedy and coupled sampling)."""

    def __init__(
        self,
        verifier: Verifier,
        drafter: Drafter | None,
        codec: TextCodec | None,
        target: str = "",
        draft: str = "",
        device: str | None = None,
        predraft: bool = False,
        prefix_cache: bool = False,
        ngram: bool = True,
        predraft_alternatives: int = 0,
    ):
        self.verifier, self.drafter, self.codec = verifier, drafter, codec
        self.target, self.draft = target, draft
        self.prefix_cache = prefix_cache
        self.device = device  # what reports print (in-process torch: "cpu"/"cuda"; None: not known here)
        # Checked here, not first by a drafter server: a refused pre-draft backs the drafter off for every request.
        self.predraft, self.predraft_alternatives = (
            predraft,
            check_alternatives(predraft_alternatives, "predraft_alternatives"),
        )
        self.ngram = ngram
        self.adaptive: AdaptivePolicy | None = None  # measured on the first request that asks for it
        self._calibrating = threading.Lock()

    @property
    def default_block_size(self) -> int:
        """The drafter's trained block size (what ``ModelInfo`` reports; requests default to auto)."""
        return self.drafter.block_size if self.drafter is not None else 1

    def max_block_size(self, policy=None) -> int:
        """The largest block a session under ``policy`` (None: the verifier's default) can verify and roll back exactly."""
        if self.drafter is None:
            return 1
        resolved = (policy or self.verifier.policy).resolve(self.verifier.info.sliding_window)
        return min(loop.MAX_BLOCK_SIZE, resolved.slack, resolved.window if resolved.restore else loop.MAX_BLOCK_SIZE)

    def calibrate(self) -> AdaptivePolicy:
        """Measure the cost of a block at each size on this engine's endpoints (once)."""
        with self._calibrating:
            if self.adaptive is None:
                sizes = (1, 2, 4, 8, 16) if self.drafter is not None else (1,)
                costs = measure_costs(self.verifier, self.drafter, sizes)
                self.adaptive = AdaptivePolicy(costs, initial=self.default_block_size)
        return self.adaptive

    def as_run(self, req: Request) -> Request:
        """``req`` as it runs. A rejection-rule sampling request asking for auto runs at the drafter's
        trained block size instead (within the cache policy's limits): that rule's tokens depend on
        the block sizes, so its seed must meet one schedule, never one that timings pick. The
        coupled rule's tokens depend on no schedule: auto stays auto."""
        if req.block_size or self.drafter is None or req.sampling.greedy or req.sampling.rule != REJECTION:
            return req
        fixed = min(self.default_block_size, req.max_block_size, self.max_block_size(req.cache_policy))
        return replace(req, block_size=fixed)

    def block_sizer(self, req: Request) -> int | BlockSizer:
        """A fixed size, or for ``block_size`` 0 (auto) a sizer primed with what this engine has seen."""
        if req.block_size or self.drafter is None:
            return req.block_size or 1
        sizer = self.calibrate().sizer()
        sizer.max_size = min(req.max_block_size, self.max_block_size(req.cache_policy))
        return sizer

    def stop_ids(self, req: Request) -> frozenset[int]:
        """The tokens that end ``req``'s generation (included in it)."""
        eos = () if req.ignore_eos else self.verifier.info.eos_token_ids
        return frozenset(req.stop_ids) | frozenset(eos)

    def validate(self, req: Request) -> None:
        """Raise ValueError naming the offending field."""
        if not req.prompt_ids:
            raise ValueError("prompt: empty prompt")
        vocab = self.verifier.info.vocab_size
        bad = [t for t in req.prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids: ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        if req.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {req.max_tokens}")
        req.sampling.check()
        if not 1 <= req.max_block_size <= loop.MAX_BLOCK_SIZE:
            raise ValueError(f"max_block_size must be between 1 and {loop.MAX_BLOCK_SIZE}, got {req.max_block_size}")
        resolved = (req.cache_policy or self.verifier.policy).resolve(self.verifier.info.sliding_window)
        if req.block_size == 0:
            return  # auto: sized within the policy's limits (``max_block_size``)
        block_size = req.block_size
        loop.check_block_size(block_size)
        if block_size > resolved.slack:
            raise ValueError(f"block_size {block_size} exceeds the cache policy's rollback slack {resolved.slack}")
        if resolved.restore and block_size > resolved.window:
            raise ValueError(f"block_size {block_size} exceeds the restoring window {resolved.window}")

    def start(self, req: Request, options: RunOptions | None = None) -> Run:
        """Validate ``req`` (ValueError naming the field), open its sessions and return the :class:`Run`
        (its ``request``: ``req`` :meth:`as_run`)."""
        self.validate(req)
        return Run(self, self.as_run(req), options or RunOptions())

    def generate(self, req: Request, options: RunOptions | None = None) -> loop.Generation:
        """:meth:`start` ``req`` and run it to the end."""
        with self.start(req, options) as run:
            for _ in run:
                pass
        return run.result

    def report(self, req: Request, gen: loop.Generation) -> dict:
        """The stats every front end prints (CLI --json, the Generate API's final message)."""
        kv = gen.verifier_stats.get("kv_bytes", {})
        return {
            "target": self.target,
            "draft": self.draft,
            "backend": self.verifier.info.backend,
            "block_size": req.block_size,  # 0: auto, sized block by block
            "block_sizes": [b.drafted + 1 for b in gen.blocks[1:]],
            "copied_blocks": sum(b.copied for b in gen.blocks),  # drafted by copy (n-gram), not by the drafter
            "prompt_token_ids": gen.prompt_ids,
            "cached_tokens": gen.cached_tokens,
            "token_ids": gen.token_ids,
            "text": self.codec.decode(gen.token_ids),
            "finish_reason": gen.finish_reason,
            "acceptance_lengths": gen.acceptance_lengths,
            "mean_acceptance": round(gen.mean_acceptance, 4),
            "decode_tok_s": round(gen.decode_tok_s, 3),
            "prefill_s": round(gen.prefill_s, 6),
            "drafter_fallback": gen.drafter_fallback,
            "verifier_kv_bytes": {"sliding": kv.get("sliding", 0), "full": kv.get("full", 0)}
            | ({"restored": kv["restored"]} if "restored" in kv else {}),
            "cache_policy": gen.verifier_stats.get("cache_policy", ""),
            "cache_bounded": gen.verifier_stats.get("bounded", False),
            "quality": quality_report(gen.token_ids),
            "sampling": sampling_report(gen.sampling),
            "seed": gen.sampling.seed,
        }


def sampling_report(s) -> dict:
    """What ran, as JSON reports show it (``temperature`` 0: greedy, and no rule)."""
    return {
        "temperature": s.temperature,
        "top_k": s.top_k,
        "top_p": s.top_p,
        "min_p": s.min_p,
        "rule": None if s.greedy else s.rule,
    }


def _call(fn: Callable, *args) -> Any:
    return fn(*args)


@dataclass(frozen=True)
class RunOptions:
    """How a front runs a request (what to generate is the :class:`Request`)."""

    timeout: float | None = None  # the client's deadline in seconds: bounds the backend sessions; None: none
    step: Callable[..., Any] = _call  # runs each piece of model work; a colocated server: on its compute thread
    # A failing drafter: the verifier finishes alone (same tokens, ``drafter_fallback`` set) instead of
    # failing the run. Servers want that; tests and benchmarks want a broken drafter to fail loudly.
    drafter_fallback: bool = False
    predraft: bool | None = None  # None: the engine's choice (``Engine.predraft``); sampling runs never pre-draft
    predraft_alternatives: int | None = None  # None: the engine's choice (``Engine.predraft_alternatives``)
    ngram: bool | None = None  # None: the engine's choice (``Engine.ngram``); the rejection rule never copies


class Run:
    """One request through an engine: iterate it for the committed blocks, then read ``result``.

    It owns what lies between a request and its blocks, for every front alike:
    opening the verifier and drafter sessions, the adaptive sizer (block size 0)
    and what the engine learns from it, the fallback to the verifier alone when
    the drafter fails, stop tokens, and closing both sessions however the run
    ends: exhausted, ended early (``close``, ``stop``), failed (the exception
    comes out of ``next``), or cancelled from any thread (``cancel``: the
    iteration then just ends). A context manager: leaving it closes the run.
    """

    def __init__(self, engine: Engine, req: Request, options: RunOptions):
        self.request, self._engine, self._step = req, engine, options.step
        self._fallback = options.drafter_fallback
        self._sampling = req.sampling.seeded()  # one seed for both sessions' streams, reported back
        self._cancellation = Cancellation()
        self._result: loop.Generation | None = None
        self._decoding: loop.Decoding | None = None
        self.verifier_session = self.drafter_session = None  # read by a server's metrics (their backends' time)
        self.drafter_error: Exception | None = None  # why the drafter stopped, if it did (a server counts it by reason)
        self._sizer = self._step(engine.block_sizer, req)
        sessions = SessionOptions(
            req.request_id, options.timeout, len(req.prompt_ids) + req.max_tokens, self._cancellation
        )
        try:
            self._step(self._open, sessions)
        except BaseException:
            self._step(self._close_sessions)
            raise
        on_drafter_error = self._drafter_failed if options.drafter_fallback else None
        predraft = (engine.predraft if options.predraft is None else options.predraft) and self._sampling.greedy
        ngram = (engine.ngram if options.ngram is None else options.ngram) and (
            self._sampling.greedy or self._sampling.rule != REJECTION
        )  # a copy has no proposal distribution
        alternatives = (
            engine.predraft_alternatives
            if options.predraft_alternatives is None
            else check_alternatives(options.predraft_alternatives, "predraft_alternatives")
        )
        self._decoding = loop.Decoding(
            self.verifier_session,
            self.drafter_session,
            req.prompt_ids,
            req.max_tokens,
            self._sizer,
            engine.stop_ids(req),
            on_drafter_error,
            predraft,
            self._resume if engine.prefix_cache else None,
            ngram,
            alternatives,
        )

    def _open(self, options: SessionOptions) -> None:
        e, req = self._engine, self.request
        self.verifier_session = e.verifier.open_session(req.cache_policy, self._sampling, options)
        speculate = isinstance(self._sizer, BlockSizer) or self._sizer > 1
        if e.drafter is not None and speculate:
            self.drafter_session = e.drafter.open_session(self._sampling, options)

    def _resume(self, prompt_ids) -> tuple:
        """The prefill with a prefix cache: the drafter names the prompt prefixes it holds a snapshot of, the
        verifier resumes from the longest of them it holds too (without a drafter: any it holds) and runs the
        rest, the drafter resumes from the same one -- both or neither, so the drafter's context never has a gap."""
        ds, reuse = self.drafter_session, None
        if ds is not None:
            try:
                reuse = ds.cached_prefixes(prompt_ids)
            except Exception as exc:  # its first draft fails the same way: the loop's fallback takes over
                if not self._fallback:
                    raise
                log.warning("request %s: drafter prefix lookup failed (%s)", self.request.request_id or "-", exc)
                reuse = ()
        first, aux, cached = self.verifier_session.resume(prompt_ids, reuse)
        if ds is not None:
            ds.resume(cached)
        self._decoding.generation.cached_tokens = cached
        return first, aux

    def _save(self) -> None:
        """Leave what this run computed in the prefix caches: the state after its prompt and every committed
        token but the last (which no forward has seen), the drafter's only if its context is whole."""
        gen = self._decoding.generation
        ids = gen.prompt_ids + gen.token_ids[:-1]
        try:
            self.verifier_session.save(ids)
            if self.drafter_session is not None and not gen.drafter_fallback:
                self.drafter_session.save(ids, self._decoding.unseen)
        except Exception:  # a snapshot is an optimisation: never the run's failure
            log.exception("request %s: saving the prefix snapshot", self.request.request_id or "-")

    def __iter__(self) -> Run:
        return self

    def __next__(self) -> loop.Block:
        if self._result is not None:
            raise StopIteration
        block = None if self.cancelled else self._advance()
        if self.cancelled:
            self._end("abort")
        elif block is None:
            self._end(self._decoding.generation.finish_reason, learn=True)
        else:
            return block
        raise StopIteration

    def _advance(self) -> loop.Block | None:
        """The loop's next block on the step's thread (None: the loop is over); a failure ends the run."""
        try:
            return self._step(next, self._decoding, None)
        except Exception:
            if self.cancelled:  # a cancel ends the backends' streams under a step: not a failure
                return None
            self._end("error")
            raise

    @property
    def result(self) -> loop.Generation:
        """The finished :class:`Generation`: what was committed, how it ended, the verifier's stats."""
        if self._result is None:
            raise RuntimeError("the run is not over: iterate it to the end, or close it")
        return self._result

    @property
    def cancelled(self) -> bool:
        return self._cancellation.cancelled

    def cancel(self) -> None:
        """End the run from any thread (say, a gRPC cancel callback): remote sessions' streams end at once,
        the iteration ends at its next step and closes what is left."""
        self._cancellation.cancel()

    def close(self) -> None:
        """End the run now if it is not over; what was committed is the result (finish reason ``abort``)."""
        if self._result is None:
            self._end("abort")

    def stop(self, keep: int) -> None:
        """End the run at a stop the front found in the last block (a stop string): keep its first ``keep`` tokens."""
        gen = self._decoding.generation
        dropped = len(gen.blocks[-1].tokens) - keep
        if dropped > 0:
            del gen.blocks[-1].tokens[keep:]
            del gen.token_ids[-dropped:]
        self._end("stop")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _drafter_failed(self, exc: Exception) -> None:
        self.drafter_error = exc
        if not self.cancelled:  # a cancel ends the drafter's stream too: nothing to report
            log.info(
                "request %s: the drafter stopped (%s); the verifier finishes alone", self.request.request_id or "-", exc
            )

    def _end(self, finish_reason: str, learn: bool = False) -> None:
        gen = self._decoding.generation
        gen.finish_reason, gen.sampling = finish_reason, self._sampling
        self._result = gen
        try:
            if finish_reason != "error" and not self.cancelled:  # the cache as it ends (what reports show)
                gen.verifier_stats = self._step(self.verifier_session.stats)
                if self._engine.prefix_cache and finish_reason in ("stop", "length"):
                    self._step(self._save)
            if learn and isinstance(self._sizer, BlockSizer):
                self._engine.adaptive.learn(self._sizer)  # the next request starts from what this one saw
        finally:
            self._step(self._close_sessions)

    def _close_sessions(self) -> None:
        if self._decoding is not None:
            self._decoding.close()
        for session in (self.drafter_session, self.verifier_session):
            if session is not None:
                try:
                    session.close()
                except Exception:  # closing must not mask the outcome
                    log.exception("closing a backend session")
