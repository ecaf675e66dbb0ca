"""The public Generation API (``protos/kakeya/v1/generate.proto``).

Holds an :class:`~kakeya.orchestrator.engine.Engine` whose verifier and
drafter are either in-process (colocated) or gRPC clients (split,
``remote.py``); the request path is the same: validate, open one verifier and
one drafter session, run a ``loop.Decoding`` and stream each committed
block as a ``Chunk`` (token ids + their text), then one ``Complete`` with the
finish reason, token counts and the speculative stats the CLI prints.

Faults: a drafter that fails mid-generation is dropped for the rest of that
generation (``loop``'s ``on_drafter_error``: the verifier finishes alone, same
output, ``drafter_fallback`` set) and retried by later requests after a
backoff. A failing verifier ends the RPC with its status (UNAVAILABLE,
RESOURCE_EXHAUSTED, ...) before the first chunk, or with a ``Complete`` of
``FINISH_REASON_ERROR`` after it. The client's deadline bounds the backend
streams; cancelling the call cancels them, which frees the backend sessions.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterator

import grpc

from kakeya.core.contract import Cancellation, SessionOptions
from kakeya.orchestrator import loop
from kakeya.orchestrator.engine import Engine
from kakeya.orchestrator.quality import quality_report
from kakeya.orchestrator.remote import BackendError
from kakeya.orchestrator.requests import Limits, Params, parse_request
from kakeya.orchestrator.text import PlainText, StopStrings
from kakeya.runtime import bounds, logs
from kakeya.runtime.guard import add_servicer
from kakeya.runtime.lifecycle import DEFAULT_MAX_SESSIONS, ComputeThread, RequestError, ServerSpec, version, workers_for
from kakeya.runtime.metrics import NO_OBSERVER, ServerMetrics
from kakeya.wire import convert as wire_contract
from kakeya.wire.kakeya.v1 import cache_pb2, generate_pb2_grpc
from kakeya.wire.kakeya.v1 import generate_pb2 as pb
from kakeya.wire.limits import PUBLIC_MAX_RECEIVE_BYTES

log = logging.getLogger("kakeya.orchestrator")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
DEFAULT_MAX_TOKENS = 128
DEFAULT_MAX_TOKENS_LIMIT = 4096

FINISH = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
    "error": pb.FINISH_REASON_ERROR,
}


def _cache_kind(label: str) -> int:
    """A policy label ("native", "sink-window(4+64)+kv8") -> its CacheKind."""
    if label.startswith("sink-window"):
        return cache_pb2.CACHE_KIND_SINK_WINDOW
    if label.startswith("native"):
        return cache_pb2.CACHE_KIND_NATIVE
    return cache_pb2.CACHE_KIND_UNSPECIFIED


class _Run:
    """One Generate call's backend sessions; ``cancel`` may come from any thread (remote sessions' streams end)."""

    def __init__(self):
        self.cancellation = Cancellation()
        self.sessions: list = []
        self.drafter_fallback = False

    @property
    def cancelled(self) -> bool:
        return self.cancellation.cancelled

    def cancel(self) -> None:
        self.cancellation.cancel()


def _deadline(context) -> float | None:
    """Seconds left of the client's deadline (None without one): the backends' timeout."""
    left = context.time_remaining()
    return None if left is None or left > 1e7 else max(left, 0.001)


def _status_of(exc: Exception) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, BackendError):
        code = exc.code if exc.code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.OK) else grpc.StatusCode.INTERNAL
        return code, str(exc)
    if isinstance(exc, RequestError):
        return exc.code, exc.message
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(
        self,
        build: Callable[[], Engine],
        *,
        colocated: bool,
        max_tokens_limit: int = DEFAULT_MAX_TOKENS_LIMIT,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        max_prompt_tokens: int = 0,
        restore: bounds.RestoreSources | None = None,
        auth_token: str | None = None,
    ):
        if not 1 <= default_max_tokens <= max_tokens_limit:
            raise ValueError(f"default max tokens {default_max_tokens} must be in 1..{max_tokens_limit} (--max-tokens-limit)")
        if max_prompt_tokens < 0:
            raise ValueError(f"--max-prompt-tokens must be >= 0 (0: the default), got {max_prompt_tokens}")
        self.max_prompt_tokens_flag = max_prompt_tokens
        self.max_prompt_tokens = 0  # set by load(): never above the target's max_position_embeddings
        self.max_position_embeddings = 0
        self.max_context = 0  # positions one verifier session may hold
        self.restore = restore  # colocated: the --restore sources requests may name; None: the remote verifier maps names
        self.auth_token = auth_token
        self._build = build
        self.engine: Engine | None = None
        self.colocated = colocated
        self.compute = ComputeThread("orchestrator") if colocated else None
        self.max_tokens_limit = max_tokens_limit
        self.default_max_tokens = default_max_tokens
        self.max_sessions = max_sessions
        self.ready = False
        self.aborting = False
        self._lock = threading.Lock()
        self.active = 0
        self.total = 0
        self.started = time.monotonic()
        self.metrics = ServerMetrics("orchestrator")
        self.metrics.track_sessions(lambda: self.active, lambda: self.total)

    # -- loading -----------------------------------------------------------------------

    def step(self, fn, *args):
        """Model work: on the compute thread when the models are in this process."""
        return self.compute.run(fn, *args) if self.compute is not None else fn(*args)

    def load(self) -> str:
        self.engine = self.step(self._build)
        e = self.engine
        self._set_limits()
        # Warm-up: one short generation through the very path requests take.
        vocab = e.verifier.info.vocab_size
        params = Params("warmup", [i % vocab for i in range(1, 5)], 3, min(2, e.default_block_size), frozenset(), ())
        run = _Run()
        final = None
        for resp in self._generate(params, run, None, observe=False):  # warm-up: not in the metrics
            final = resp
        c = final.complete
        if c.finish_reason == pb.FINISH_REASON_ERROR:
            raise RuntimeError(f"warm-up generation failed: {c.error_message}")
        if c.stats.drafter_fallback:
            log.warning("warm-up: the drafter failed, requests will fall back to the verifier until it answers")
        return (
            f"{'colocated' if self.colocated else 'split'}: verifier {e.verifier.info.backend} ({e.target}),"
            f" drafter {self._drafter_backend() or 'none'} ({e.draft or '-'}), block {e.default_block_size}"
        )

    def _set_limits(self) -> None:
        info = self.engine.verifier.info
        self.max_position_embeddings = info.max_position_embeddings or 131072
        self.max_context = min(info.max_context or self.max_position_embeddings, self.max_position_embeddings)
        self.max_prompt_tokens = bounds.max_prompt_tokens(self.max_prompt_tokens_flag, self.max_context)

    def _drafter_backend(self) -> str:
        d = self.engine.drafter
        return d.backend if d is not None else ""

    # -- request validation --------------------------------------------------------------

    def parse(self, r: pb.GenerateRequest) -> Params:
        limits = Limits(
            self.max_tokens_limit, self.default_max_tokens, self.max_prompt_tokens, self.max_context, self.restore
        )
        return parse_request(r, self.engine, limits)

    # -- RPCs ----------------------------------------------------------------------------

    def Generate(self, request, context) -> Iterator[pb.GenerateResponse]:
        if not self.ready:
            context.abort(grpc.StatusCode.UNAVAILABLE, "orchestrator is not ready (loading, warming up or draining)")
        try:
            params = self.parse(request)
        except RequestError as exc:
            context.abort(exc.code, exc.message)
        logs.bind(request_id=params.request_id)  # the interceptor resets it when the RPC ends
        with self._lock:
            if self.max_sessions and self.active >= self.max_sessions:
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"orchestrator: {self.active} of {self.max_sessions} generations in flight (--max-sessions)",
                )
            self.active += 1
            self.total += 1
        run = _Run()
        context.add_callback(run.cancel)
        try:
            yield from self._generate(params, run, _deadline(context))
        except RequestError as exc:
            if not run.cancelled:
                context.abort(exc.code, exc.message)
        finally:
            with self._lock:
                self.active -= 1

    def _open(self, params: Params, run: _Run, timeout: float | None):
        e = self.engine
        options = SessionOptions(params.request_id, timeout, len(params.prompt_ids) + params.max_tokens, run.cancellation)
        vs = e.verifier.open_session(params.policy, params.sampling, options)
        run.sessions.append(vs)
        ds = None
        if e.drafter is not None and params.block_size != 1:  # 0: auto
            ds = e.drafter.open_session(params.sampling, options)
            run.sessions.append(ds)
        return vs, ds

    def _generate(self, params: Params, run: _Run, timeout: float | None, observe: bool = True) -> Iterator[pb.GenerateResponse]:
        """Stream one generation; RequestError before the first chunk, Complete(error) after it."""
        e = self.engine
        t_start = time.perf_counter()

        def on_drafter_error(exc: Exception) -> None:
            run.drafter_fallback = True
            if run.cancelled:
                return
            log.warning("request %s: drafter failed (%s); the verifier finishes alone", params.request_id, exc)

        try:
            vs, ds = self.step(self._open, params, run, timeout)
        except Exception as exc:
            self.step(self._close, None, run)  # whatever did open
            raise RequestError(*_status_of(exc)) from None
        obs = self.metrics.generation(vs, ds, params) if observe else NO_OBSERVER  # also logs start and finish
        block_size = params.block_size
        if block_size == 0:  # auto: sized block by block from what this engine has measured and seen
            block_size = self.step(e.calibrate).sizer() if ds is not None else 1
            if ds is not None:
                block_size.max_size = params.max_block
        blocks = loop.Decoding(vs, ds, params.prompt_ids, params.max_tokens, block_size, params.stop_ids, on_drafter_error)
        text = StopStrings(e.codec, params.stop_strings) if params.stop_strings else PlainText(e.codec)
        seen: list[loop.Block] = []
        token_ids: list[int] = []
        gen = None
        finish, error = "length", ""
        try:
            while True:
                if run.cancelled:
                    return
                if self.aborting:
                    finish = "abort"
                    break
                try:
                    value = self.step(next, blocks, None)
                except Exception as exc:
                    if run.cancelled:
                        return
                    code, msg = _status_of(exc)
                    if not seen:
                        raise RequestError(code, msg) from None
                    log.warning("request %s failed mid-generation: %s", params.request_id, msg)
                    finish, error = "error", msg
                    break
                if value is None:  # the loop is over: its record is complete
                    gen = blocks.generation
                    finish = gen.finish_reason
                    if not isinstance(block_size, int):
                        e.adaptive.learn(block_size)  # the next request starts from what this one saw
                    break
                seen.append(value)
                obs.block(value)
                ids, delta, hit = text.add(value.tokens)
                token_ids.extend(ids)
                yield pb.GenerateResponse(chunk=pb.GenerateResponse.Chunk(token_ids=ids, text=delta))
                if hit:
                    finish = "stop"
                    break
            tail = text.flush()
            if tail:
                yield pb.GenerateResponse(chunk=pb.GenerateResponse.Chunk(text=tail))
            vstats = self.step(vs.stats) if finish != "error" else {}
        finally:
            self.step(self._close, blocks, run)
            if run.cancelled:
                obs.finish("abort", fallback=run.drafter_fallback, prompt_tokens=len(params.prompt_ids), tokens=len(token_ids))
        if gen is None:
            gen = loop.Generation(
                prompt_ids=list(params.prompt_ids),
                blocks=seen,
                prefill_s=seen[0].total_s if seen else 0.0,
                decode_s=sum(b.total_s for b in seen[1:]),
            )
        gen.token_ids = token_ids
        gen.finish_reason = finish
        gen.drafter_fallback = gen.drafter_fallback or run.drafter_fallback
        obs.finish(finish, fallback=gen.drafter_fallback, prompt_tokens=len(params.prompt_ids), tokens=len(token_ids))
        yield pb.GenerateResponse(complete=self._complete(params, gen, vstats, time.perf_counter() - t_start, error))

    @staticmethod
    def _close(blocks, run: _Run) -> None:
        if blocks is not None:
            blocks.close()
        for s in run.sessions:
            try:
                s.close()
            except Exception:  # pragma: no cover - closing must not mask the outcome
                log.exception("closing a backend session")

    def _complete(self, params: Params, gen: loop.Generation, vstats: dict, total_s: float, error: str):
        kv = vstats.get("kv_bytes", {})
        stats = pb.SpecStats(
            acceptance_lengths=gen.acceptance_lengths,
            mean_acceptance=gen.mean_acceptance,
            decode_tok_s=gen.decode_tok_s,
            prefill_s=gen.prefill_s,
            drafter_fallback=gen.drafter_fallback,
            verifier_kv_bytes_sliding=int(kv.get("sliding", 0)),
            verifier_kv_bytes_full=int(kv.get("full", 0)),
            degenerate=quality_report(gen.token_ids)["degenerate"],
            decode_s=gen.decode_s,
            total_s=total_s,
            block_size=params.block_size,
            cache_kind=_cache_kind(vstats.get("cache_policy", "")),
            cache_policy=vstats.get("cache_policy", ""),
            cache_bounded=bool(vstats.get("bounded", False)),
        )
        complete = pb.GenerateResponse.Complete(
            finish_reason=FINISH[gen.finish_reason],
            prompt_tokens=len(params.prompt_ids),
            completion_tokens=len(gen.token_ids),
            stats=stats,
            error_message=error,
            prompt_token_ids=params.prompt_ids,
        )
        if not params.sampling.greedy:
            complete.seed = params.sampling.seed
        return complete

    def GetModelInfo(self, request, context):
        if self.engine is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "orchestrator is loading")
        e = self.engine
        i = e.verifier.info
        policy = e.verifier.policy.resolve(i.sliding_window)
        if self.restore is not None:  # colocated: a restoration directory goes out as its source's name
            policy = self.restore.to_wire(policy)
        return wire_contract.public_model_info(
            i,
            target_model=e.target,
            draft_model=e.draft,
            default_block_size=e.default_block_size,
            max_tokens_limit=self.max_tokens_limit,
            default_max_tokens=self.default_max_tokens,
            has_tokenizer=e.codec is not None,
            default_cache_policy=wire_contract.policy_to_proto(policy),
            target_layer_ids=list(e.verifier.aux_layers),
            max_prompt_tokens=self.max_prompt_tokens,
            max_position_embeddings=self.max_position_embeddings,
        )

    def GetServerInfo(self, request, context):
        e = self.engine
        drafter = e.drafter if e is not None else None
        extra = {f"drafter_{k}": v for k, v in drafter.status().items()} if drafter is not None else {}
        with self._lock:
            active, total = self.active, self.total
        return pb.ServerInfo(
            version=version(),
            verifier_backend=e.verifier.info.backend if e is not None else "",
            drafter_backend=self._drafter_backend() if e is not None else "",
            deployment="colocated" if self.colocated else "split",
            active_requests=active,
            total_requests=total,
            uptime_s=time.monotonic() - self.started,
            extra=extra,
        )


# --------------------------------------------------------------------------- serving


def server_spec(servicer: GenerationServicer, tls=None) -> ServerSpec:
    def set_ready(flag: bool) -> None:
        servicer.ready = flag

    def backends_ok() -> bool:
        """SERVING only while the verifier answers (a missing drafter only costs speed: AR fallback)."""
        e = servicer.engine
        return e is None or e.verifier.healthy(timeout=1.0)

    def near_deadline() -> None:
        servicer.aborting = True  # in-flight generations end with FINISH_REASON_ABORT

    return ServerSpec(
        name="orchestrator",
        service_names=[SERVICE_NAME],
        add_to_server=lambda server: add_servicer(
            server, servicer, pb.DESCRIPTOR.services_by_name["Generation"], servicer.auth_token
        ),
        load=servicer.load,
        set_ready=set_ready,
        near_deadline=near_deadline,
        max_workers=workers_for(servicer.max_sessions),
        max_receive_bytes=PUBLIC_MAX_RECEIVE_BYTES,
        health_watch=None if servicer.colocated else backends_ok,
        tls=tls,
        metrics=servicer.metrics,
    )
