"""The Verifier / Drafter protocols (``services/core/contract.py``) over gRPC.

One bidirectional ``Session`` stream per session: opening a session starts the
stream, ``close`` ends it politely (``Close`` -> ``Closed``), ``abort`` cancels
it; the server frees the session's cache either way. Requests are pipelined
where the protocol allows it (``Open`` travels with ``Prefill`` / the first
``Draft``), so a block costs two round trips: draft, and verify (which commits).

Aux hidden states stay opaque: a verifier session returns the wire ``Tensor``
as it came and a drafter session sends a ``Tensor`` as it is (an array is
encoded with ``services/wire/codec.py``), so split deployments never decode
aux in the orchestrator.

A session takes its request's ``SessionOptions``: the request id travels with
the stream, the client's deadline bounds it, and a cancelled request aborts it
at once (from whichever thread cancels).

Failures surface as :class:`BackendError` carrying the gRPC status code. A
``GrpcDrafter`` that failed is skipped for a while (exponential backoff) and
then tried again, so the orchestrator reconnects once the drafter is back.
Every step waits at most a deadline sized from measured step times
(``deadlines.py``), so a hung backend is noticed within seconds.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Sequence

import grpc

from kakeya.core.contract import MAX_BLOCK_SIZE, CachePolicy, Draft, SamplingParams, SessionOptions, Verdict
from kakeya.orchestrator.deadlines import WATCHDOG, StepClock
from kakeya.wire import codec
from kakeya.wire import convert as wire_contract
from kakeya.wire.kakeya.v1 import drafter_pb2 as dpb
from kakeya.wire.kakeya.v1 import drafter_pb2_grpc, verifier_pb2_grpc
from kakeya.wire.kakeya.v1 import verifier_pb2 as vpb
from kakeya.wire.kakeya.v1.tensor_pb2 import Tensor
from kakeya.wire.limits import channel_options

log = logging.getLogger("kakeya.remote")

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


def backend_channel(addr: str, tls=None) -> grpc.Channel:
    """A channel to a verifier or drafter; ``tls``: a ``kakeya.runtime.tls.ClientTLS`` (None: plaintext)."""
    from kakeya.runtime.tls import channel

    return channel(addr, tls, channel_options() + RECONNECT_OPTIONS + BALANCE_OPTIONS)


def backend_healthy(channel: grpc.Channel, timeout: float = 1.0) -> bool:
    """The backend answers its health check with SERVING within ``timeout``."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        r = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
    except grpc.RpcError:
        return False
    return r.status == health_pb2.HealthCheckResponse.SERVING


class BackendError(RuntimeError):
    """A call to a verifier or drafter failed; ``code`` is its ``grpc.StatusCode``.

    ``step_timeout``: the backend did not answer one step within its deadline (hung, not merely slow).
    """

    def __init__(self, service: str, addr: str, code: grpc.StatusCode, details: str, step_timeout: bool = False):
        super().__init__(f"{service} at {addr}: {code.name}: {details}")
        self.service, self.addr, self.code, self.details = service, addr, code, details
        self.step_timeout = step_timeout

    @classmethod
    def of(cls, service: str, addr: str, exc: grpc.RpcError) -> "BackendError":
        code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
        details = exc.details() if hasattr(exc, "details") else str(exc)
        return cls(service, addr, code or grpc.StatusCode.UNKNOWN, details or "")


def _call_unary(service: str, addr: str, fn, request, timeout: float | None, wait: bool = False):
    try:
        return fn(request, timeout=timeout, wait_for_ready=wait)
    except grpc.RpcError as exc:
        raise BackendError.of(service, addr, exc) from None


def _get_info(service: str, addr: str, fn, request, wait_s: float | None):
    """GetInfo; with ``wait_s``, keep trying (backend not up yet, or still loading) for that long."""
    if not wait_s:
        return _call_unary(service, addr, fn, request, 10.0)
    deadline = time.monotonic() + wait_s
    while True:
        left = deadline - time.monotonic()
        try:
            return _call_unary(service, addr, fn, request, max(0.1, left), wait=True)
        except BackendError as exc:
            if exc.code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise
            if left <= 0.5:
                raise BackendError(
                    service, addr, grpc.StatusCode.UNAVAILABLE, f"not ready within {wait_s:g} s (last: {exc.details})"
                ) from None
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


_END = object()


