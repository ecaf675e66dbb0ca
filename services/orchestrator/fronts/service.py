"""The generation service: what every public front (the gRPC API, the HTTP API) runs a request through.

A front turns what its client sent into a :class:`~kakeya.core.request.Request` and iterates
:meth:`GenerationService.stream`: committed blocks, then one :class:`~kakeya.core.generation.Report`. In between, for
every front alike: readiness, admission, the engine's check against :class:`Limits`, the run, cancellation, the drain.

Failures: before the first block a refusal raises (``InvalidRequest`` naming the field, or ``RequestError`` with a
status); after it, the report says ``finish_reason`` "error". A cancelled run ends without a report. A backend's error
names its address and its own fields, which a public caller knows neither of: :func:`public_status` keeps the status,
renames the public fields, replaces anything else by a short reason, and logs the whole error.
"""

from __future__ import annotations

import itertools
import logging
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Protocol

import grpc

from kakeya.core import constraints
from kakeya.core.generation import Block, Report
from kakeya.core.request import InvalidRequest, Request
from kakeya.orchestrator.decode.checks import DEFAULT_MAX_TOKENS, Limits, constraint_field, context_of, prompt_limit
from kakeya.orchestrator.decode.engine import Engine, RunOptions
from kakeya.orchestrator.remote.streams import BackendError
from kakeya.runtime import bounds, logs
from kakeya.runtime.admission import DEFAULT_MAX_SESSIONS
from kakeya.runtime.compute import ComputeThread
from kakeya.runtime.lifecycle import RequestError, bounded
from kakeya.runtime.metrics import NO_OBSERVER, ServerMetrics
from kakeya.runtime.security.auth import peer_of

log = logging.getLogger("kakeya.orchestrator")

DEFAULT_MAX_TOKENS_LIMIT = 4096
# What a generation asked of a draining orchestrator hears (UNAVAILABLE; HTTP 503): its client retries elsewhere.
DRAINING = "orchestrator is draining (shutting down): retry on another replica"
# A verifier's request fields that carry a public request's values, and their public names.
PUBLIC_FIELDS = (
    ("open.cache_policy", "cache_policy"),
    ("open.sampling", "sampling_params"),
    ("open.max_positions", "prompt + sampling_params.max_tokens"),
    ("prefill.token_ids", "prompt"),
)
INTERNAL_FIELDS = ("open.", "prefill.", "verify.", "commit.", "draft.")


class ClientCall(Protocol):
    """What the service needs of a front's call (a gRPC ``ServicerContext`` is one; ``http_server.HttpCall``)."""

    def peer(self) -> str:
        """The caller, as gRPC names peers (``ipv4:ADDR:PORT``): what ``--max-sessions-per-peer`` counts."""

    def time_remaining(self) -> float | None:
        """Seconds left of the client's deadline (None: none): the backend sessions' timeout."""

    def add_callback(self, fn: Callable[[], None]) -> bool:
        """Run ``fn`` when the client goes away; False if it already has."""


def _deadline(call: ClientCall | None) -> float | None:
    left = None if call is None else call.time_remaining()
    return None if left is None or left > 1e7 else max(left, 0.001)


class _SessionTime:
    """A run's backend time of one role (the contract's ``server_s``) summed over its sessions: a take-over
    replaces them mid-run (``decode/takeover.py``), and the metrics' wire time must not count that as negative."""

    def __init__(self, run, attr: str):
        self.run, self.attr = run, attr
        self.session, self.before = getattr(run, attr), 0.0

    @property
    def server_s(self) -> float | None:
        s = getattr(self.run, self.attr)
        if s is not self.session:
            self.before += (self.session.server_s or 0.0) if self.session is not None else 0.0
            self.session = s
        return None if s is None or s.server_s is None else self.before + s.server_s


