"""The public Generation API (``protos/kakeya/v1/generate.proto``): translation only.

Holds an :class:`~kakeya.orchestrator.engine.Engine` whose verifier and
drafter are either in-process (colocated) or gRPC clients (split,
``remote.py``); it never asks which. A request is parsed into a
:class:`~kakeya.core.request.Request` (``requests.py``) and run as the
engine's :class:`~kakeya.orchestrator.engine.Run`; each committed block goes
out as a ``Chunk`` (token ids + their text, cut at stop strings), then one
``Complete`` with the finish reason, token counts and the speculative stats
the CLI prints.

Faults: a drafter that fails mid-generation is dropped for the rest of that
generation (the run's drafter fallback: the verifier finishes alone, same
output, ``drafter_fallback`` set) and retried by later requests after a
backoff. A failing verifier ends the RPC with its status (UNAVAILABLE,
RESOURCE_EXHAUSTED, ...) before the first chunk, or with a ``Complete`` of
``FINISH_REASON_ERROR`` after it. The client's deadline bounds the backend
streams; cancelling the call cancels the run, which frees the backend sessions.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc

from kakeya.core.request import Request
from kakeya.orchestrator.engine import Engine, RunOptions
from kakeya.orchestrator.errors import fallback_reason, public_status
from kakeya.orchestrator.quality import quality_report
from kakeya.orchestrator.requests import Limits, parse_request
from kakeya.orchestrator.text import text_stream
from kakeya.runtime import bounds, logs
from kakeya.runtime.auth import peer_of
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


def _deadline(context) -> float | None:
    """Seconds left of the client's deadline (None without one): the backends' timeout."""
    left = None if context is None else context.time_remaining()
    return None if left is None or left > 1e7 else max(left, 0.001)


def model_name(path: str) -> str:
    """A checkpoint's public name: its directory's name, never the server's path to it."""
    return Path(path).name if path else ""


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(
        self,
        build: Callable[[], Engine],
        *,
        colocated: bool,
        max_tokens_limit: int = DEFAULT_MAX_TOKENS_LIMIT,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        max_sessions_per_peer: int = 0,
        max_prompt_tokens: int = 0,
        restore: bounds.RestoreSources | None = None,
        auth_token: str | None = None,
        prefixes=None,
    ):
        if not 1 <= default_max_tokens <= max_tokens_limit:
            raise ValueError(
                f"default max tokens {default_max_tokens} must be in 1..{max_tokens_limit} (--max-tokens-limit)"
            )
        if max_prompt_tokens < 0:
            raise ValueError(f"--max-prompt-tokens must be >= 0 (0: the default), got {max_prompt_tokens}")
        self.max_prompt_tokens_flag = max_prompt_tokens
        self.max_prompt_tokens = 0  # set by load(): never above the target's max_position_embeddings
        self.max_position_embeddings = 0
        self.max_context = 0  # positions one verifier session may hold
        self.restore = (
            restore  # colocated: the --restore sources requests may name; None: the remote verifier maps names
        )
        self.auth_token = auth_token
        self._build = build
        self.engine: Engine | None = None
        self.colocated = colocated
        self.compute = ComputeThread("orchestrator") if colocated else None
        self.max_tokens_limit = max_tokens_limit
        self.default_max_tokens = default_max_tokens
        self.max_sessions = max_sessions
        self.max_sessions_per_peer = max_sessions_per_peer
        self.ready = False
        self.aborting = False
        self.verifier_down = False  # its health checks fail (the health watch): refuse at once, not after a timeout
        self._lock = threading.Lock()
        self.active = 0
        self.by_peer: dict[str, int] = {}  # generations in flight per caller (auth.peer_of)
        self.total = 0
        self.started = time.monotonic()
        self.metrics = ServerMetrics("orchestrator")
        self.metrics.track_sessions(lambda: self.active, lambda: self.total)
        if prefixes is not None:  # colocated: the prefix cache the engine's verifier and drafter share
            self.metrics.track_prefix_cache(prefixes)

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
        warmup = Request(
            [i % vocab for i in range(1, 5)], 3, min(2, e.default_block_size), ignore_eos=True, request_id="warmup"
        )
        final = None
        for resp in self._generate(warmup, observe=False):  # warm-up: not in the metrics
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

    def parse(self, r: pb.GenerateRequest) -> Request:
        limits = Limits(
            self.max_tokens_limit, self.default_max_tokens, self.max_prompt_tokens, self.max_context, self.restore
        )
        return parse_request(r, self.engine, limits)

    # -- RPCs ----------------------------------------------------------------------------

    def Generate(self, request, context) -> Iterator[pb.GenerateResponse]:
        try:
            yield from self.stream(request, context)
        except RequestError as exc:
            context.abort(exc.code, exc.message)

    def stream(self, request: pb.GenerateRequest, context) -> Iterator[pb.GenerateResponse]:
        """One generation, for every front (gRPC, HTTP): RequestError while nothing was streamed (not ready,
        the verifier known down, a bad request, over --max-sessions or --max-sessions-per-peer, a failure
        before the first chunk), else Chunks then one Complete.

        ``context``: the call's ``peer()`` (for the per-peer cap), ``time_remaining()`` (the backends'
        deadline) and ``add_callback(fn)`` (run when the client goes away: it cancels the run).
        """
        if not self.ready:
            raise RequestError(
                grpc.StatusCode.UNAVAILABLE, "orchestrator is not ready (loading, warming up or draining)"
            )
        if self.verifier_down:
            raise RequestError(
                grpc.StatusCode.UNAVAILABLE, "verifier unavailable (its health checks fail); retry later"
            )
        req = self.parse(request)
        token = logs.bind(request_id=req.request_id)
        peer = peer_of(context)
        with self._lock:
            problem = self._admission_problem(peer)
            if problem:
                logs.reset(token)
                raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"orchestrator: {problem}")
            self.active += 1
            self.by_peer[peer] = self.by_peer.get(peer, 0) + 1
            self.total += 1
        try:
            yield from self._generate(req, context)
        finally:
            with self._lock:
                self.active -= 1
                self.by_peer[peer] -= 1
                if not self.by_peer[peer]:
                    del self.by_peer[peer]
            logs.reset(token)

    def _admission_problem(self, peer: str) -> str | None:
        """Why one more generation of ``peer`` is refused (under the lock), or None."""
        if self.max_sessions and self.active >= self.max_sessions:
            return f"{self.active} of {self.max_sessions} generations in flight (--max-sessions)"
        held = self.by_peer.get(peer, 0)
        if self.max_sessions_per_peer and held >= self.max_sessions_per_peer:
            return f"{held} of {self.max_sessions_per_peer} generations in flight from this caller (--max-sessions-per-peer)"
        return None

    def _generate(self, req: Request, context=None, observe: bool = True) -> Iterator[pb.GenerateResponse]:
        """Stream one generation; RequestError before the first chunk, Complete(error) after it, nothing once cancelled."""
        t_start = time.perf_counter()
        try:
            run = self.engine.start(req, RunOptions(_deadline(context), self.step, drafter_fallback=True))
        except Exception as exc:  # noqa: BLE001 - every failure to start becomes a public status
            raise RequestError(*public_status(exc, req.request_id)) from None
        if context is not None and not context.add_callback(run.cancel):
            run.cancel()  # the call ended while the sessions opened
        obs = self.metrics.generation(run.verifier_session, run.drafter_session, req) if observe else NO_OBSERVER
        text = text_stream(self.engine.codec, req.stop_strings)
        chunks, error = 0, ""
        try:
            for block in run:
                obs.block(block)
                ids, delta, hit = text.add(block.tokens)
                chunks += 1
                yield pb.GenerateResponse(chunk=pb.GenerateResponse.Chunk(token_ids=ids, text=delta))
                if hit:
                    run.stop(len(ids))
                elif self.aborting:
                    run.close()  # the server is going down: FINISH_REASON_ABORT
        except Exception as exc:  # noqa: BLE001 - the run failed (and closed its sessions)
            code, msg = public_status(exc, req.request_id)
            if not chunks:
                raise RequestError(code, msg) from None
            log.warning("request %s failed mid-generation: %s", req.request_id, msg)
            error = msg
        finally:
            run.close()  # also when the client went away while a chunk was on its way
            gen = run.result
            fallback = fallback_reason(run.drafter_error, run.cancelled)
            if run.cancelled:
                obs.finish("abort", fallback=fallback, prompt_tokens=len(req.prompt_ids), tokens=len(gen.token_ids))
        if run.cancelled:
            return
        tail = text.flush()
        if tail:
            yield pb.GenerateResponse(chunk=pb.GenerateResponse.Chunk(text=tail))
        obs.finish(
            gen.finish_reason,
            fallback=fallback,
            prompt_tokens=len(req.prompt_ids),
            tokens=len(gen.token_ids),
            cached_tokens=gen.cached_tokens,
        )
        # run.request: a rejection-rule request's auto resolved to the block size it ran at
        yield pb.GenerateResponse(complete=self._complete(run.request, gen, time.perf_counter() - t_start, error))

    def _complete(self, req: Request, gen, total_s: float, error: str):
        vstats = gen.verifier_stats
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
            block_size=req.block_size,
            block_sizes=[b.drafted + 1 for b in gen.blocks[1:]],  # as Engine.report counts them
            cache_kind=_cache_kind(vstats.get("cache_policy", "")),
            cache_policy=vstats.get("cache_policy", ""),
            cache_bounded=bool(vstats.get("bounded", False)),
        )
        complete = pb.GenerateResponse.Complete(
            finish_reason=FINISH[gen.finish_reason],
            prompt_tokens=len(req.prompt_ids),
            completion_tokens=len(gen.token_ids),
            stats=stats,
            error_message=error,
            prompt_token_ids=req.prompt_ids,
            cached_tokens=gen.cached_tokens,
        )
        if not gen.sampling.greedy:
            complete.seed = gen.sampling.seed
            complete.sampling_rule = wire_contract.rule_to_proto(gen.sampling.rule)
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
            target_model=model_name(e.target),
            draft_model=model_name(e.draft),
            default_block_size=e.default_block_size,
            max_tokens_limit=self.max_tokens_limit,
            default_max_tokens=self.default_max_tokens,
            has_tokenizer=e.codec is not None,
            default_cache_policy=wire_contract.policy_to_proto(policy),
            target_layer_ids=list(e.verifier.aux_layers),
            max_prompt_tokens=self.max_prompt_tokens,
            max_position_embeddings=self.max_position_embeddings,
            has_chat_template=e.codec is not None and e.codec.chat is not None,
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


def server_spec(servicer: GenerationServicer, tls=None, http=None) -> ServerSpec:
    """``http``: the OpenAI HTTP front (``http_server.HttpFront``) served beside the gRPC API, or None."""

    def set_ready(flag: bool) -> None:
        servicer.ready = flag

    def backends_ok() -> bool:
        """SERVING only while the verifier answers (a missing drafter only costs speed: AR fallback)."""
        e = servicer.engine
        ok = e is None or e.verifier.healthy(timeout=1.0)
        servicer.verifier_down = not ok
        return ok

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
        http=http,
    )
