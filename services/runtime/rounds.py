"""Round calls: one call carries a round's steps for many sessions of one caller (``VerifyRound``, ``DraftRound``).

A continuous-batching orchestrator steps its sessions in rounds (``orchestrator/decode/scheduler.py``): one call
instead of N messages and wake-ups per backend. Sessions still live and die with their ``Session`` stream; an
item names a session by the id its ``Opened`` answered, and only the caller that opened it may
(``SessionRegistry.find``). The items go to the compute thread at once, as one batch; each fails alone, as its
own ``Error``. While a round waits the caller hears Progress as a stream's step does.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from kakeya.runtime.lifecycle import RequestError, bounded, invalid, precondition
from kakeya.runtime.security.auth import peer_of


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
    """One role's round messages: ``response`` (VerifyRoundResponse / DraftRoundResponse), the field of an
    item's step (``verify`` / ``draft``) and of its answer (``verified`` / ``drafted``), the Progress message;
    ``answer_of`` turns the runner's result into the answer message. The runner is the one the role's streams
    use for the same step (their results: the same type), so a round's items and streams' steps batch
    together on the compute thread (``ComputeThread``: a group shares one runner)."""

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
        if entry.closed:  # cancelled or closed while its step was in hand: its own error, nobody reads it
            out[i] = _error(wire, grpc.StatusCode.CANCELLED, f"{where}.session_id: the session ended during the round")
        elif exc is None:
            out[i] = wire.response.Item(**{wire.answer: wire.answer_of(future.result())})
        elif isinstance(exc, RequestError):
            out[i] = _error(wire, exc.code, exc.message, where)
        else:
            log.error("round item %s (session %s) failed", where, entry.id, exc_info=exc)
            out[i] = _error(wire, grpc.StatusCode.INTERNAL, f"{where}: {type(exc).__name__}: {exc}")
    done = wire.response.Done(items=out)
    yield wire.response(done=done, elapsed_s=time.perf_counter() - t0, draining=servicer.draining)


def _error(wire: RoundWire, code: grpc.StatusCode, message: str, where: str = ""):
    """An item's error answer; ``where`` (``items[i]``) prefixes a message that does not name it yet."""
    if where and not message.startswith(where):
        message = f"{where}.{message}"
    return wire.response.Item(error=wire.response.Error(code=code.value[0], message=bounded(message)))
