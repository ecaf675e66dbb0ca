"""What every kakeya gRPC server process shares: errors and the process's lifecycle.

- :class:`RequestError`: raised by servicer code to end an RPC with a status (its message bounded: :func:`bounded`);
  :func:`session_stream`, the body of a ``Session`` stream.
- :func:`run_server`: bind, health ``NOT_SERVING``, load + warm up, health ``SERVING`` (and the ready file), wait for
  SIGTERM/SIGINT or the parent's death, drain in-flight RPCs within a grace period, exit.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from kakeya.core.request import CachePolicy
from kakeya.runtime import logs
from kakeya.runtime.admission import SessionEntry, SessionLimitError, SessionRegistry, Watched
from kakeya.runtime.metrics import RpcInterceptor
from kakeya.runtime.security.auth import peer_of
from kakeya.wire import convert as wire_contract
from kakeya.wire.limits import server_options

log = logging.getLogger("kakeya")

ENV_PARENT_PID = "KAKEYA_PARENT_PID"  # set by `kakeya serve all`: exit when that process is gone
LIVENESS = "liveness"  # a health service SERVING from listening to the drain, whatever the backends (livenessProbe)


def version() -> str:
    try:
        from importlib.metadata import version as v

        return v("kakeya")
    except Exception:  # noqa: BLE001  # pragma: no cover - not installed
        return "0.0.0+local"


MAX_ERROR_CHARS = 1024  # a status message rides in a trailer: far below gRPC's 8 KiB metadata limit


def bounded(message: str, limit: int = MAX_ERROR_CHARS) -> str:
    """``message`` cut to ``limit`` characters: a message that echoes a client's input (a list of
    10,000 ids) must not outgrow the trailer that carries it."""
    return message if len(message) <= limit else message[: limit - 16] + " ... (truncated)"


QUOTE_CHARS = 64


def quote(value, limit: int = QUOTE_CHARS) -> str:
    """A client's value as an error message quotes it: its ``repr`` (a lone surrogate escaped), at most
    ``limit`` characters, ``...`` marking a cut. A 3 MB ``model`` is named, never echoed whole."""
    if isinstance(value, str | bytes | list | tuple) and len(value) > limit:
        value = value[:limit]  # the repr of what is kept is all that is shown
    try:
        text = repr(value)
    except ValueError:  # an int past Python's digit limit for str()
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


class RequestError(Exception):
    """End the current RPC with ``code`` and ``message`` (the message names the field; bounded)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        self.code, self.message = code, bounded(message)
        super().__init__(self.message)


def end_call(context, code: grpc.StatusCode, details: str) -> None:
    """End ``context``'s RPC now with ``code`` and ``details``, from any thread (idle expiry, reclaim): grpc-python's
    ``abort`` works only on the handler's thread, and ``cancel`` reaches the client as a bare CANCELLED."""
    try:
        context._rpc_event.call.cancel(code.value[0], bounded(details))
    except AttributeError:  # a grpc-python laid out otherwise: the call still ends, without the reason
        context.cancel()


def policy_from_request(p, default: CachePolicy, field: str = "cache_policy") -> CachePolicy:
    """A wire ``CachePolicy`` -> the contract's (unset fields: ``default``'s), or ``invalid``."""
    try:
        return wire_contract.policy_from_proto(p, default, field)
    except ValueError as exc:
        raise invalid(str(exc)) from None


def check_policy(policy: CachePolicy, model_window: int, field: str = "cache_policy") -> CachePolicy:
    """``policy`` resolved against the model's window, or ``invalid`` naming ``field``."""
    try:
        return policy.resolve(model_window)
    except ValueError as exc:
        raise invalid(f"{field}: {exc}") from None


def invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


def precondition(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.FAILED_PRECONDITION, message)


def check_token_ids(ids: Sequence[int], vocab: int, field_name: str, allow_empty: bool = False) -> list[int]:
    ids = list(ids)
    if not ids and not allow_empty:
        raise invalid(f"{field_name}: must not be empty")
    if bad := [t for t in ids if not 0 <= t < vocab]:
        raise invalid(f"{field_name}: ids outside the vocabulary [0, {vocab}): {bad[:5]}")
    return ids


