"""What a public caller is told when its request fails, and why a generation lost its drafter.

A backend's error (:class:`~kakeya.orchestrator.remote.streams.BackendError`) carries
the backend's address and the backend's field names (``open.cache_policy``,
``verify.block_ids``); a public caller knows neither. :func:`public_status`
keeps the status code, names the service ("verifier"), turns the fields a
public request sets into the public names (``open.cache_policy.window`` ->
``cache_policy.window``) and replaces everything else with a short reason; the
whole error goes to the orchestrator's log, the operator's side. Every front
(the gRPC Generate API, an HTTP one) answers through it.
"""

from __future__ import annotations

import logging

import grpc

from kakeya.orchestrator.remote.streams import BackendError
from kakeya.runtime.lifecycle import RequestError, bounded

log = logging.getLogger("kakeya.orchestrator")

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

# Statuses whose backend message is about capacity or the session's fate (no fields, no addresses).
_CAPACITY = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED)
# Statuses about a request's values (FAILED_PRECONDITION is about the session protocol: ours, never the caller's).
_REFUSED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE)


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
    return (
        grpc.StatusCode.INTERNAL,
        f"internal error ({type(exc).__name__}); the orchestrator's log has request {request_id or '-'}",
    )


def _backend_status(exc: BackendError) -> tuple[grpc.StatusCode, str]:
    service, code = exc.service, exc.code
    if code in _CAPACITY:
        return code, bounded(f"{service}: {exc.details}")
    if code in _REFUSED:
        details = exc.details
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
    ``drafter_failed`` (an error, a hang, unreachable), ``drafter_backoff`` (skipped after earlier
    failures), ``drafter_busy`` (it refused for capacity). None when it did not fall back, or when
    the client's own cancel or deadline ended the drafter's stream: never the drafter's failure."""
    if drafter_error is None or cancelled:
        return None
    if isinstance(drafter_error, BackendError):
        if drafter_error.ended_by_caller:
            return None
        if drafter_error.skipped:
            return "drafter_backoff"
        if drafter_error.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return "drafter_busy"
    return "drafter_failed"