class _Stream:
    """One bidi Session call: requests are queued, responses read strictly in order."""

    def __init__(self, method, service: str, addr: str, timeout: float | None, request_id: str):
        self.service, self.addr = service, addr
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._expect: deque[str] = deque()
        metadata = (("x-request-id", request_id),) if request_id else None
        self._call = method(iter(self._requests.get, _END), timeout=timeout, metadata=metadata)
        self.done = False
        self.expired = 0.0  # the step deadline that passed (seconds), 0 while none did
        self.bytes_sent = 0
        self.bytes_received = 0

    def post(self, request, expect: str) -> None:
        if self.done:
            raise BackendError(self.service, self.addr, grpc.StatusCode.CANCELLED, "session is closed")
        self.bytes_sent += request.ByteSize()
        self._expect.append(expect)
        self._requests.put(request)

    def wait(self, step_timeout: float | None = None):
        expect = self._expect.popleft()
        key = None
        if step_timeout is not None:

            def expire(t=step_timeout):
                self.expired = t
                self.abort()

            key = WATCHDOG.arm(step_timeout, expire)
        try:
            resp = next(self._call)
        except StopIteration:
            self.abort()
            raise BackendError(self.service, self.addr, grpc.StatusCode.INTERNAL, f"stream ended before {expect}") from None
        except grpc.RpcError as exc:
            self.abort()
            if self.expired:
                raise BackendError(
                    self.service, self.addr, grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"no {expect} answer within {self.expired:.1f} s (hung? see --backend-timeout)", step_timeout=True,
                ) from None
            raise BackendError.of(self.service, self.addr, exc) from None
        finally:
            if key is not None:
                WATCHDOG.disarm(key)
        self.bytes_received += resp.ByteSize()
        got = resp.WhichOneof("response")
        if got != expect:
            self.abort()
            raise BackendError(self.service, self.addr, grpc.StatusCode.INTERNAL, f"expected {expect}, got {got}")
        return resp

    def ask(self, request, expect: str, step_timeout: float | None = None):
        self.post(request, expect)
        while len(self._expect) > 1:  # answers to pipelined requests come first
            self.wait(step_timeout)
        return self.wait(step_timeout)

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


# --------------------------------------------------------------------------- verifier


class GrpcVerifierSession:
    """``VerifierSession`` over one Session stream."""

    def __init__(
        self, verifier: "GrpcVerifier", policy: CachePolicy | None, sampling: SamplingParams | None, options: SessionOptions
    ):
        self.verifier = verifier
        self.clock = verifier.clock
        self._s = _Stream(verifier.stub.Session, "verifier", verifier.addr, options.timeout, options.request_id)
        if options.cancel is not None:
            options.cancel.on_cancel(self.abort)
        open_ = vpb.VerifierRequest.Open(
            request_id=options.request_id, target_layer_ids=list(verifier.aux_layers), max_positions=options.max_positions
        )
        if sampling is not None and not sampling.greedy:
            open_.sampling.CopyFrom(wire_contract.sampling_to_proto(sampling))
        if policy is not None:
            open_.cache_policy.CopyFrom(wire_contract.policy_to_proto(policy))
        self._s.post(vpb.VerifierRequest(open=open_), "opened")  # answered with the prefill
        self.session_id = ""
        self.cache_policy = ""
        self._stats = vpb.SessionStats()
        self.server_s = 0.0  # server-side time of all steps (the rest of a step's time is the wire)

    def _aux(self, tensor: Tensor):
        like = self.verifier.aux_like
        return tensor if like is None else codec.from_proto(tensor, like=like)

    def _step(self, request, expect):
        t0 = time.perf_counter()
        resp = self._s.ask(request, expect, self.clock.timeout())
        self.clock.record(time.perf_counter() - t0)
        self.server_s += resp.elapsed_s
        return resp

    def prefill(self, prompt_ids: Sequence[int]):
        n = len(prompt_ids)
        t0 = time.perf_counter()
        self._s.post(vpb.VerifierRequest(prefill=vpb.VerifierRequest.Prefill(token_ids=list(prompt_ids))), "prefilled")
        opened = self._s.wait(self.clock.timeout()).opened
        self.session_id = opened.session_id
        self.cache_policy = wire_contract.policy_from_proto(opened.cache_policy, CachePolicy()).label
        r = self._s.wait(self.clock.timeout(prefill_tokens=n))
        self.clock.record(time.perf_counter() - t0, prefill_tokens=n)
        self.server_s += r.elapsed_s
        self._stats = r.prefilled.stats
        return r.prefilled.next_token, self._aux(r.prefilled.aux)

    def decide(self, last_token: int, draft: Draft) -> Verdict:
        v = vpb.VerifierRequest.Verify(block_ids=[last_token, *draft.tokens])
        if draft.proposal is not None:
            v.proposal.CopyFrom(wire_contract.proposal_to_proto(draft.proposal))
        r = self._step(vpb.VerifierRequest(verify=v), "verified").verified
        self._stats = r.stats
        return Verdict(r.accepted, r.next_token, self._aux(r.aux))

    def stats(self) -> dict:
        s = self._stats
        return {
            "cache_policy": self.cache_policy,
            "bounded": s.bounded,
            "positions": s.positions,
            "kv_bytes": {"sliding": s.kv_bytes_sliding, "full": s.kv_bytes_full},
            "bytes_sent": self._s.bytes_sent,
            "bytes_received": self._s.bytes_received,
            "server_s": self.server_s,
        }

    def close(self) -> None:
        r = self._s.finish(vpb.VerifierRequest(close=vpb.VerifierRequest.Close()), "closed", self.clock.timeout())
        if r is not None:
            self._stats = r.closed.stats

    def abort(self) -> None:
        self._s.abort()


