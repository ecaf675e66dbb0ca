"""The orchestrator's OpenAI-compatible HTTP front: Starlette on uvicorn, beside the gRPC server in one process.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream``: server-sent events ended by ``data:
[DONE]``), ``GET /v1/models``, ``GET /v1/models/{id}`` and ``GET /health`` (200 once SERVING, else 503; open without a
token). Every request runs through :meth:`GenerationService.stream` on a thread of its own; a client that goes away
cancels its run. The bearer token and TLS are the gRPC server's. A client's mistake is a 4xx in OpenAI's error shape.
A generation's answer (an error too) names its id in ``X-Request-Id``: the body's, else the request's header, as gRPC's.

Slow clients are bounded (``bounds.HttpTimeouts``): headers within ``headers_s`` (uvicorn has no such bound:
:func:`_bounded_h11`), the body within ``body_s`` (408), an idle keep-alive connection closed after ``keep_alive_s``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import ssl
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kakeya.core.generation import Block
from kakeya.core.request import InvalidRequest
from kakeya.orchestrator.fronts import http_api
from kakeya.orchestrator.fronts.http_api import ApiError
from kakeya.runtime.bounds import HttpTimeouts, check_request_id
from kakeya.runtime.lifecycle import RequestError
from kakeya.runtime.security.auth import bearer_ok
from kakeya.wire.limits import PUBLIC_MAX_RECEIVE_BYTES

log = logging.getLogger("kakeya.http")

_END = object()


def served_model_name(target: str) -> str:
    """The ``model`` a checkpoint is served as by default: its directory's name (a make-tiny ``target``'s parent's)."""
    parent, name = os.path.split(os.path.abspath(target))  # "." and "./" are the working directory, named
    cache, snapshots = os.path.split(parent)  # a hub cache's models--org--name/snapshots/<commit>: the repo id
    if snapshots == "snapshots" and (repo := os.path.basename(cache)).startswith("models--"):
        return repo.removeprefix("models--").replace("--", "/")
    return os.path.basename(parent) if name == "target" and os.path.basename(parent) else name


class HttpCall:
    """A ``service.ClientCall``: the caller named as gRPC names peers (so --max-sessions-per-peer counts both
    fronts together), no deadline, and a callback when the client leaves."""

    def __init__(self, peer: str = "unknown"):
        self._peer = peer
        self._lock = threading.Lock()
        self._callbacks: list = []
        self.gone = False

    def peer(self) -> str:
        return self._peer

    def time_remaining(self) -> float | None:
        return None

    def add_callback(self, fn) -> bool:
        with self._lock:
            if not self.gone:
                self._callbacks.append(fn)
        return not self.gone

    def leave(self) -> None:
        """The client went away: its run is cancelled (from the event loop's thread)."""
        with self._lock:
            self.gone, callbacks, self._callbacks = True, self._callbacks, []
        for fn in callbacks:
            fn()


def grpc_peer(request: Request) -> str:
    """The HTTP client as gRPC names a peer: ``ipv4:ADDR:PORT`` or ``ipv6:[ADDR]:PORT``."""
    client = request.client
    if client is None:
        return "unknown"
    return f"ipv6:[{client.host}]:{client.port}" if ":" in client.host else f"ipv4:{client.host}:{client.port}"