def session_stream(name: str, ready: bool, registry: SessionRegistry, serve, request_iterator, context):
    """The body of a bidirectional ``Session`` RPC, shared by the verifier and the drafter. The stream IS the
    session: a registry entry opened with it is closed however it ends (client close, cancel, deadline,
    error), which frees the session's cache. ``serve(entry, requests, context)`` yields the responses."""
    if not ready:
        context.abort(grpc.StatusCode.UNAVAILABLE, f"{name} is loading its model")
    peer, queue = peer_of(context), registry.may_queue()
    try:  # room now, or refused now; with a place in the --queue, it waits once its open is read (servicer._serve)
        entry = registry.open(peer, wait=not queue)
    except SessionLimitError as exc:
        if not queue:
            context.abort(exc.code, f"{name}: {exc}")
        entry = SessionEntry(peer=peer, queued=True)
    entry.end = lambda code, why: end_call(context, code, f"{name}: {why}")
    context.add_callback(lambda: registry.close(entry))
    slog = logging.getLogger(f"kakeya.{name}")
    token = logs.bind(session_id=entry.id)
    slog.info("session opened (%d live)", registry.live)
    t_open = time.monotonic()
    try:
        yield from serve(entry, Watched(request_iterator, entry), context)
    except SessionLimitError as exc:
        context.abort(exc.code, f"{name}: {exc}")
    except RequestError as exc:
        context.abort(exc.code, exc.message)
    except grpc.RpcError:
        return  # the client went away (or the session idled out) while we were reading
    except Exception as exc:  # noqa: BLE001 - a bug: report it, keep the server up
        if entry.closed:  # the stream ended (cancel, deadline) while a step ran: nobody to answer
            return
        slog.exception("session %s failed", entry.id)
        context.abort(grpc.StatusCode.INTERNAL, bounded(f"{name}: {type(exc).__name__}: {exc}"))
    finally:
        registry.close(entry)
        slog.info("session closed after %.3f s", time.monotonic() - t_open)
        logs.reset(token)


@dataclass
class ServerSpec:
    """How ``run_server`` builds and readies one kind of server."""

    name: str  # "verifier" | "drafter" | "orchestrator"
    service_names: list[str]  # full gRPC service names (health + reflection)
    add_to_server: Callable[[grpc.Server], None]  # registers the servicers (before start)
    load: Callable[[], str]  # loads + warms up (blocking); returns a one-line description
    set_ready: Callable[[bool], None]  # servicers refuse work (UNAVAILABLE) until ready
    # on SIGTERM, after health went NOT_SERVING: an orchestrator stops admitting, a session server's answers say
    # ``draining`` (``servicer.py``: its sessions move to other replicas at their next step)
    before_drain: Callable[[], None] = lambda: None
    near_deadline: Callable[[], None] = lambda: None  # grace almost over: end streams cleanly
    # Whether the drain still has work to wait for (a session server: a live or queued session; an orchestrator:
    # a generation in flight or queued, from either front); None: every
    # in-flight RPC is. Once it says no, the RPCs left are ones no client ends: a health Watch (held for the whole
    # --grace), a call from a peer gone without a FIN (held until gRPC's shutdown ping times out, 20 s); waiting for
    # them kept a backend whose sessions had all moved alive long after it had nothing left to hand off.
    busy: Callable[[], bool] | None = None
    max_workers: int = 64  # also the concurrent-RPC cap: one more is RESOURCE_EXHAUSTED, never a hang
    max_receive_bytes: int | None = None  # None: the shared ceiling (services/wire/limits.py)
    public: bool = False  # the public API: refuses keepalive pings more often than its clients send them
    health_watch: Callable[[], bool] | None = None  # polled while serving: False = NOT_SERVING
    health_interval_s: float = 1.0
    tls: Any = None  # kakeya.runtime.security.tls.ServerTLS; None/disabled: plaintext
    metrics: Any = None  # kakeya.runtime.metrics.ServerMetrics: errors counted, /metrics served with --metrics-port
    # An HTTP front beside the gRPC server (the orchestrator's OpenAI API, orchestrator/fronts/http_server.py):
    # start(host, tls, grace_s) -> port, drain(), join(timeout); None: gRPC only.
    http: Any = None


def workers_for(max_sessions: int, queue: int = 0) -> int:
    """Threads for a server whose streams may hold ``max_sessions`` (+ ``queue`` waiting), and a margin for GetInfo,
    health and short RPCs; no session limit (0) is none here either (the pool starts threads only as it needs them)."""
    return max_sessions + queue + 16 if max_sessions else sys.maxsize


def _parent_watch(parent: int, stop: threading.Event) -> None:
    while not stop.wait(0.5):
        if os.getppid() != parent:
            log.warning("parent process %d is gone: shutting down", parent)
            stop.set()


def write_ready_file(path: str | Path, payload: dict) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)  # readers never see a half-written file


