"""The streams under the gRPC Verifier / Drafter clients: channels, errors, one Session call, round calls.

A backend's channel reconnects fast and balances sessions over its SERVING replicas; a failure is a
:class:`BackendError` with the gRPC status; :class:`Stream` is one ``Session`` call, requests pipelined (``post``
returns a :class:`Reply`), responses read in order, each step bounded by a deadline of silence that every Progress
re-arms. :class:`RemoteBackend` is what the two clients share: channel, GetInfo, health, round calls.

A stream that may move (``elsewhere``) fails its next step after a draining answer with a ``BackendError`` marked
``drained`` while another replica answers SERVING (:class:`Replicas`); with none, it finishes where it is.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable

import grpc

from kakeya.orchestrator.remote.deadlines import WATCHDOG, StepClock
from kakeya.wire.limits import channel_options

# A backend that restarts is found again within ~2 s (gRPC's default backoff grows to 120 s).
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


# Balancing is per session (sessions are streams): a target that resolves to several replicas gets each new
# session on the next one whose gRPC health says SERVING (client-side health checking).
BALANCE_OPTIONS = [
    ("grpc.service_config", '{"loadBalancingConfig": [{"round_robin": {}}], "healthCheckConfig": {"serviceName": ""}}'),
]


def backend_channel(addr: str, tls=None, token: str | None = None) -> grpc.Channel:
    """A channel to a verifier or drafter; ``tls``: a ``kakeya.runtime.security.tls.ClientTLS`` (None: plaintext);
    ``token``: the bearer token the backend requires (``--backend-token-file``), sent on every call."""
    from kakeya.runtime.security.auth import with_bearer
    from kakeya.runtime.security.tls import channel

    return with_bearer(channel(addr, tls, channel_options(backend=True) + RECONNECT_OPTIONS + BALANCE_OPTIONS), token)


def backend_healthy(channel: grpc.Channel, timeout: float = 1.0) -> bool:
    """The backend answers its health check with SERVING within ``timeout``."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        r = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
    except grpc.RpcError:
        return False
    return r.status == health_pb2.HealthCheckResponse.SERVING


class Replicas:
    """Whether a backend has a replica that answers SERVING (a draining one never does), asked at most every
    ``every_s``: all of a draining replica's sessions ask at their next step."""

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
    """A call to a verifier or drafter failed; ``code``: its ``grpc.StatusCode``; ``step_timeout``: a step
    met its deadline of silence (hung); ``drained``: its replica drains and another serves (the session moves)."""

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
        """The replica serving the session is gone (unreachable, broken stream, hung): another may take over."""
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
    deadline = time.monotonic() + (wait_s or 0)
    while True:
        left = deadline - time.monotonic()
        try:
            return call_unary(service, addr, fn, request, max(0.1, left) if wait_s else 10.0, wait=bool(wait_s))
        except BackendError as exc:
            if exc.code == grpc.StatusCode.UNAUTHENTICATED:  # our credentials: say which flag sets them
                raise BackendError(service, addr, exc.code, f"{exc.details} (--backend-token-file)") from None
            if not wait_s or exc.code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise
            if left <= 0.5:
                why = f"not ready within {wait_s:g} s (last: {exc.details})"
                raise BackendError(service, addr, grpc.StatusCode.UNAVAILABLE, why) from None
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
        self.progress = 0  # Progress messages read (each re-armed the deadline of the step read then)
        self.bytes_sent = 0
        self.bytes_received = 0

    def post(self, request, expect: str) -> Reply:
        if self.done:
            raise BackendError(self.service, self.addr, grpc.StatusCode.CANCELLED, "session is closed")
        if self.draining and expect not in _ENDING and self.elsewhere is not None and self.elsewhere():
            self.elsewhere = None  # asked once: the take-over aborts it once moved, or it stays (refused elsewhere)
            why = "replica draining (shutting down): the session moves to another replica"
            raise BackendError(self.service, self.addr, grpc.StatusCode.UNAVAILABLE, why, drained=True)
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
        """The next answer, after the Progress messages that each re-arm ``step_timeout``."""

        def progress(resp) -> None:
            self.progress += 1
            self.bytes_received += resp.ByteSize()

        try:
            ended = f"stream ended before {expect}"
            resp = heard_from(self._call, self.service, self.addr, expect, ended, step_timeout, self.abort, progress)
        except BackendError:
            self.abort()
            raise
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
            return self.ask(request, expect, step_timeout)
        except BackendError:
            return None
        finally:
            self.abort()

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


def heard_from(call, service: str, addr: str, what: str, ended: str, step_timeout, cancel, on_progress=None):
    """The next message of ``call`` that is no Progress; each Progress re-arms ``step_timeout``, a deadline of
    silence whose expiry ``cancel``s the call (a BackendError marked ``step_timeout``: hung, not slow)."""
    expired, heard, key = [], 0, None

    def expire() -> None:
        expired.append(step_timeout)
        cancel()

    try:
        while True:
            if step_timeout is not None:
                key = WATCHDOG.arm(step_timeout, expire)
            try:
                resp = next(call)
            finally:
                if key is not None:
                    WATCHDOG.disarm(key)
            if resp.WhichOneof("response") != "progress":
                return resp
            heard += 1
            if on_progress is not None:
                on_progress(resp)
    except StopIteration:
        raise BackendError(service, addr, grpc.StatusCode.INTERNAL, ended) from None
    except grpc.RpcError as exc:
        if expired:
            raise BackendError(
                service, addr, grpc.StatusCode.DEADLINE_EXCEEDED,
                f"no {what} answer or progress for {expired[0]:.1f} s, after {heard} progress messages"
                " (hung? see --backend-timeout)", step_timeout=True,
            ) from None  # fmt: skip
        raise BackendError.of(service, addr, exc) from None