async def _messages(servicer, request, call: HttpCall) -> AsyncIterator:
    """The service's blocks and report for ``request`` of ``call``, produced on a thread of their own (each
    step blocks on the models); a refusal before the first comes out of the first ``__anext__``."""
    loop, queue = asyncio.get_running_loop(), asyncio.Queue()

    def pump() -> None:
        stream: Iterator = servicer.stream(request, call)
        try:
            for message in stream:
                loop.call_soon_threadsafe(queue.put_nowait, message)
        except BaseException as exc:  # noqa: BLE001 - handed to the request's coroutine
            loop.call_soon_threadsafe(queue.put_nowait, exc)
        finally:
            try:
                stream.close()  # on this thread: the servicer's bookkeeping ends where it ran
            finally:  # whatever happens, the request's coroutine stops waiting
                loop.call_soon_threadsafe(queue.put_nowait, _END)

    threading.Thread(target=pump, name="http-generate", daemon=True).start()
    done = False
    try:
        while (item := await queue.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            yield item
        done = True
    finally:
        if not done:
            call.leave()


async def _left(request: Request, call: HttpCall) -> None:
    """Wait for the client of ``request`` (its body read) to go away, then cancel ``call``'s run (a whole
    answer is written only at its end: nothing else would notice before the run did all its tokens)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass  # nothing else comes once the body is read: uvicorn answers the disconnect (or the answer's end)
    call.leave()


class _Json(JSONResponse):
    """A JSON answer in ASCII: whatever a message quotes (a client's lone surrogate), it always encodes."""

    def render(self, content) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode()


def _once(pairs: list) -> dict:
    """A JSON object of a body; a key in it twice is a 400 naming it (which of its values was meant, nothing tells)."""
    obj: dict = {}
    for key, value in pairs:
        if key in obj:
            raise http_api.bad(key[:64], "sent twice in one JSON object: send it once")
        obj[key] = value
    return obj


def _event(body: dict) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


class HttpFront:
    """The HTTP server of one ``GenerationServicer`` (``lifecycle.run_server`` starts and stops it)."""

    def __init__(
        self,
        servicer,
        port: int,
        model_name: str | None = None,
        max_body: int = PUBLIC_MAX_RECEIVE_BYTES,
        timeouts: HttpTimeouts | None = None,
    ):
        self.servicer, self.port, self.max_body = servicer, port, max_body
        self.timeouts = timeouts or HttpTimeouts()
        self._model_name = model_name
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/models/{model:path}", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
            ],
            exception_handlers={HTTPException: self._http_error, Exception: self._internal_error},
        )
        self.app.router.redirect_slashes = False  # a 307 to the Host header's URL: behind a proxy, an internal one
        self.server = None
        self._thread: threading.Thread | None = None

    @property
    def model_name(self) -> str:
        return self._model_name or served_model_name(self.servicer.engine.target)

    async def health(self, request: Request) -> Response:
        if why := self.servicer.unavailable():  # draining, loading, or its verifier failing its health checks
            return _Json(ApiError(503, why).body(), status_code=503)
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        """OpenAI's list-models; with an id, its retrieve-model (a 404 naming any other id)."""
        try:
            self._admitted(request)
            limits = self.servicer.limits  # vLLM's max_model_len: what prompt + output may hold, never refused
            listed = http_api.models(self.model_name, min(limits.max_context, limits.max_prompt_tokens))
            name = request.path_params.get("model")
            if name is None:
                return _Json(listed)
            if name != self.model_name:
                raise http_api.model_not_found(name, self.model_name)
            return _Json(listed["data"][0])
        except ApiError as exc:
            return self._error(exc)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, http_api.completion_request)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, http_api.chat_request)

    async def _generate(self, request: Request, translate) -> Response:
        headers, names, messages = {}, {}, None  # headers: the request's id, once known (every log line names it)
        try:
            sent = check_request_id(request.headers.get("x-request-id", ""), "X-Request-Id")
            headers = {"X-Request-Id": sent} if sent else {}
            self._admitted(request)
            generate, what, names = translate(await self._body(request), self.model_name)
            generate = replace(generate, request_id=generate.request_id or sent or uuid.uuid4().hex[:16])
            headers = {"X-Request-Id": check_request_id(generate.request_id)}
            call = HttpCall(grpc_peer(request))
            messages = _messages(self.servicer, generate, call)
            # From here until a stream's response takes over (it watches the client itself), a client that goes
            # away cancels the run: while it opens its sessions and prefills, and all through a whole answer.
            watch = asyncio.create_task(_left(request, call))
            first = await anext(messages, None)
            codec = self.servicer.engine.codec if what.logprobs else None  # the tokens' text, for logprobs
            answer = http_api.Answer(what, codec.token if codec is not None else None)
            if what.stream:  # (finally stops the watch: the response watches its client itself)
                return StreamingResponse(self._events(answer, first, messages), 200, headers, "text/event-stream")
            item = first
            while isinstance(item, Block):  # its blocks, then its report
                answer.add(item)
                item = await anext(messages, None)
            if item is None:  # the run was cancelled under it: its client left (499, nginx's) or the server stops
                raise ApiError(499 if call.gone else 503, "the generation was cancelled")
            await anext(messages, None)  # its end, after the report
            return _Json(answer.whole(item), headers=headers)
        except ApiError as exc:
            return self._error(exc, headers)
        except InvalidRequest as exc:
            return self._error(ApiError.invalid(exc, names), headers)
        except RequestError as exc:
            return self._error(ApiError.of(exc), headers)
        finally:
            if messages is not None:  # the request was translated: its run began
                watch.cancel()
                if not what.stream:
                    await messages.aclose()

    async def _events(self, answer: http_api.Answer, first, messages) -> AsyncIterator[bytes]:
        opening = answer.opening()
        if opening is not None:
            yield _event(opening)
        try:
            item = first
            while item is not None:  # blocks, then the report: the held-back text, the finish and usage
                events = answer.add(item) if isinstance(item, Block) else answer.tail(item) + answer.closing(item)
                for event in events:
                    yield _event(event)
                item = await anext(messages, None)
        except ApiError as exc:  # failed after the first chunk: the stream says so, as vLLM's does
            yield _event(exc.body())
        yield b"data: [DONE]\n\n"

    def _admitted(self, request: Request) -> None:
        """401 without the server's bearer token (when it has one); 503 while the engine loads."""
        if not bearer_ok(request.headers.get("authorization", ""), self.servicer.auth_token):
            raise ApiError(401, "missing or wrong bearer token (Authorization: Bearer ...)", code="invalid_api_key")
        if self.servicer.engine is None:
            raise ApiError(503, "orchestrator is loading")

    async def _body(self, request: Request):
        """The JSON body, at most ``max_body`` bytes (413 beyond, as the gRPC API's receive limit)."""
        if request.headers.get("content-encoding", "identity").lower() != "identity":  # RFC 7694's answer
            raise ApiError(415, "Content-Encoding: this server takes a body only uncompressed (identity)")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body:
            raise ApiError(413, f"request body of {declared} bytes exceeds this server's limit of {self.max_body}")
        raw = bytearray()
        try:
            async with asyncio.timeout(self.timeouts.body_s):
                async for part in request.stream():
                    raw += part
                    if len(raw) > self.max_body:
                        raise ApiError(413, f"request body exceeds this server's limit of {self.max_body} bytes")
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {self.timeouts.body_s:g} s") from None
        except ClientDisconnect:  # nobody reads the answer: it only ends the request
            raise ApiError(400, "the client closed the connection before its body ended") from None
        try:
            return json.loads(raw, object_pairs_hook=_once)
        except (ValueError, RecursionError) as exc:  # bad JSON, bad UTF-8, absurd nesting
            raise ApiError(400, f"the request body is not valid JSON ({str(exc)[:200]})") from None

    def _error(self, exc: ApiError, headers: dict | None = None) -> JSONResponse:
        """``exc``'s answer, in ``kakeya_errors_total{code}`` as the gRPC API's errors are (a health check's is not)."""
        self.servicer.metrics.errors.labels(code := http_api.GRPC_CODES.get(exc.status, "INTERNAL")).inc()
        rid = (headers or {}).get("X-Request-Id", "")  # its line names the field, never the request's text
        log.info("refused: HTTP %d %s %s", exc.status, code, exc.param or "-", extra={"request_id": rid})
        if exc.status in (429, 503):  # full, loading or draining: the openai SDK's retries wait as long as this asks
            headers = {"Retry-After": "1"} | (headers or {})
        return _Json(exc.body(), status_code=exc.status, headers=headers)

    async def _http_error(self, request: Request, exc: HTTPException) -> Response:
        return self._error(ApiError(exc.status_code, exc.detail or "not found"), exc.headers)  # a 405's Allow

    async def _internal_error(self, request: Request, exc: Exception) -> Response:
        log.exception("HTTP %s %s failed", request.method, request.url.path)
        return self._error(ApiError(500, f"internal error ({type(exc).__name__}); the orchestrator's log has it"))

    def start(self, host: str, tls=None, grace_s: float = 30.0) -> int:
        """Listen on ``host:port`` (TLS as gRPC's); the port bound (``port`` 0: any free one), or OSError."""
        import uvicorn

        bind_host = host.strip("[]")
        sock = socket.socket(socket.AF_INET6 if ":" in bind_host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((bind_host, self.port))
            sock.listen(2048)
        except OSError:
            sock.close()
            raise
        kw = {}
        if tls is not None and tls.enabled:
            kw = {"ssl_certfile": tls.cert, "ssl_keyfile": tls.key}
            if tls.client_ca:
                kw |= {"ssl_ca_certs": tls.client_ca, "ssl_cert_reqs": ssl.CERT_REQUIRED}
        config = uvicorn.Config(self.app, log_level="warning", log_config=None, access_log=False, lifespan="off",
                                timeout_graceful_shutdown=max(1, int(grace_s)), http=_bounded_h11(self.timeouts.headers_s),
                                timeout_keep_alive=self.timeouts.keep_alive_s, proxy_headers=False, **kw)  # fmt: skip
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, name="http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        if not self.server.started:
            raise RuntimeError(f"the HTTP server did not start on {host}:{self.port}")
        return sock.getsockname()[1]

    def drain(self) -> None:
        """Stop listening; in-flight requests go on (up to the grace, then uvicorn cancels them)."""
        if self.server is not None:
            self.server.should_exit = True

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)