def port_in_use(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be ours (another listener holds it), or None (port 0 always is free). gRPC binds with
    SO_REUSEPORT, so a second server on a taken port would bind too and split the connections; a bind without it fails,
    and SO_REUSEADDR lets it pass a just-died server's TIME_WAIT leftovers (a restart on its own port)."""
    import socket

    if port == 0:
        return None
    bind_host = host.strip("[]")
    family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
    if bind_host in ("", "0.0.0.0", "::"):
        bind_host = "::" if family == socket.AF_INET6 else "0.0.0.0"
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((bind_host, port))
    except OSError as exc:
        if exc.errno in (98, 48):  # EADDRINUSE on Linux / macOS
            return f"port {port} is already in use"
        return None  # e.g. an unresolvable host: gRPC reports it
    return None


def _health_watch(spec: ServerSpec, health_servicer, names: list[str], stop: threading.Event) -> None:
    """Health follows the backends this server needs (``spec.health_watch``), until we drain."""
    serving = True
    while not stop.wait(spec.health_interval_s):
        try:
            ok = bool(spec.health_watch())
        except Exception:  # noqa: BLE001 - a failing probe is a failing backend
            ok = False
        if stop.is_set():
            return
        if ok != serving:
            status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
            for n in names:
                health_servicer.set(n, status)
            log.warning(
                "%s health: %s (backends %s)", spec.name, "SERVING" if ok else "NOT_SERVING", "back" if ok else "down"
            )
            serving = ok


def _serve_health(health_servicer, host: str, port: int) -> tuple[grpc.Server | None, int]:
    """A plaintext server answering only ``grpc.health.v1`` with ``health_servicer``'s statuses: Kubernetes'
    native gRPC probes speak no TLS. Health carries no data and opens no session, so it needs no credentials."""
    server = grpc.server(ThreadPoolExecutor(max_workers=2), maximum_concurrent_rpcs=8)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:
        bound = 0
    if not bound:
        return None, 0
    server.start()
    return server, bound


def _failed(spec: ServerSpec, why: str, *servers) -> int:
    """Say why ``spec``'s server cannot serve, stop what already runs of it (``servers``); exit status 2."""
    print(f"kakeya: error: {spec.name}: {why}", file=sys.stderr)
    for server in filter(None, servers):
        server.stop(0)
    return 2


IDLE_SETTLE_S = 0.5  # how long a drain sees no session before it ends the rest: the last trailers go out meanwhile


def _until_idle(busy: Callable[[], bool], done: threading.Event, until: float) -> bool:
    """Wait until ``busy()`` has said False for ``IDLE_SETTLE_S`` (True), or, nothing busy (HTTP generations are no
    gRPC call), ``done`` is set, or ``until`` passes (False: nothing to cut short)."""
    idle_since = None
    while (now := time.monotonic()) < until:
        idle_since = None if busy() else idle_since or now
        if idle_since is not None and (done.is_set() or now - idle_since >= IDLE_SETTLE_S):
            return not done.is_set()
        time.sleep(0.1)
    return False


def run_server(spec: ServerSpec, host: str, port: int, grace_s: float = 30.0, ready_file: str | None = None,
               metrics_port: int | None = None, health_port: int | None = None) -> int:  # fmt: skip
    """Serve until SIGTERM/SIGINT; return the process exit status. ``metrics_port``: /metrics (0: any port);
    ``health_port``: gRPC health alone, also in plaintext (0: any port), for probes that cannot speak TLS."""
    if ready_file:
        Path(ready_file).unlink(missing_ok=True)  # a stale file must not announce us before we are ready
    stop = threading.Event()
    signals = {"n": 0}

    def on_signal(signum, _frame):
        signals["n"] += 1
        if signals["n"] > 1:  # a second signal: no more waiting
            log.warning("second signal: exiting now")
            os._exit(130)
        log.info("received %s: draining (grace %.1f s)", signal.Signals(signum).name, grace_s)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    parent = os.environ.get(ENV_PARENT_PID)
    if parent and parent.isdigit():
        threading.Thread(target=_parent_watch, args=(int(parent), stop), daemon=True).start()

    interceptors = [RpcInterceptor(spec.metrics)] if spec.metrics is not None else []
    options = server_options(max_receive_bytes=spec.max_receive_bytes, public=spec.public)
    pool = ThreadPoolExecutor(max_workers=spec.max_workers)
    server = grpc.server(pool, options=options, maximum_concurrent_rpcs=spec.max_workers, interceptors=interceptors)
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    spec.add_to_server(server)
    names = list(spec.service_names)
    reflection.enable_server_reflection(
        names + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME], server
    )
    for n in ["", *names]:
        health_servicer.set(n, health_pb2.HealthCheckResponse.NOT_SERVING)
    health_servicer.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
    problem = port_in_use(host, port)
    bound = 0
    if problem is None:
        try:
            if spec.tls is not None and spec.tls.enabled:
                bound = server.add_secure_port(f"{host}:{port}", spec.tls.credentials())
            else:
                bound = server.add_insecure_port(f"{host}:{port}")
        except RuntimeError as exc:
            problem = str(exc)
        except ValueError as exc:  # unreadable certificate files
            return _failed(spec, str(exc))
    if not bound:
        return _failed(spec, f"cannot listen on {host}:{port}: {problem or 'address in use'}")
    addr = f"{host}:{bound}"
    ready_extra: dict = {}
    httpd = None
    if metrics_port is not None and spec.metrics is not None:
        try:
            httpd = start_http_server(metrics_port, addr=host, registry=spec.metrics.registry)[0]  # (server, thread)
        except OSError as exc:
            return _failed(spec, f"cannot serve metrics on {host}:{metrics_port} ({exc})", server)
        ready_extra["metrics_port"] = httpd.server_port
        log.info("%s metrics on http://%s:%d/metrics", spec.name, host, httpd.server_port)
    health_server = None
    if health_port is not None:
        health_server, ready_extra["health_port"] = _serve_health(health_servicer, host, health_port)
        if health_server is None:
            return _failed(spec, f"cannot serve health on {host}:{health_port}", server)
    server.start()
    log.info("%s listening on %s (NOT_SERVING until loaded and warmed up)", spec.name, addr)
    if spec.http is not None:
        try:
            ready_extra["http_port"] = spec.http.start(host, spec.tls, grace_s)
        except (OSError, RuntimeError) as exc:
            return _failed(spec, f"cannot serve HTTP on {host}:{spec.http.port} (--http-port: {exc})", server)
        log.info("%s HTTP (OpenAI API) on %s:%d (503 until SERVING)", spec.name, host, ready_extra["http_port"])

    # Load in the background so a signal during a long load still stops us.
    outcome: dict = {}
    loaded = threading.Event()

    def load():
        t0 = time.perf_counter()
        try:
            outcome["desc"] = spec.load()
        except BaseException as exc:  # noqa: BLE001 - reported below
            outcome["error"] = exc
            log.debug("%s", traceback.format_exc())
        outcome["load_s"] = time.perf_counter() - t0
        loaded.set()

    threading.Thread(target=load, name=f"{spec.name}-load", daemon=True).start()
    while not (loaded.wait(0.2) or stop.is_set()):
        pass
    if "error" in outcome:  # a probe must not see this process alive
        return _failed(spec, str(outcome["error"]), server, health_server)
    if loaded.is_set() and not stop.is_set():
        spec.set_ready(True)
        for n in ["", *names]:
            health_servicer.set(n, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "%s SERVING on %s: %s (loaded + warmed up in %.2f s)", spec.name, addr, outcome["desc"], outcome["load_s"]
        )
        if ready_file:
            write_ready_file(
                ready_file, {"service": spec.name, "addr": addr, "port": bound, "pid": os.getpid(), **ready_extra}
            )
        if spec.health_watch is not None:
            threading.Thread(
                target=_health_watch, args=(spec, health_servicer, ["", *names], stop), name="health-watch", daemon=True
            ).start()
    while not stop.wait(0.5):
        pass

    # Drain: NOT_SERVING (load balancers stop routing), refuse new RPCs, let in-flight ones finish (or move: a
    # session server's streams end as their clients hand them to other replicas); exit once none is left.
    health_servicer.enter_graceful_shutdown()
    spec.before_drain()
    if spec.http is not None:
        spec.http.drain()
    t_stop = time.monotonic()
    done = server.stop(grace_s)
    near = t_stop + max(0.0, grace_s - 1.0)
    if spec.busy is not None and _until_idle(spec.busy, done, near):
        log.info("%s: nothing left in flight after %.2f s of draining: ending the calls still open (health watches)",
                 spec.name, time.monotonic() - t_stop)  # fmt: skip
        done = server.stop(0)
    if not done.wait(max(0.0, near - time.monotonic())) or (spec.busy is not None and spec.busy()):
        spec.near_deadline()
        _until_idle(spec.busy or (lambda: False), done, time.monotonic() + 2.0 + 1.0)
    time.sleep(0.25)  # let gRPC's I/O threads flush the last messages and trailers before the process exits
    if spec.http is not None:
        spec.http.join(max(0.5, grace_s - (time.monotonic() - t_stop)))
    spec.set_ready(False)
    if ready_file:
        Path(ready_file).unlink(missing_ok=True)
    if httpd is not None:
        httpd.shutdown()
    if health_server is not None:
        health_server.stop(0)
    log.info("%s stopped after %.2f s of draining", spec.name, time.monotonic() - t_stop)
    return 0
