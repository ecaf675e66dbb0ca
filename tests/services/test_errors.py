"""Error texts: bounded whatever a client sent, and public ones free of internal details (no servers)."""

from __future__ import annotations

import grpc

from kakeya.runtime.lifecycle import MAX_ERROR_CHARS, RequestError, bounded


def test_request_errors_are_bounded():
    long = "open.target_layer_ids: " + str(list(range(10_000)))
    err = RequestError(grpc.StatusCode.INVALID_ARGUMENT, long)
    assert len(err.message) == MAX_ERROR_CHARS and err.message.startswith("open.target_layer_ids: [0, 1, 2")
    assert err.message.endswith("(truncated)") and str(err) == err.message
    assert bounded("short") == "short"