ROUND_MIN = 2  # sessions of one backend in a round before their steps travel in one round call
_ON_STREAM = object()  # a round item the server did not find: sent again on the session's own stream
# The round call itself found no replica (the one it reached died): each item goes on its own stream this round,
# so only the sessions that were on the lost replica fail (and are taken over), not every session in the call.
_RETRY_ON_STREAM = object()


def _alone(call, *args):
    """``call(*args)``, its exception its result (one session's failure is its own)."""
    try:
        return call(*args)
    except Exception as exc:  # noqa: BLE001 - its own failure, its result alone
        return exc


class RemoteBackend:
    """What the gRPC verifier and drafter clients share: channel, step clock, stub, the server's GetInfo (``remote``),
    health, and a round's steps (:meth:`batch`), served by their sessions' ``_post``/``_finish``/``_answer`` hooks."""

    role = ""  # "verifier" | "drafter": what its errors name
    info_request: type  # its GetInfo request
    round_request: type  # its round call's request
    round_rpc, step, answer = "", "", ""  # its round call, a round item's step field and its answer's

    def __init__(self, addr: str, stub_class, wait_s, channel, tls, token, clock, remote=None):
        self.addr = addr
        self.channel = channel or backend_channel(addr, tls, token)
        self.replicas = Replicas(self.channel)  # whether another replica serves (a draining one's sessions move)
        self.clock = clock or StepClock()
        self.stub = stub_class(self.channel)
        self.remote = remote or fetch_info(self.role, addr, self.stub.GetInfo, self.info_request(), wait_s)

    def get_info(self, timeout: float = 5.0):
        return call_unary(self.role, self.addr, self.stub.GetInfo, self.info_request(), timeout)

    def healthy(self, timeout: float = 1.0) -> bool:
        return backend_healthy(self.channel, timeout)

    def close(self) -> None:
        self.channel.close()

    @staticmethod
    def batch(items) -> list:
        """A round's steps, ``(session, *args)`` each: ``ROUND_MIN`` or more sessions of one backend in ONE round
        call, the rest each on its stream, all sent before any answer is awaited; each failure its own."""
        groups: dict[RemoteBackend, list[int]] = {}
        for k, (s, *_) in enumerate(items):
            if s.in_rounds:
                groups.setdefault(s.client, []).append(k)
        rounds = [ks for ks in groups.values() if len(ks) >= ROUND_MIN]
        in_round = {k for ks in rounds for k in ks}
        posted = {k: _alone(s._post, *args) for k, (s, *args) in enumerate(items) if k not in in_round}
        out: list = [None] * len(items)
        for ks in rounds:
            for k, r in zip(ks, items[ks[0]][0].client.round([items[k] for k in ks])):
                if r is _ON_STREAM or r is _RETRY_ON_STREAM:  # not on the replica the round reached: its stream
                    s, *args = items[k]
                    s.round_ok = r is _RETRY_ON_STREAM  # from now on, unless that replica died
                    posted[k] = _alone(s._post, *args)
                else:
                    out[k] = r
        for k, p in posted.items():
            out[k] = p if isinstance(p, Exception) else _alone(items[k][0]._finish, p)
        return out

    def round(self, items) -> list:
        """One round call for ``items``: each one's answer, exception, or ``_ON_STREAM`` (not held there)."""
        req = self.round_request(progress_ms=self.clock.progress_ms)
        for s, *args in items:
            getattr(req.items.add(session_id=s.session_id), self.step).CopyFrom(s._step_msg(*args))
        t0 = time.perf_counter()
        # Its timeout: the latest of its sessions' client deadlines (None: one has none); a session whose own deadline
        deadlines = [s._s.deadline for s, *_ in items]  # passes first is aborted on its stream, its item failing alone
        try:  # its Done message, after its Progress messages
            timeout = None if None in deadlines else max(0.0, max(deadlines) - time.monotonic())
            call = getattr(self.stub, self.round_rpc)(req, timeout=timeout)
            resp = heard_from(call, self.role, self.addr, "round", "round call ended before done", self.clock.timeout(),
                              call.cancel)  # fmt: skip
            if resp.WhichOneof("response") != "done" or len(resp.done.items) != len(req.items):
                raise BackendError(self.role, self.addr, grpc.StatusCode.INTERNAL, "round call out of protocol")
        except BackendError as exc:  # the call failed: every session in it hears it, unless the replica it reached
            lost = exc.replica_lost and not exc.step_timeout  # is gone (a hung one would answer no stream either)
            return [_RETRY_ON_STREAM if lost else s._fail(exc) for s, *_ in items]
        self.clock.record(time.perf_counter() - t0)
        out = []
        for (s, *_), sent, got in zip(items, req.items, resp.done.items):
            s._s.bytes_sent += sent.ByteSize()
            s._s.bytes_received += got.ByteSize()
            if s.ended:  # cancelled meanwhile: as its stream would say
                out.append(BackendError(self.role, self.addr, grpc.StatusCode.CANCELLED, "session is closed"))
            elif got.WhichOneof("result") == self.answer:
                s._s.draining = s._s.draining or resp.draining
                out.append(s._answer(getattr(got, self.answer), resp.elapsed_s))
            elif got.error.code == grpc.StatusCode.NOT_FOUND.value[0]:
                out.append(_ON_STREAM)
            else:
                out.append(s._fail(BackendError(self.role, self.addr, status_code(got.error.code), got.error.message)))
        return out
