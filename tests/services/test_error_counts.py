"""A backend's ``kakeya_errors_total`` counts the calls that failed, not the calls that ended well.

The orchestrator lets go of a drafter's or verifier's call once it has read its last answer: it cancels a session
stream after the ``closed`` answer (``remote/streams.py``, ``Stream.finish``) and drops a round call after its
``done`` (gRPC cancels it when collected). When that cancel reaches the server before its handler has returned,
gRPC closes the handler's generator (a ``GeneratorExit`` in it), which :class:`RpcInterceptor` counted as
``CANCELLED`` (on ``serve all`` under 9 streams the drafter counted 75 errors and the verifier 23, every request
having succeeded): the servers now set the call's status to OK before its last answer. Driven here the way gRPC drives the handlers, without the race: the generator closed once its
last answer is read.
"""

from __future__ import annotations

import grpc
import pytest

from kakeya.runtime.metrics import RpcInterceptor
from kakeya.wire.kakeya.v1 import drafter_pb2

from .conftest import in_process_mlx_pair

D = drafter_pb2.DrafterRequest


@pytest.fixture(scope="module")
def drafter(tiny_pair, aux_layers):
    for served in in_process_mlx_pair(tiny_pair, aux_layers):
        yield served["drafter"]


class _Context:
    """What gRPC hands a handler, as far as the session servers and the interceptor read it."""

    def __init__(self):
        self._code = None

    def peer(self):
        return "ipv4:127.0.0.1:40000"

    def invocation_metadata(self):
        return ()

    def add_callback(self, callback):
        return True

    def code(self):
        return self._code

    def set_code(self, code):
        self._code = code

    def abort(self, code, details):
        raise AssertionError(f"aborted: {code} {details}")


def _call(servicer, method, request):
    """``method``'s handler on ``servicer``, through the server's interceptor: the generator gRPC iterates."""
    kind = "unary_stream" if method == "DraftRound" else "stream_stream"
    handler = getattr(grpc, f"{kind}_rpc_method_handler")(getattr(servicer, method))
    details = type("Details", (), {"invocation_metadata": (), "method": method})()
    wrapped = RpcInterceptor(servicer.metrics).intercept_service(lambda _: handler, details)
    return getattr(wrapped, kind)(request, _Context())


def _errors(servicer) -> float:
    return sum(s.value for m in servicer.metrics.errors.collect() for s in m.samples if s.name.endswith("_total"))


def test_a_call_let_go_of_after_its_last_answer_is_no_error(drafter):
    before = _errors(drafter)
    stream = _call(drafter, "Session", iter([D(open=D.Open()), D(close=D.Close())]))
    assert [next(stream).WhichOneof("response") for _ in range(2)] == ["opened", "closed"]
    stream.close()  # its client cancelled once it read "closed", before the handler returned
    round_call = _call(drafter, "DraftRound", drafter_pb2.DraftRoundRequest(items=[{"session_id": "gone"}]))
    assert next(round_call).WhichOneof("response") == "done"
    round_call.close()  # dropped after its done (the orchestrator reads no further)
    assert _errors(drafter) == before


def test_a_call_cancelled_before_its_last_answer_is_counted(drafter):
    before = _errors(drafter)
    stream = _call(drafter, "Session", iter([D(open=D.Open()), D(close=D.Close())]))
    assert next(stream).WhichOneof("response") == "opened"
    stream.close()  # its client went away mid-session
    assert _errors(drafter) == before + 1