class GenerationService:
    """One engine served to many clients (see the module docstring). ``build`` makes the engine at
    :meth:`load`; ``prefixes``: the prefix cache a colocated engine's sessions share (its metrics); ``models_here``:
    some of its models run in this process (colocated, or a split's in-process drafter; default: colocated)."""

    def __init__(
        self,
        build: Callable[[], Engine],
        *,
        colocated: bool,
        models_here: bool | None = None,
        max_tokens_limit: int = DEFAULT_MAX_TOKENS_LIMIT,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        max_sessions_per_peer: int = 0,
        queue: int = 0,
        queue_timeout_s: float = 10.0,
        max_prompt_tokens: int = 0,
        restore: bounds.RestoreSources | None = None,
        auth_token: str | None = None,
        prefixes=None,
    ):
        if not 1 <= default_max_tokens <= max_tokens_limit:
            why = f"default max tokens {default_max_tokens} must be in 1..{max_tokens_limit} (--max-tokens-limit)"
            raise ValueError(why)
        if queue < 0 or queue_timeout_s < 0:
            raise ValueError(f"--queue and --queue-timeout must be >= 0, got {queue} and {queue_timeout_s}")
        if max_prompt_tokens < 0:
            raise ValueError(f"--max-prompt-tokens must be >= 0 (0: the default), got {max_prompt_tokens}")
        self._build = build
        self.colocated = colocated
        self.max_tokens_limit, self.default_max_tokens = max_tokens_limit, default_max_tokens
        self.max_sessions, self.max_sessions_per_peer = max_sessions, max_sessions_per_peer
        # --queue: generations that wait for one of --max-sessions to end instead of RESOURCE_EXHAUSTED at once
        self.queue, self.queue_timeout_s = queue, queue_timeout_s
        self.max_prompt_tokens_flag = max_prompt_tokens
        self.restore = restore  # colocated: the --restore sources requests may name; None: the verifier maps names
        self.auth_token = auth_token
        self.engine: Engine | None = None
        self.limits = Limits()  # set by load(), from the flags and the target's facts
        models_here = colocated if models_here is None else models_here
        self.compute = ComputeThread("orchestrator") if models_here else None
        self.ready = False
        self.draining = False  # SIGTERM (``drain``): no new generation starts, the ones in flight finish
        self.aborting = False  # the server is going down: in-flight generations end with finish reason "abort"
        self.verifier_down = False  # its health checks fail (the health watch): refuse at once, not after a timeout
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # notified when a generation ends (a queued one may start)
        self._waiting: deque[int] = deque()  # tickets of the queued generations, first come first
        self._tickets = itertools.count()
        self.active = 0
        self._running: list[threading.Event] = []  # per generation in flight: set once its client went away
        self.by_peer: dict[str, int] = {}  # generations in flight per caller (auth.peer_of)
        self.total = 0
        self.started = time.monotonic()
        self.metrics = ServerMetrics("orchestrator")
        self.metrics.track_sessions(lambda: self.active, lambda: self.total)
        self.metrics.waiting.set_function(lambda: float(len(self._waiting)))
        # a remote verifier's K/V budget in use (a gateway's gauge); 0 colocated, and while loading (served already)
        self.metrics.track_kv_usage(lambda: getattr(getattr(self.engine, "verifier", None), "kv_usage", float)())
        if prefixes is not None:  # colocated: the prefix cache the engine's verifier and drafter share
            self.metrics.track_prefix_cache(prefixes)

    def step(self, fn, *args):
        """Model work: on the compute thread when the models are in this process."""
        return self.compute.run(fn, *args) if self.compute is not None else fn(*args)

    def load(self) -> str:
        """Build the engine, set the limits and warm up through the very path requests take."""
        self.engine = e = self.step(self._build)
        limits = Limits(self.default_max_tokens, self.max_tokens_limit, self.max_prompt_tokens_flag, 0, self.restore)
        self.limits = replace(limits, max_prompt_tokens=prompt_limit(e, limits), max_context=context_of(e, limits))
        vocab = e.verifier.info.vocab_size
        ids = [i % vocab for i in range(1, 5)]
        warmup = Request(ids, 3, min(2, e.default_block_size), ignore_eos=True, request_id="warmup")
        *_, report = self._generate(warmup, observe=False)  # warm-up: not in the metrics
        if report.finish_reason == "error":
            raise RuntimeError(f"warm-up generation failed: {report.error}")
        if report.drafter_fallback:
            log.warning("warm-up: the drafter failed, requests will fall back to the verifier until it answers")
        drafter = e.drafter.backend if e.drafter is not None else "none"
        return (
            f"{'colocated' if self.colocated else 'split'}: verifier {e.verifier.info.backend} ({e.target}),"
            f" drafter {drafter} ({e.draft or '-'}), block {e.default_block_size}"
        )

    def drain(self) -> None:
        """SIGTERM: refuse every generation not started (queued too); the ones in flight go on to their end."""
        with self._lock:
            self.draining = True
            self._room.notify_all()  # the queued ones hear it now

    def busy(self) -> bool:
        """Generations in flight or queued: what a drain waits for (``ServerSpec.busy``; a health Watch it does not)."""
        with self._lock:
            return bool(self.active or self._waiting)

    def unavailable(self) -> str | None:
        """Why no generation may start now (None: they may), as a refusal says it and the HTTP front's /health."""
        why = {DRAINING: self.draining, "orchestrator is not ready (loading, warming up or draining)": not self.ready,
               "verifier unavailable (its health checks fail); retry later": self.verifier_down}  # fmt: skip
        return next((text for text, holds in why.items() if holds), None)

    def stream(self, req: Request, call: ClientCall) -> Iterator[Block | Report]:
        """One generation: its blocks as they commit, then its :class:`Report` (see the module docstring)."""
        if why := self.unavailable():
            raise RequestError(grpc.StatusCode.UNAVAILABLE, why)
        req = self.engine.check(req, self.limits)  # before admission: a bad request is refused for itself, never 429
        peer = peer_of(call)  # the caller's host: its connections' ports vary
        gone = threading.Event()  # its client went away: queued, it leaves the queue; running, it ends within a round
        call.add_callback(lambda: (gone.set(), self._wake())) or gone.set()  # (False: it has already gone)
        self._admit(peer, call, gone)
        token = logs.bind(request_id=req.request_id)
        try:
            yield from self._generate(req, call)
        finally:
            with self._lock:
                self.active -= 1
                self._running.remove(gone)
                if held := self.by_peer.pop(peer) - 1:
                    self.by_peer[peer] = held
                self._room.notify_all()
            logs.reset(token)

    def _admit(self, peer: str, call: ClientCall | None, gone: threading.Event) -> None:
        """Count one more generation of ``peer`` in, or raise RESOURCE_EXHAUSTED saying why. Over
        ``--max-sessions`` it waits in the queue (first come first served, up to ``--queue-timeout`` or its
        deadline); over ``--max-sessions-per-peer`` it is refused at once (waiting makes that caller no room)."""
        with self._lock:
            problem, full = self._admission_problem(peer, len(self._waiting))
            if full and len(self._waiting) < self.queue + sum(g.is_set() for g in self._running):  # (+ leaving ones)
                problem = self._wait_for_room(peer, min(self.queue_timeout_s, _deadline(call) or float("inf")), gone)
            elif full and self.queue:
                problem += f", and its queue is full (--queue {self.queue})"
            if self.draining:  # it drained while this one waited in the queue
                raise RequestError(grpc.StatusCode.UNAVAILABLE, DRAINING)
            if problem:
                raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"orchestrator: {problem}")
            self.active += 1
            self._running.append(gone)
            self.by_peer[peer] = self.by_peer.get(peer, 0) + 1
            self.total += 1

    def _wait_for_room(self, peer: str, wait_s: float, gone: threading.Event) -> str | None:
        """Queued (under the lock) until this generation may start: None, or why it may not. A client that goes
        away leaves the queue at once (its place freed, nothing run), raised as the cancel it is."""
        ticket = next(self._tickets)
        self._waiting.append(ticket)
        t0 = time.monotonic()
        try:
            while not gone.is_set():
                problem, full = self._admission_problem(peer, self._waiting.index(ticket))
                left = t0 + wait_s - time.monotonic()
                if not full or left <= 0 or not self.ready or self.aborting or self.draining:
                    break
                self._room.wait(left)
        finally:
            self._waiting.remove(ticket)
            self._room.notify_all()  # the next in line may be the one to start now
        if gone.is_set():
            raise RequestError(grpc.StatusCode.CANCELLED, "the client went away while its request was queued")
        if full:
            return f"{problem}, after {time.monotonic() - t0:.1f} s in its queue (--queue {self.queue})"
        return problem

    def _wake(self) -> None:
        with self._lock:
            self._room.notify_all()

    def _admission_problem(self, peer: str, ahead: int) -> tuple[str | None, bool]:
        """Why one more generation of ``peer`` is refused now, ``ahead`` queued before it, or None; and whether to wait."""
        if self.max_sessions and self.active + ahead >= self.max_sessions:
            queued = f" and {ahead} queued before it" if ahead else ""
            return f"{self.active} of {self.max_sessions} generations in flight{queued} (--max-sessions)", True
        held = self.by_peer.get(peer, 0)
        if self.max_sessions_per_peer and held >= self.max_sessions_per_peer:
            why = f"{held} of {self.max_sessions_per_peer} generations in flight from this caller (--max-sessions-per-peer)"
            return why, False
        return None, False

    def _generate(self, req: Request, call: ClientCall | None = None, observe: bool = True) -> Iterator[Block | Report]:
        """Run ``req``: its blocks, then its report (a cancelled run just ends)."""
        t_start = time.perf_counter()
        queued = (lambda: self.compute.queued) if self.compute is not None else None
        options = RunOptions(_deadline(call), self.step, queued, drafter_fallback=True, limits=self.limits,
                             takeover=not self.colocated, on_takeover=self.metrics.takeover)  # fmt: skip
        try:
            run = self.engine.start(req, options)
        except InvalidRequest:
            raise
        except Exception as exc:  # noqa: BLE001 - every failure to start becomes a public status
            reason = _unfollowable(exc)
            if reason is not None:  # its grammar past llguidance's budget as a session opened it
                raise InvalidRequest(constraint_field(req), reason) from None
            raise RequestError(*public_status(exc, req.request_id)) from None
        if call is not None and not call.add_callback(run.cancel):
            run.cancel()  # the call ended while the sessions opened
        checked = run.request
        vs, ds = _SessionTime(run, "verifier_session"), _SessionTime(run, "drafter_session")
        obs = self.metrics.generation(vs, ds, checked, t_start) if observe else NO_OBSERVER
        blocks, error, error_code = 0, "", ""
        try:
            for block in run:
                obs.block(block)
                blocks += 1
                yield block
                if self.aborting:
                    run.close()  # the server is going down: finish reason "abort"
        except Exception as exc:  # noqa: BLE001 - the run failed (and closed its sessions)
            reason = None if blocks else _unfollowable(exc)
            if reason is not None:  # past llguidance's budget, once followed
                raise InvalidRequest(constraint_field(req), reason) from None
            code, msg = public_status(exc, checked.request_id)
            if not blocks:
                raise RequestError(code, msg) from None
            log.warning("request %s failed mid-generation: %s", checked.request_id, msg)
            error, error_code = msg, code.name
        finally:
            run.close()  # also when the client went away while a block was on its way
            fallback = fallback_reason(run.drafter_error, run.cancelled)
            gen = run.result
            if run.cancelled:
                obs.finish("abort", fallback=fallback, prompt_tokens=len(gen.prompt_ids), tokens=len(gen.token_ids))
        if run.cancelled:
            return
        report = replace(run.report(time.perf_counter() - t_start, error), error_code=error_code)
        obs.finish(report.finish_reason, fallback=fallback, prompt_tokens=len(report.prompt_token_ids),
                   tokens=len(report.token_ids), cached_tokens=report.cached_tokens)  # fmt: skip
        yield report