def _bounded_h11(headers_s: float):
    """uvicorn's HTTP/1.1 protocol (h11), closing a connection whose request headers are not all in within
    ``headers_s`` of the connection or of the request's first byte (uvicorn waits for them forever)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class BoundedH11(H11Protocol):
        _timer: asyncio.TimerHandle | None = None

        def _between_requests(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._timer = self.loop.call_later(headers_s, self._expire)

        def data_received(self, data: bytes) -> None:
            if self._timer is None and self._between_requests():  # a keep-alive connection's next request begins
                self._timer = self.loop.call_later(headers_s, self._expire)
            super().data_received(data)
            if self._timer is not None and not self._between_requests():  # its headers are in: the app has it
                self._timer.cancel()
                self._timer = None

        def handle_events(self) -> None:  # parses the requests in, making each one's cycle (its app to run) as read
            super().handle_events()  # then, RFC 9112: an absolute-form target is served as its path (3.2.2) ...
            if self.cycle and self.cycle.scope["path"].startswith(("http://", "https://")):
                self.cycle.scope["path"] = "/" + self.cycle.scope["path"].partition("//")[2].partition("/")[2]
            if self.cycle and {b"content-length", b"transfer-encoding"} <= dict(self.cycle.scope["headers"]).keys():
                self.cycle.keep_alive = False  # ... and one framed both ways (smuggling?) ends its connection (6.3)

        def send_400_response(self, msg: str) -> None:  # what h11 cannot parse: in OpenAI's shape too, as every answer
            import h11

            body = json.dumps(ApiError(400, msg).body()).encode()
            head = [(b"content-type", b"application/json"), (b"connection", b"close")]
            answer = h11.Response(status_code=400, headers=head, reason="Bad Request")
            for event in (answer, h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()

        def connection_lost(self, exc) -> None:
            if self._timer is not None:  # (never set again: a lost connection receives nothing)
                self._timer.cancel()
            super().connection_lost(exc)

        def _expire(self) -> None:
            self._timer = None
            if self._between_requests() and not self.transport.is_closing():
                log.info(
                    "HTTP: closing a connection from %s whose request headers took over %g s", self.client, headers_s
                )
                self.transport.close()

    return BoundedH11
