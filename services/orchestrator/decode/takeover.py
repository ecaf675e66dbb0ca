"""Take-over: a run whose verifier or drafter replica is lost mid-stream continues on another replica.

On a replica's loss (``BackendError.replica_lost``) the decode is parked (``Decode.lost``; its batch-mates go on) and
its request thread reopens it outside any round: both sessions aborted, a new verifier session on a SERVING replica
prefills prompt + committed tokens but the last (resuming its prefix cache), and a new drafter session takes that aux
with its first draft. Nothing committed changes, so greedy and coupled output equals the uninterrupted run's.

A try finding no replica waits (``BACKOFF_S``, doubling) ``TRIES`` times, then the run fails naming the role; a lost
drafter with no replica left leaves the verifier to finish alone. A constrained request is not taken over (its grammar
state lived in the lost session). Draining hand-offs (``drained``, not counted against ``MAX_PER_RUN``) and resumed
streams reopen the same way, a hand-off keeping its old sessions until the new ones hold the context (refused: it stays).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from kakeya.core.contract import drained
from kakeya.core.contract import replica_lost as lost

log = logging.getLogger("kakeya.orchestrator")

# Every ``run`` here is a ``decode.engine.Run`` (its sessions, request and decode; not imported: engine imports us).

TRIES = 6  # reopen attempts per loss: 0.1 + 0.2 + ... + 1.6 s of waiting, ~3 s for a replica to be found
BACKOFF_S = 0.1
MAX_PER_RUN = 8  # take-overs one run may take: a replica that keeps failing ends it rather than looping
HEALTH_TRIES = 3  # a health check right after a loss, or during a hang, may reach the lost replica once


def role_of(exc: BaseException) -> str:
    return getattr(exc, "service", "verifier")


def some_replica_serving(backend, tries: int = HEALTH_TRIES) -> bool:
    """Some replica answers SERVING in ``tries`` checks, each to the next replica (no health check: assumed)."""
    healthy = getattr(backend, "healthy", None)
    if healthy is None:
        return True
    for k in range(tries):
        if healthy(1.0):
            return True
        if k + 1 < tries:
            time.sleep(BACKOFF_S * 2**k)
    return False


def _reopen_once(run, ids: Sequence[int], drafter: bool, handoff: bool):
    """Open new sessions and prefill ``ids``: ``(first, aux, cached)``. The old ones are aborted (their servers free
    them) first, or for a drain's ``handoff`` once the new ones hold the context: a refused one leaves them in place."""
    kept = run.drafter_session, run.verifier_session
    old = [s for s in kept if s is not None]
    for session in () if handoff else old:
        session.abort()
    e, new = run._engine, []
    try:
        run.verifier_session = e.verifier.open_session(run.request.cache_policy, run._sampling, run._session_options)
        run.drafter_session = None
        new.append(run.verifier_session)
        if drafter:
            run.drafter_session = e.drafter.open_session_now(run._sampling, run._session_options)  # past the backoff
            new.append(run.drafter_session)
        steps = run._prefill_steps(ids)
        while (done := run._chunk(steps)) is None:  # the drafter resumes the same cached prefix
            pass
    except BaseException:
        if handoff:
            for session in new:
                session.abort()
            run.drafter_session, run.verifier_session = kept
        raise
    for session in old if handoff else ():
        session.abort()
    return done


def reopen(run, ids: Sequence[int], cause: BaseException, handoff: bool = False):
    """Reopen ``run``'s sessions on SERVING replicas and prefill ``ids``, trying ``TRIES`` times: ``(first, aux,
    cached)``; a drafter only if one was lost or in use and a replica of it answers (else the verifier alone)."""
    decode = run._decode
    want_drafter = run._engine.drafter is not None and (role_of(cause) == "drafter" or run.drafter_session is not None)
    if decode is not None and not decode.drafting and role_of(cause) != "drafter":
        want_drafter = False  # it already finished on the verifier alone
    if want_drafter and not some_replica_serving(run._engine.drafter):
        _verifier_alone(run, cause)
        want_drafter = False
    last = cause
    for k in range(TRIES):
        if run.cancelled:  # the client went away meanwhile: the run just ends
            raise last
        try:
            return _reopen_once(run, ids, want_drafter, handoff)
        except Exception as exc:  # a loss tries again; anything else is the run's failure
            if not lost(exc):
                raise
            last = exc
            if k + 1 < TRIES:
                time.sleep(BACKOFF_S * 2**k)
    log.warning("request %s: no %s replica took the session over after %d tries", run.request.request_id or "-",
                role_of(last), TRIES)  # fmt: skip
    raise last