def _unfollowable(exc: Exception) -> str | None:
    """Why the request's grammar cannot be followed, where ``exc`` (this process's, or a split verifier's
    INVALID_ARGUMENT naming its ``constraint`` field) says so, else None: the request's 400, not a failure."""
    if isinstance(exc, constraints.ConstraintError):
        return str(exc)
    if isinstance(exc, BackendError) and exc.service == "verifier" and exc.code == grpc.StatusCode.INVALID_ARGUMENT:
        for prefix in ("open.constraint.spec: ", "open.constraint: ", "constraint: "):
            if exc.details.startswith(prefix):
                return exc.details.removeprefix(prefix)
    return None


def public_status(exc: Exception, request_id: str = "") -> tuple[grpc.StatusCode, str]:
    """The status and message a public caller gets for ``exc`` (the request's failure)."""
    if isinstance(exc, BackendError):
        log.warning("request %s: %s", request_id or "-", exc)  # the whole story, address included, for the operator
        return _backend_status(exc)
    if isinstance(exc, RequestError):
        return exc.code, exc.message
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, bounded(str(exc))
    log.exception("request %s failed", request_id or "-", exc_info=exc)
    why = f"internal error ({type(exc).__name__}); the orchestrator's log has request {request_id or '-'}"
    return grpc.StatusCode.INTERNAL, why