class GrpcVerifier:
    """``Verifier`` reached over gRPC. ``info`` and the default ``policy`` come from the server's GetInfo.

    ``aux_layers``: the layers whose hidden states every session asks for (the
    drafter's, settled when the engine is assembled); none given: the server's
    default, or the last layer if it has none.
    """

    def __init__(
        self, addr: str, *, aux_layers: Sequence[int] = (), wait_s: float | None = None, aux_like: str | None = None,
        channel=None, tls=None, clock: StepClock | None = None,
    ):
        self.addr = addr
        self.channel = channel or backend_channel(addr, tls)
        self.clock = clock or StepClock()
        self.stub = verifier_pb2_grpc.VerifierServiceStub(self.channel)
        self.aux_like = aux_like  # None: aux stays a wire Tensor; "mlx"/"torch"/"numpy": decoded
        self.remote = _get_info("verifier", addr, self.stub.GetInfo, vpb.GetVerifierInfoRequest(), wait_s)
        r = self.remote
        self.info = wire_contract.model_info_from_verifier(
            r, f"grpc:{addr}", {"remote_backend": r.backend, "device": r.device, "aux_dtype": codec.dtype_name(r.aux_dtype)}
        )
        self.aux_layers = tuple(aux_layers) or tuple(r.target_layer_ids) or (self.info.num_layers - 1,)
        # restoration sources stay named as the server publishes them: it maps the names to directories
        self.policy = wire_contract.policy_from_proto(r.default_cache_policy, CachePolicy(slack=r.max_block_size or MAX_BLOCK_SIZE))

    def healthy(self, timeout: float = 1.0) -> bool:
        return backend_healthy(self.channel, timeout)

    def get_info(self, timeout: float = 5.0) -> vpb.VerifierInfo:
        return _call_unary("verifier", self.addr, self.stub.GetInfo, vpb.GetVerifierInfoRequest(), timeout)

    def open_session(
        self, policy: CachePolicy | None = None, sampling: SamplingParams | None = None, options: SessionOptions | None = None
    ) -> GrpcVerifierSession:
        return GrpcVerifierSession(self, policy, sampling, options or SessionOptions())

    def close(self) -> None:
        self.channel.close()


# --------------------------------------------------------------------------- drafter


class Backoff:
    """After ``failure()``, ``ready()`` is False for 0.5 s, 1 s, 2 s ... up to ``maximum``."""

    def __init__(self, initial: float = 0.5, factor: float = 2.0, maximum: float = 10.0):
        self.initial, self.factor, self.maximum = initial, factor, maximum
        self.failures = 0
        self.until = 0.0
        self.last_error = ""
        self._lock = threading.Lock()

    def ready(self) -> bool:
        return time.monotonic() >= self.until

    def failure(self, error: str) -> float:
        with self._lock:
            self.failures += 1
            delay = min(self.maximum, self.initial * self.factor ** (self.failures - 1))
            self.until = time.monotonic() + delay
            self.last_error = error
            return delay

    def success(self) -> None:
        with self._lock:
            self.failures, self.until = 0, 0.0


