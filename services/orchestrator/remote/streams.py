"""The streams under the gRPC Verifier / Drafter clients (``remote/verifier.py``): channels, errors, one Session call.

A backend's channel reconnects fast and balances sessions over its replicas
(client-side health checking); a call's failure is a :class:`BackendError`
with the gRPC status; :class:`Stream` is one bidirectional ``Session`` call,
its requests queued (pipelined: ``post`` returns the request's :class:`Reply`)
and its responses read strictly in order, each into its reply, when that reply
or a later one is waited for, each step bounded by a deadline from
``remote/deadlines.py`` that every Progress message the backend sends meanwhile
re-arms. So a drafter session sends a ``Predraft`` right after a ``Draft``'s
answer and reads it a block later.

A replica that drains (SIGTERM) says so in every answer (``draining``); a stream told so that may move
(``elsewhere``: its caller takes sessions over, ``decode/takeover.py``) fails its next step at once with a
``BackendError`` marked ``drained`` -- a replica's loss to the take-over, counted apart -- while another
replica answers SERVING (:class:`Replicas`); with none, it goes on where it is and finishes within the
server's grace.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable

import grpc

from kakeya.orchestrator.remote.deadlines import WATCHDOG
from kakeya.wire.limits import channel_options

# A backend that restarts is found again within ~2 s (gRPC's default backoff grows to 120 s).
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


# Sessions are streams, so balancing is per session: a target that resolves to several replicas
# (``dns:///verifier-headless:50061``, ``ipv4:10.0.0.1:50061,10.0.0.2:50061``) gets each new
# session on the next replica; only replicas whose gRPC health says SERVING are picked, so one
# that is loading or draining gets none (client-side health checking).
BALANCE_OPTIONS = [
    ("grpc.service_config", '{"loadBalancingConfig": [{"round_robin": {}}], "healthCheckConfig": {"serviceName": ""}}'),
]


def backend_channel(addr: str, tls=None, token: str | None = None) -> grpc.Channel:
    """A channel to a verifier or drafter; ``tls``: a ``kakeya.runtime.security.tls.ClientTLS`` (None: plaintext);
    ``token``: the bearer token the backend requires (``--backend-token-file``), sent on every call."""
    from kakeya.runtime.security.auth import with_bearer
    from kakeya.runtime.security.tls import channel

    return with_bearer(channel(addr, tls, channel_options() + RECONNECT_OPTIONS + BALANCE_OPTIONS), token)


def backend_healthy(channel: grpc.Channel, timeout: float = 1.0) -> bool:
    """The backend answers its health check with SERVING within ``timeout``."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        r = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
    except grpc.RpcError:
        return False
    return r.status == health_pb2.HealthCheckResponse.SERVING


class Replicas:
    """Whether a backend has a replica that answers SERVING, asked at most every ``every_s``: all of a draining
    replica's sessions ask at their next step. The channel balances over SERVING replicas only (client-side
    health checking), and a draining one says NOT_SERVING or takes no call, so it never answers yes itself."""

    def __init__(self, channel: grpc.Channel, every_s: float = 0.25, timeout_s: float = 0.5):
        self.channel, self.every_s, self.timeout_s = channel, every_s, timeout_s
        self._lock = threading.Lock()
        self._at, self._ok = -1e9, False

    def serving(self) -> bool:
        with self._lock:
            if time.monotonic() - self._at >= self.every_s:
                self._ok = backend_healthy(self.channel, self.timeout_s)
                self._at = time.monotonic()
            return self._ok