def _backend_status(exc: BackendError) -> tuple[grpc.StatusCode, str]:
    service, code = exc.service, exc.code
    if code == grpc.StatusCode.ABORTED:  # reclaimed (runtime/admission.py); its limits and figures stay in the log
        return code, f"{service}: its session was ended to make room for others; retry"
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # full now: retrying helps
        full = "session limit reached" if "session limit" in exc.details else "K/V memory exhausted"
        return code, f"{service}: {full}; retry later"
    if code == grpc.StatusCode.OUT_OF_RANGE:  # the session alone outgrows its K/V budget (runtime/admission.py): a 400
        return code, f"{service}: the request outgrows its K/V memory; ask for fewer tokens (prompt + max_tokens)"
    # about the request's values (FAILED_PRECONDITION is about the session protocol: ours, never the caller's)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        details = re.sub(r" ?\(--[^()]*\)", "", exc.details)  # its flags ("(--restore NAME=DIR)") stay in our log
        for internal, public in PUBLIC_FIELDS:
            details = details.replace(internal, public)
        if not any(f in details for f in INTERNAL_FIELDS):
            return code, bounded(f"{service}: {details}")
        return grpc.StatusCode.INTERNAL, f"{service} refused a step of this request (see the orchestrator's log)"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return code, f"{service} did not answer in time" if exc.step_timeout else "deadline exceeded"
    if code == grpc.StatusCode.CANCELLED:
        return code, "cancelled"
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        # unreachable, loading, draining, or refusing this orchestrator: for the caller, not there now
        return grpc.StatusCode.UNAVAILABLE, f"{service} unavailable (not reachable, loading or draining); retry later"
    return grpc.StatusCode.INTERNAL, f"{service} failed (see the orchestrator's log)"


def fallback_reason(drafter_error: Exception | None, cancelled: bool) -> str | None:
    """Why a run finished on the verifier alone, as ``kakeya_ar_fallbacks_total{reason}`` counts it:
    ``drafter_failed``, ``drafter_backoff`` (skipped after earlier failures), ``drafter_busy`` or ``drafter_full``
    (this generation outgrew the drafter); None when it did not fall back, or the client's own cancel or deadline
    ended the drafter's stream."""
    if drafter_error is None or cancelled:
        return None
    if isinstance(drafter_error, BackendError):
        if drafter_error.ended_by_caller:
            return None
        if drafter_error.skipped:
            return "drafter_backoff"
        if drafter_error.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return "drafter_busy"
        if drafter_error.code == grpc.StatusCode.OUT_OF_RANGE:
            return "drafter_full"
    return "drafter_failed"