class GrpcDrafterSession:
    """``DrafterSession`` over one Session stream, opened with the first ``draft``."""

    def __init__(self, drafter: "GrpcDrafter", sampling: SamplingParams | None, options: SessionOptions):
        self.drafter = drafter
        self._timeout, self._request_id = options.timeout, options.request_id
        self._sampling = sampling if sampling is not None and not sampling.greedy else None
        self._s: _Stream | None = None
        self._broken = False
        self._first = True
        self.server_s = 0.0
        if options.cancel is not None:
            options.cancel.on_cancel(self.abort)

    def draft(self, new_aux, last_token: int, block_size: int) -> Draft:
        if self._broken:
            raise BackendError("drafter", self.drafter.addr, grpc.StatusCode.CANCELLED, "session failed earlier")
        try:
            if self._s is None:
                self._s = _Stream(self.drafter.stub.Session, "drafter", self.drafter.addr, self._timeout, self._request_id)
                open_ = dpb.DrafterRequest.Open(request_id=self._request_id)
                if self._sampling is not None:
                    open_.sampling.CopyFrom(wire_contract.sampling_to_proto(self._sampling))
                self._s.post(dpb.DrafterRequest(open=open_), "opened")
            tensor = new_aux if isinstance(new_aux, Tensor) else codec.to_proto(new_aux)
            req = dpb.DrafterRequest(draft=dpb.DrafterRequest.Draft(new_aux=tensor, last_token=last_token, block_size=block_size))
            rows = int(tensor.shape[0]) if self._first and len(tensor.shape) else 0  # the first draft takes the prompt
            clock = self.drafter.clock
            t0 = time.perf_counter()
            r = self._s.ask(req, "drafted", clock.timeout(prefill_tokens=rows))
            clock.record(time.perf_counter() - t0, prefill_tokens=rows)
            self._first = False
        except BackendError as exc:
            aborted_here = self._broken  # abort() from our side (client cancelled): not the drafter's fault
            self._broken = True
            if self._s is not None:
                self._s.abort()
            ours = exc.code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED) and not exc.step_timeout
            if not aborted_here and not ours:
                self.drafter.failed(exc)
            raise
        self.server_s += r.elapsed_s
        self.drafter.backoff.success()
        d = r.drafted
        if not d.HasField("proposal"):
            return Draft(d.token_ids)
        return Draft(d.token_ids, wire_contract.proposal_from_proto(d.proposal, len(d.token_ids), self.drafter.vocab_size))

    def stats(self) -> dict:
        s = self._s
        return {"bytes_sent": s.bytes_sent if s else 0, "bytes_received": s.bytes_received if s else 0, "server_s": self.server_s}

    def close(self) -> None:
        if self._s is not None and not self._broken:
            self._s.finish(dpb.DrafterRequest(close=dpb.DrafterRequest.Close()), "closed", self.drafter.clock.timeout())

    def abort(self) -> None:
        self._broken = True
        if self._s is not None:
            self._s.abort()


class _SkippedDrafterSession:
    """Handed out while the drafter is backing off: fails at once, so the verifier decodes alone."""

    def __init__(self, drafter: "GrpcDrafter"):
        self.drafter = drafter

    def draft(self, new_aux, last_token, block_size):
        b = self.drafter.backoff
        raise BackendError(
            "drafter",
            self.drafter.addr,
            grpc.StatusCode.UNAVAILABLE,
            f"backing off after {b.failures} failure(s), next try in {max(0.0, b.until - time.monotonic()):.1f} s"
            f" (last: {b.last_error})",
        )

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass


class GrpcDrafter:
    """``Drafter`` reached over gRPC, with failure backoff and automatic reconnection."""

    def __init__(
        self, addr: str, *, wait_s: float | None = None, channel=None, backoff: Backoff | None = None, tls=None,
        clock: StepClock | None = None,
    ):
        self.addr = addr
        self.channel = channel or backend_channel(addr, tls)
        self.clock = clock or StepClock()
        self.stub = drafter_pb2_grpc.DrafterServiceStub(self.channel)
        self.remote = _get_info("drafter", addr, self.stub.GetInfo, dpb.GetDrafterInfoRequest(), wait_s)
        self.backend = f"grpc:{addr}"
        self.block_size = self.remote.block_size
        self.target_layer_ids = tuple(self.remote.target_layer_ids)
        self.mask_token_id = self.remote.mask_token_id
        self.vocab_size = self.remote.vocab_size
        self.backoff = backoff or Backoff()

    def get_info(self, timeout: float = 5.0) -> dpb.DrafterInfo:
        return _call_unary("drafter", self.addr, self.stub.GetInfo, dpb.GetDrafterInfoRequest(), timeout)

    def open_session(self, sampling: SamplingParams | None = None, options: SessionOptions | None = None):
        if not self.backoff.ready():
            return _SkippedDrafterSession(self)
        return GrpcDrafterSession(self, sampling, options or SessionOptions())

    def failed(self, exc: Exception) -> None:
        delay = self.backoff.failure(str(exc))
        log.warning("drafter at %s failed (%s); skipping it for %.1f s", self.addr, exc, delay)

    @property
    def state(self) -> str:
        return "ok" if self.backoff.failures == 0 else ("backoff" if not self.backoff.ready() else "retrying")

    def status(self) -> dict[str, str]:
        """Its reconnection state: ``state`` (ok, backoff, retrying), ``failures`` in a row, ``last_error``."""
        b = self.backoff
        return {"state": self.state, "failures": str(b.failures)} | ({"last_error": b.last_error[:500]} if b.last_error else {})

    def close(self) -> None:
        self.channel.close()