class BackendError(RuntimeError):
    """A call to a verifier or drafter failed; ``code`` is its ``grpc.StatusCode``.

    ``step_timeout``: the backend did not answer one step within its deadline (hung, not merely slow).
    ``drained``: its replica drains and another serves: the session moves (a replica's loss that is no failure).
    """

    def __init__(
        self,
        service: str,
        addr: str,
        code: grpc.StatusCode,
        details: str,
        step_timeout: bool = False,
        skipped: bool = False,
        drained: bool = False,
    ):
        super().__init__(f"{service} at {addr}: {code.name}: {details}")
        self.service, self.addr, self.code, self.details = service, addr, code, details
        self.step_timeout = step_timeout
        self.skipped = skipped  # never called: the drafter was backing off after earlier failures
        self.drained = drained

    @property
    def ended_by_caller(self) -> bool:
        """Our side ended the call (the client cancelled, or its deadline passed): not the backend's failure."""
        return self.code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED) and not self.step_timeout

    @property
    def replica_lost(self) -> bool:
        """The replica serving the session is gone (unreachable, its stream broken, hung): another replica of
        the role may take the session over (``decode/takeover.py``); never a refusal, nor our own end."""
        if self.ended_by_caller or self.skipped:
            return False
        return self.code == grpc.StatusCode.UNAVAILABLE or self.step_timeout or self.details.startswith("stream ended")

    @classmethod
    def of(cls, service: str, addr: str, exc: grpc.RpcError) -> BackendError:
        code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
        details = exc.details() if hasattr(exc, "details") else str(exc)
        return cls(service, addr, code or grpc.StatusCode.UNKNOWN, details or "")


def call_unary(service: str, addr: str, fn, request, timeout: float | None, wait: bool = False):
    try:
        return fn(request, timeout=timeout, wait_for_ready=wait)
    except grpc.RpcError as exc:
        raise BackendError.of(service, addr, exc) from None


def fetch_info(service: str, addr: str, fn, request, wait_s: float | None):
    """GetInfo; with ``wait_s``, keep trying (backend not up yet, or still loading) for that long."""
    if not wait_s:
        return call_unary(service, addr, fn, request, 10.0)
    deadline = time.monotonic() + wait_s
    while True:
        left = deadline - time.monotonic()
        try:
            return call_unary(service, addr, fn, request, max(0.1, left), wait=True)
        except BackendError as exc:
            if exc.code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise
            if left <= 0.5:
                raise BackendError(
                    service, addr, grpc.StatusCode.UNAVAILABLE, f"not ready within {wait_s:g} s (last: {exc.details})"
                ) from None
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


_END = object()
_ENDING = ("saved", "closed")  # a generation's last steps: they may go to a draining replica


class Reply:
    """The answer to one posted request, read in turn when it or a later one is waited for."""

    __slots__ = ("expect", "response")

    def __init__(self, expect: str):
        self.expect, self.response = expect, None