def _verifier_alone(run, cause: BaseException) -> None:
    """No drafter replica answers: the verifier goes on alone, or a drafter's loss fails a run without fallback."""
    if role_of(cause) == "drafter" and not run._options.drafter_fallback:
        raise cause
    if run._decode is not None:
        run._decode.drafter_error, run._decode.generation.drafter_fallback = cause, True
    log.warning("request %s: no drafter replica answers; the verifier goes on alone", run.request.request_id or "-")


def reprefill(run, cause: BaseException):
    """The run's first prefill lost its replica: the same prefill on another one (``(first, aux, cached)``)."""
    log.warning("request %s: %s lost before its first token (%s); taking the session over",
                run.request.request_id or "-", role_of(cause), cause)  # fmt: skip
    t0 = time.perf_counter()
    done = reopen(run, run._context(), cause)
    decode = run._decode
    decode.verifier, decode.drafter = run.verifier_session, run.drafter_session
    decode.drafting = decode.drafting and run.drafter_session is not None
    run.takeovers.append((role_of(cause), time.perf_counter() - t0))
    if run._on_takeover is not None:  # in the metrics as the take-overs after the first token
        run._on_takeover(*run.takeovers[-1], drained(cause))
    return done


def take_over(run) -> None:
    """Reopen ``run``'s parked decode (``Decode.lost``) on other replicas and let it rejoin the rounds."""
    decode = run._decode
    cause = decode.lost
    handoff = drained(cause)
    if not handoff:
        run.takeovers.append((role_of(cause), 0.0))
        if len(run.takeovers) > MAX_PER_RUN:
            raise cause
    gen = decode.generation
    if role_of(cause) == "drafter" and not some_replica_serving(run._engine.drafter):
        _verifier_alone(run, cause)  # its verifier session, untouched (the round verified nothing), goes on
        decode.drafting, decode.lost = False, None
        return
    log.log(logging.INFO if handoff else logging.WARNING, "request %s: %s %s after %d tokens (%s); taking the"
            " session over", run.request.request_id or "-", role_of(cause), "draining" if handoff else "lost",
            len(gen.token_ids), cause)  # fmt: skip
    try:
        _first, aux, _cached = reopen(run, gen.prompt_ids + gen.token_ids[:-1], cause, handoff)
    except Exception as exc:
        if not handoff:
            raise
        _stay(run, cause, exc)
        return
    pause = time.perf_counter() - decode.lost_at
    if not handoff:
        run.takeovers[-1] = (role_of(cause), pause)
    decode.reopened(run.verifier_session, run.drafter_session, aux)
    if run._on_takeover is not None:
        run._on_takeover(role_of(cause), pause, handoff)


def _stay(run, cause: BaseException, refused: Exception) -> None:
    """A drain's hand-off found no room elsewhere (say, every other replica at its --max-sessions during a rolling
    update): the session finishes where it is, within that server's grace, as one with nowhere to go does. A
    drafter's session broke on the hand-off: the verifier goes on alone (or the run fails without the fallback)."""
    log.info("request %s: no other %s replica took the session (%s); it stays on the draining one",
             run.request.request_id or "-", role_of(cause), refused)  # fmt: skip
    decode = run._decode
    if role_of(cause) == "drafter":
        _verifier_alone(run, cause)
        decode.drafting = False
    decode.proposal, decode.lost = None, None  # last: the next round plans its block afresh
