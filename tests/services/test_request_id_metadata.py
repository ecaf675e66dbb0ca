"""The request id a server's log lines carry is checked wherever it comes from (no servers).

A verifier checks ``open.request_id`` (printable ASCII without whitespace, at most 128 characters), but its log lines
carried the ``x-request-id`` metadata of the call instead, unchecked: a caller of the internal port sent
``evil] INFO forged [request_id=x yyy...`` (3,000 characters) and every line of its session read as forged tags.
The interceptor that binds the id for every server (the public one too) now binds a well-formed id only.
"""

from __future__ import annotations

import contextvars
import logging

import grpc

from kakeya.runtime import logs
from kakeya.runtime.metrics import RpcInterceptor, ServerMetrics


def _bound_id(metadata) -> str:
    """The request id the log lines of a unary call with ``metadata`` carry."""
    seen = []

    def handler(request, context):
        record = logging.LogRecord("t", logging.INFO, __file__, 1, "msg", (), None)
        logs.ContextFilter().filter(record)
        seen.append(record.request_id)

    details = type("Details", (), {"invocation_metadata": tuple(metadata), "method": "/x/Y"})()
    context = type("Context", (), {"code": lambda self: None})()
    wrapped = RpcInterceptor(ServerMetrics("verifier")).intercept_service(
        lambda _: grpc.unary_unary_rpc_method_handler(handler), details
    )
    contextvars.Context().run(wrapped.unary_unary, object(), context)  # as a server's fresh pool thread: nothing bound
    return seen[0]


def test_a_malformed_x_request_id_never_tags_a_log_line():
    assert _bound_id([("x-request-id", "abc-123")]) == "abc-123"  # a well-formed one names the call's lines
    for bad in ("evil] INFO forged [request_id=x", "y" * 3000, "a b", ""):
        assert _bound_id([("x-request-id", bad)]) == "", bad