class Stream:
    """One bidi Session call: requests are queued, responses read strictly in order, each into its reply."""

    def __init__(
        self,
        method,
        service: str,
        addr: str,
        timeout: float | None,
        request_id: str,
        elsewhere: Callable[[], bool] | None = None,
    ):
        self.service, self.addr = service, addr
        # () -> whether another replica serves: a draining one's session moves there (None: it never moves)
        self.elsewhere = elsewhere
        self.draining = False  # the server said it drains (an answer's ``draining``)
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._replies: deque[Reply] = deque()
        metadata = (("x-request-id", request_id),) if request_id else None
        self._call = method(iter(self._requests.get, _END), timeout=timeout, metadata=metadata)
        self.deadline = time.monotonic() + timeout if timeout is not None else None  # the client's, if any
        self.done = False
        self.expired = 0.0  # the step deadline that passed (seconds), 0 while none did
        self.progress = 0  # Progress messages read (each re-armed the deadline of the step read then)
        self.bytes_sent = 0
        self.bytes_received = 0

    def post(self, request, expect: str) -> Reply:
        if self.done:
            raise BackendError(self.service, self.addr, grpc.StatusCode.CANCELLED, "session is closed")
        if self.draining and expect not in _ENDING and self.elsewhere is not None and self.elsewhere():
            self.abort()  # its server frees the session now: it exits once none is left
            raise BackendError(
                self.service, self.addr, grpc.StatusCode.UNAVAILABLE,
                "replica draining (shutting down): the session moves to another replica", drained=True,
            )  # fmt: skip
        self.bytes_sent += request.ByteSize()
        reply = Reply(expect)
        self._replies.append(reply)
        self._requests.put(request)
        return reply

    def wait(self, reply: Reply, step_timeout: float | None = None):
        """``reply``'s response; the answers to requests posted before it are read first (into their replies)."""
        while reply.response is None:
            first = self._replies.popleft()
            first.response = self._read(first.expect, step_timeout)
        return reply.response

    def _read(self, expect: str, step_timeout: float | None):
        """The next answer; Progress messages before it are counted and each re-arms ``step_timeout``."""
        key, heard = None, 0

        def expire(t=step_timeout):
            self.expired = t
            self.abort()

        try:
            while True:
                if step_timeout is not None:
                    key = WATCHDOG.arm(step_timeout, expire)
                resp = next(self._call)
                if resp.WhichOneof("response") != "progress":
                    break
                heard += 1
                self.progress += 1
                self.bytes_received += resp.ByteSize()
                if key is not None:
                    WATCHDOG.disarm(key)
        except StopIteration:
            self.abort()
            raise BackendError(
                self.service, self.addr, grpc.StatusCode.INTERNAL, f"stream ended before {expect}"
            ) from None
        except grpc.RpcError as exc:
            self.abort()
            if self.expired:
                raise BackendError(
                    self.service,
                    self.addr,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"no {expect} answer or progress for {self.expired:.1f} s, after {heard} progress"
                    " messages (hung? see --backend-timeout)",
                    step_timeout=True,
                ) from None
            raise BackendError.of(self.service, self.addr, exc) from None
        finally:
            if key is not None:
                WATCHDOG.disarm(key)
        self.bytes_received += resp.ByteSize()
        self.draining = self.draining or resp.draining
        got = resp.WhichOneof("response")
        if got != expect:
            self.abort()
            raise BackendError(self.service, self.addr, grpc.StatusCode.INTERNAL, f"expected {expect}, got {got}")
        return resp

    def ask(self, request, expect: str, step_timeout: float | None = None):
        return self.wait(self.post(request, expect), step_timeout)

    def finish(self, request, expect: str, step_timeout: float | None = None):
        """Polite end: send ``request``, half-close, read the answer; never raises."""
        if self.done:
            return None
        try:
            resp = self.ask(request, expect, step_timeout)
        except BackendError:
            return None
        finally:
            self.abort()
        return resp

    def abort(self) -> None:
        """Cancel the call (the server frees the session); idempotent, any thread."""
        if not self.done:
            self.done = True
            self._requests.put(_END)  # unblocks gRPC's request-reading thread
        self._call.cancel()


_CODES = {c.value[0]: c for c in grpc.StatusCode}


def status_code(value: int) -> grpc.StatusCode:
    """A wire status code (a round item's ``Error.code``) as a ``grpc.StatusCode``."""
    return _CODES.get(value, grpc.StatusCode.UNKNOWN)


def round_deadline(streams) -> float | None:
    """A round call's gRPC timeout: until the latest of its sessions' client deadlines (None: one has none);
    a session whose own deadline passes first is aborted on its stream and its item fails alone."""
    deadlines = [s.deadline for s in streams]
    if any(d is None for d in deadlines):
        return None
    return max(0.0, max(deadlines) - time.monotonic())


def call_round(method, request, service: str, addr: str, step_timeout: float, timeout: float | None):
    """A round call (``VerifyRound`` / ``DraftRound``): its ``Done`` message, after the Progress messages that
    each re-arm ``step_timeout`` (a deadline of silence, as a stream's step: ``Stream._read``)."""
    call = method(request, timeout=timeout)
    expired = []
    heard = 0
    try:
        while True:
            key = WATCHDOG.arm(step_timeout, lambda: (expired.append(step_timeout), call.cancel()))
            try:
                resp = next(call)
            finally:
                WATCHDOG.disarm(key)
            if resp.WhichOneof("response") != "progress":
                break
            heard += 1
    except StopIteration:
        raise BackendError(service, addr, grpc.StatusCode.INTERNAL, "round call ended before done") from None
    except grpc.RpcError as exc:
        if expired:
            raise BackendError(
                service, addr, grpc.StatusCode.DEADLINE_EXCEEDED,
                f"no round answer or progress for {expired[0]:.1f} s, after {heard} progress messages"
                " (hung? see --backend-timeout)", step_timeout=True,
            ) from None  # fmt: skip
        raise BackendError.of(service, addr, exc) from None
    if resp.WhichOneof("response") != "done" or len(resp.done.items) != len(request.items):
        raise BackendError(service, addr, grpc.StatusCode.INTERNAL, "round call answered out of protocol")
    return resp
