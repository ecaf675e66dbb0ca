"""What the verifier's and the drafter's servicers share: their limits and the parts built from them.

A session server is one :class:`SessionLimits` turned into one ``ComputeThread`` (all model work, batched), one
``SessionRegistry`` (admission, idle expiry), one ``ServerMetrics`` and, with a budget, one ``PrefixCache``. A stream's
messages go through :meth:`SessionServicer._serve`: ``open``, the role's ``steps``, ``close``. Subclasses add the model.

Draining (SIGTERM): every answer says ``draining``, so a client that can reopen the session on another replica
(``orchestrator/decode/takeover.py``) ends it before its next step; sessions left near the end of ``--grace`` end with
UNAVAILABLE, which a take-over treats as a lost replica.

A session opened with ``progress_ms`` hears Progress while its step waits on a compute thread that gets work done, so
its client tells a slow server from a hung one (silence) without guessing how long a step may take.

**Round calls** (``VerifyRound``, ``DraftRound``: :func:`serve_round`) carry one round's steps for many sessions of one
caller in one call. Sessions still live and die with their ``Session`` stream; only the caller that opened a session may
name it (``SessionRegistry.find``); each item fails alone, as its own ``Error``.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass, field

import grpc

from kakeya.core.prefix import PrefixCache
from kakeya.runtime import admission, bounds, lifecycle
from kakeya.runtime.compute import DEFAULT_MAX_BATCH, ComputeThread, settle
from kakeya.runtime.lifecycle import RequestError, ServerSpec, bounded, invalid, precondition
from kakeya.runtime.metrics import ServerMetrics
from kakeya.runtime.security.auth import peer_of
from kakeya.runtime.security.guard import add_servicer

log = logging.getLogger("kakeya")
MIN_PROGRESS_S = 0.01  # the most often a stream hears Progress, whatever its client asks


def kv_usage(reserved: int, budget: int) -> float:
    """Reserved K/V bytes as a fraction of the budget admission counts against (0 without a budget)."""
    return min(1.0, reserved / budget) if budget else 0.0


@dataclass(frozen=True)
class SessionLimits:
    """A session server's limits: the ``serve verifier`` / ``serve drafter`` flags (``app/flags.session_limits``).
    0 means "none" for every byte, count and time limit below."""

    max_sessions: int = admission.DEFAULT_MAX_SESSIONS  # live sessions (streams) at once
    max_kv_bytes: int = 0  # cache bytes all live sessions may hold together
    queue: int = 0  # Opens that may wait for a free session
    queue_timeout_s: float = 0.0  # how long one may wait
    idle_timeout_s: float = admission.DEFAULT_IDLE_TIMEOUT_S  # a session whose client sends nothing this long ends
    max_per_peer: int = 0  # live sessions one peer may hold
    reclaim_idle_s: float = admission.DEFAULT_RECLAIM_IDLE_S  # when full, one idle this long is reclaimed for a new one
    max_context: int = 0  # positions a session may hold (0: the model's max_position_embeddings)
    max_batch: int = DEFAULT_MAX_BATCH  # queued steps of concurrent sessions run as one forward, up to this many
    prefix_cache_bytes: int = 0  # snapshots of finished sessions later prompts resume from


class SessionServicer:
    """The shared half of a verifier or drafter servicer (see the module docstring)."""

    role = ""  # "verifier" / "drafter": names its compute thread, metrics and errors
    kv_kinds: tuple[str, ...] = ()  # the kinds of cache bytes its sessions hold; the last is the default
    steps: tuple[str, ...] = ()  # a stream's request kinds between open and close, each ``_step_<kind>``

    def __init__(self, limits: SessionLimits = SessionLimits()):
        self.compute = ComputeThread(self.role, limits.max_batch)
        self.registry = admission.SessionRegistry(
            limits.max_sessions, limits.max_kv_bytes, limits.queue, limits.queue_timeout_s, limits.idle_timeout_s,
            max_per_peer=limits.max_per_peer, reclaim_idle_s=limits.reclaim_idle_s, close=self._close_session,
        )  # fmt: skip
        self.max_context_flag = limits.max_context  # load() bounds it by the model's own
        self.metrics = ServerMetrics(self.role)
        self.metrics.track_sessions(lambda: self.registry.live, lambda: self.registry.total)
        batches = ("compute_batches", "compute_batched_items")
        c = self.compute
        self.metrics.track_steps(
            batches, "batched compute calls (one forward each)", lambda: c.batches, lambda: c.batched_items
        )
        self.metrics.track_kv_bytes(
            lambda: dict.fromkeys(self.kv_kinds, 0) | self.registry.bytes_by_kind(self.kv_kinds[-1])
        )
        self.metrics.track_kv_usage(lambda: kv_usage(self.registry.reserved_bytes, self.registry.max_kv_bytes))
        self.round_calls = 0  # round calls served (``serve_round``) and the session steps they carried
        self.round_items = 0
        rounds = ("round_calls", "round_items")
        self.metrics.track_steps(rounds, "round calls served", lambda: self.round_calls, lambda: self.round_items)
        self.prefixes = PrefixCache(limits.prefix_cache_bytes) if limits.prefix_cache_bytes else None
        if self.prefixes is not None:
            self.metrics.track_prefix_cache(self.prefixes)
        self.ready = False  # set by run_server once load() has warmed the model up
        self.draining = False  # set on SIGTERM (``_drain``): every answer says so
        self.aux_dtype = 0  # the wire dtype of the aux hidden states, set by load()
        self.device = ""  # where the model runs, set by load()

    def _close_session(self, close) -> None:
        """A session's close, queued on the compute thread behind the steps already there, so it never lands
        inside a batch that holds the session beside others (their step must not fail with it)."""
        try:
            self.compute.submit(close)
        except RuntimeError:  # the compute thread is shut down: nothing runs any more, close at once
            close()

    def _inline_if_safe(self, backend: str) -> None:
        """Let a lone stream's steps run on its handler thread (``ComputeThread.inline``) where that was measured to
        pay: torch on a CPU (set by ``load``, after ``device``; see ``compute.py``)."""
        self.compute.inline = backend == "torch" and self.device == "cpu"

    def info(self):
        raise NotImplementedError

    def _open(self, entry, open_):
        """A generator (``yield from`` it): the session opened by ``open_`` as ``(stream state, Opened answer)``;
        the state is what the role's steps take."""
        raise NotImplementedError

    def _close(self, stream):
        """A generator: the ``Closed`` answer to ``stream``'s close (its final stats)."""
        raise NotImplementedError

    def _serve(self, entry, requests, context):
        """One Session stream's messages, answered in order: ``open`` first (``_open``), then the role's ``steps``
        (``_step_<kind>``), ``close`` last (``_close``), which ends the stream. Each answer carries its server-side time
        and, once the server drains, ``draining``; Progress messages come from the steps' waits (``_compute``)."""
        stream = None
        for req in requests:
            kind = req.WhichOneof("request")
            t0 = time.perf_counter()
            if stream is None:
                self._check_open(req, kind)
                if entry.queued:  # waits for a slot, hearing Progress as its open asks: no hung server to its client
                    admit = functools.partial(self.registry.open, entry.peer, entry)
                    yield from self._queued(self._progress_every(req.open), admit)
                    if entry.closed:  # its client left the queue
                        return
                stream, resp = yield from self._open(entry, req.open)
            elif kind == "close":
                resp = yield from self._close(stream)
            elif kind == "open":
                raise precondition("open: the session is already open")
            elif kind in self.steps:
                resp = yield from getattr(self, f"_step_{kind}")(stream, getattr(req, kind))
            else:
                raise invalid(f"request: no step set (open, {', '.join(self.steps)} or close)")
            resp.elapsed_s = time.perf_counter() - t0
            resp.draining = self.draining
            if kind == "close":  # the last answer: the call ended well, though its client may cancel it once read
                context.set_code(grpc.StatusCode.OK)
            yield resp
            if kind == "close":
                return

    def _round_step(self, entry, kind: str, step, every_s: float, runner):
        """A step round calls take too (``verify``, ``draft``) on the session's stream: one step of the session at
        a time, checked as a round item, batched with ``kind``'s ``runner`` (a generator: ``yield from`` it)."""
        slot = entry.round
        slot.take(kind)
        try:
            return (yield from self._compute_batch(every_s, kind, slot.check(step), runner))
        finally:
            slot.lock.release()

    def _drain(self) -> None:
        """SIGTERM (health is NOT_SERVING already): every answer from now on says ``draining``."""
        self.draining = True
        log.info("%s draining: %d live sessions move to other replicas at their next step", self.role,
                 self.registry.live)  # fmt: skip

    def _end_sessions(self) -> None:
        """The grace is almost over: the sessions still here end with UNAVAILABLE, which a take-over treats as
        a lost replica (another replica may be SERVING by now), rather than be cut with the process."""
        if n := self.registry.end_all(grpc.StatusCode.UNAVAILABLE, f"{self.role} is shutting down (draining)"):
            log.warning("%s: %d sessions still open at the end of the grace: ended (UNAVAILABLE)", self.role, n)

    def _progress(self, waited_s: float):
        """This role's Progress response (``waited_s``: how long the step in hand has waited so far)."""
        raise NotImplementedError

    @staticmethod
    def _progress_every(open_, field: str = "open.progress_ms") -> float:
        """Seconds between an opened session's Progress messages (``Open.progress_ms``; 0: none)."""
        ms = open_.progress_ms
        if ms < 0:
            raise invalid(f"{field} must be >= 0 (0: no progress messages), got {ms}")
        return max(ms / 1000, MIN_PROGRESS_S) if ms else 0.0

    def _await(self, future: Future, every_s: float):
        """A generator that returns ``future``'s result; meanwhile it yields a Progress message every ``every_s``
        seconds (0: none) in which the compute thread got work done: a wedged one gets none done, and its client's
        deadline for the step (``orchestrator/remote/deadlines.py``) runs out."""
        yield from self._await_all([future], every_s, self._progress)
        return future.result()

    def _await_all(self, futures: list[Future], every_s: float, progress):
        """A generator that returns once every one of ``futures`` is done, yielding ``progress(waited_s)``
        as :meth:`_await` does meanwhile (a round call's steps: ``serve_round``)."""
        if every_s > 0 and not all(f.done() for f in futures):
            first = last = self.compute.progress()
            while wait(futures, timeout=every_s).not_done:
                now = self.compute.progress()
                # the first look counts only finished jobs: a CPU rate from before this wait began would
                # speak of the work before it
                if now.done != first.done if last is first else now.since(last):
                    yield progress(now.at - first.at)
                last = now
        else:
            wait(futures)

    def _queued(self, every_s: float, admit, *args):
        """``admit(*args)``, which may wait in the ``--queue`` (bounded by ``--queue-timeout``), waited for on a thread of
        its own (``yield from`` it): meanwhile Progress every ``every_s`` s, the compute thread busy or not, since a
        session that waits its turn is no hung server to its client."""
        if not (every_s and self.registry.queue):
            return admit(*args)
        waiting, t0 = Future(), time.monotonic()
        run = functools.partial(settle, waiting, functools.partial(admit, *args))  # its refusal: ours to raise
        threading.Thread(target=run, name=f"{self.role}-queued", daemon=True).start()
        while wait([waiting], every_s).not_done:
            yield self._progress(time.monotonic() - t0)
        return waiting.result()

    def _compute(self, every_s: float, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` on the compute thread, waited for by :meth:`_await` (``yield from`` it)."""
        return (yield from self._await(self.compute.start(fn, *args, **kwargs), every_s))

    def _compute_batch(self, every_s: float, kind, item, runner):
        """``ComputeThread.start_batch``, waited for by :meth:`_await` (``yield from`` it)."""
        return (yield from self._await(self.compute.start_batch(kind, item, runner), every_s))

    @staticmethod
    def _check_open(req, kind: str | None) -> None:
        """A session stream's first message must be an ``open`` with a well-formed ``request_id``."""
        if kind != "open":
            raise precondition(f"the first message of a session must be open, got {kind or 'an empty request'}")
        try:
            bounds.check_request_id(req.open.request_id, "open.request_id")
        except ValueError as exc:
            raise invalid(str(exc)) from None

    def GetInfo(self, request, context):
        if not self.ready:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.role} is loading its model")
        return self.info()

    def Session(self, request_iterator, context):
        yield from lifecycle.session_stream(
            self.role, self.ready, self.registry, self._serve, request_iterator, context
        )

    def spec(self, service, load, *, tls=None, token: str | None = None, **spec) -> ServerSpec:
        """This servicer's ``ServerSpec``: registered through ``guard.add_servicer`` (``token``: the bearer token
        callers must present), ready once ``load`` loaded its model; ``spec``: more ``ServerSpec`` fields."""

        def set_ready(flag: bool) -> None:
            self.ready = flag

        workers = lifecycle.workers_for(self.registry.max_sessions, self.registry.queue)
        return ServerSpec(
            self.role, [service.full_name], lambda server: add_servicer(server, self, service, token),
            load, set_ready, before_drain=self._drain, near_deadline=self._end_sessions, max_workers=workers, tls=tls,
            metrics=self.metrics, busy=lambda: bool(self.registry.live or self.registry.waiting), **spec,
        )  # fmt: skip


@dataclass
class RoundSlot:
    """A session's standing for round calls (``SessionEntry.round``): ``check(step)`` turns one item's step
    message into a compute item, raising ``RequestError`` naming the step's field as its stream would;
    ``lock`` is held by whichever of the stream and a round call steps the session now."""

    check: Callable
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, what: str) -> None:
        if not self.lock.acquire(blocking=False):
            raise precondition(f"{what}: a step of this session is already in hand (one step at a time)")


@dataclass(frozen=True)
class RoundWire:
    """One role's round messages and ``answer_of`` (the runner's result -> the answer message). The runner is the one
    the role's streams use for the same step, so a round's items and streams' steps batch together on the compute
    thread."""

    response: type
    step: str
    answer: str
    progress: type
    answer_of: Callable = lambda result: result  # the verifier's runner answers protos already


def serve_round(servicer, wire: RoundWire, runner: Callable, request, context):
    """The body of a round RPC on ``servicer`` (a ``SessionServicer``): Progress messages, then one Done (which
    says ``draining`` once the server drains, as its streams' answers do)."""
    log = logging.getLogger(f"kakeya.{servicer.role}")
    if not servicer.ready:
        context.abort(grpc.StatusCode.UNAVAILABLE, f"{servicer.role} is loading its model")
    t0 = time.perf_counter()
    try:
        every = servicer._progress_every(request, "progress_ms")
        if not request.items:
            raise invalid("items: must not be empty")
        named = [it.session_id for it in request.items]
        if len(set(named)) != len(named):
            raise invalid("items.session_id: a session may be named once per round")
    except RequestError as exc:
        context.abort(exc.code, exc.message)
    servicer.round_calls += 1
    servicer.round_items += len(named)
    peer = peer_of(context)
    out: list = [None] * len(named)
    taken: list[tuple[int, object, RoundSlot]] = []  # (index, entry, slot) of the items sent to compute
    items = []
    for i, it in enumerate(request.items):
        where = f"items[{i}]"
        try:
            entry = servicer.registry.find(it.session_id, peer)
            if entry is None:
                raise RequestError(grpc.StatusCode.NOT_FOUND, f"{where}.session_id: no open session of this caller")
            slot = entry.round
            if slot is None:
                raise precondition(f"{where}.session_id: the session is not ready for a round step yet")
            slot.take(f"{where}.{wire.step}")
            try:
                items.append(slot.check(getattr(it, wire.step)))
            except BaseException:
                slot.lock.release()
                raise
            entry.last_active = time.monotonic()  # its client is working: not idle (SessionRegistry)
            taken.append((i, entry, slot))
        except RequestError as exc:
            out[i] = _error(wire, exc.code, exc.message, where)
    try:
        futures = servicer.compute.start_many(wire.step, items, runner)
        progress = servicer._await_all(
            futures, every, lambda waited: wire.response(progress=wire.progress(waited_s=waited))
        )
        yield from progress
    finally:
        for _, _, slot in taken:
            slot.lock.release()
    for (i, entry, _), future in zip(taken, futures):
        entry.last_active = time.monotonic()
        exc = future.exception()
        where = f"items[{i}]"
        if entry.closed:  # ended meanwhile: by its client (unread) or by this server (a drain: lost, to take over)
            out[i] = _error(wire, grpc.StatusCode.UNAVAILABLE, f"{where}.session_id: the session ended in the round")
        elif exc is None:
            out[i] = wire.response.Item(**{wire.answer: wire.answer_of(future.result())})
        elif isinstance(exc, RequestError):
            out[i] = _error(wire, exc.code, exc.message, where)
        else:
            log.error("round item %s (session %s) failed", where, entry.id, exc_info=exc)
            out[i] = _error(wire, grpc.StatusCode.INTERNAL, f"{where}: {type(exc).__name__}: {exc}")
    done = wire.response.Done(items=out)
    context.set_code(grpc.StatusCode.OK)  # the last answer: the call ended well, though its client may drop it
    yield wire.response(done=done, elapsed_s=time.perf_counter() - t0, draining=servicer.draining)


def _error(wire: RoundWire, code: grpc.StatusCode, message: str, where: str = ""):
    """An item's error answer; ``where`` (``items[i]``) prefixes a message that does not name it yet."""
    if where and not message.startswith(where):
        message = f"{where}.{message}"
    return wire.response.Item(error=wire.response.Error(code=code.value[0], message=bounded(message)))
