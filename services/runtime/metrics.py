"""Prometheus metrics of every kakeya server, named after vLLM's so its dashboards carry over.

Each server owns a :class:`ServerMetrics` with its own ``CollectorRegistry`` (never the process-global one, so
tests can run several servers in one process), served on ``--metrics-port`` at ``/metrics``. Every server exports
``kakeya_errors_total{code}`` (:class:`RpcInterceptor`, which also binds each RPC's request id to the log
context) and ``kakeya_sessions_live``; the orchestrator adds the request and speculative-decoding series
(:class:`GenerationObserver`), the verifier and drafter their cache bytes. ``docs/operations.md`` lists them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, ClassVar

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kakeya.runtime import bounds, logs

log = logging.getLogger("kakeya.orchestrator")

# Seconds; from 1 ms (a tiny model's block) to 80 s (a long generation on a CPU).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                   20.0, 40.0, 80.0)  # fmt: skip
ROLES, FINISHED = ("verifier", "drafter"), ("stop", "length", "abort", "error")
FALLBACKS = ("drafter_failed", "drafter_backoff", "drafter_busy", "drafter_full")


def _known(family, values: tuple):
    """``family`` with a series (0) for each of ``values`` of its label: a rate or an alert reads 0, not no data."""
    for value in values:
        family.labels(value)
    return family


class _Scraped:
    """A family read from the server's own state at scrape time: a counter (``label`` None: e.g. the session
    registry's total) or a gauge by ``label`` (``read`` returns a dict: e.g. KV bytes by kind)."""

    def __init__(self, name: str, doc: str, read: Callable, label: str | None = None):
        self.name, self.doc, self.read, self.label = name, doc, read, label

    def describe(self):
        if self.label is None:
            return [CounterMetricFamily(self.name, self.doc)]
        return [GaugeMetricFamily(self.name, self.doc, labels=[self.label])]

    def collect(self):
        (family,) = self.describe()
        values = sorted(self.read().items()) if self.label is not None else [(None, self.read())]
        for key, value in values:
            family.add_metric([] if key is None else [key], float(value))
        yield family


class _PrefixCacheMetrics:
    """A prefix cache's (``core/prefix.py``) series, from one ``stats()`` per scrape."""

    GAUGES: ClassVar[dict[str, str]] = {"bytes": "bytes of snapshots held", "peak_bytes": "the most bytes of snapshots ever held at once", "budget_bytes": "the byte budget (--prefix-cache-bytes)",
              "entries": "snapshots held"}  # fmt: skip
    COUNTERS: ClassVar[dict[str, str]] = {"hits": "prompts resumed from a snapshot", "misses": "prompts looked up and prefilled cold",
                "tokens_reused": "prompt tokens resumed instead of prefilled", "insertions": "snapshots kept",
                "evictions": "snapshots evicted to stay within the budget (least recently used first)"}  # fmt: skip

    def __init__(self, read: Callable[[], dict[str, int]]):
        self.read = read

    def collect(self):
        stats = self.read()
        for key, doc in self.GAUGES.items():
            yield GaugeMetricFamily(f"kakeya_prefix_cache_{key}", doc, value=float(stats[key]))
        for key, doc in self.COUNTERS.items():
            yield CounterMetricFamily(f"kakeya_prefix_cache_{key}", doc, value=float(stats[key]))

    def describe(self):
        yield from (GaugeMetricFamily(f"kakeya_prefix_cache_{k}", d) for k, d in self.GAUGES.items())
        yield from (CounterMetricFamily(f"kakeya_prefix_cache_{k}", d) for k, d in self.COUNTERS.items())


class ServerMetrics:
    """The metrics of one server (``role``: orchestrator, verifier or drafter)."""

    def __init__(self, role: str):
        self.role = role
        self.registry = r = CollectorRegistry()
        self.errors = Counter("kakeya_errors", "RPCs that ended with a non-OK gRPC status", ["code"], registry=r)
        self.sessions_live = Gauge(
            "kakeya_sessions_live", "sessions (verifier, drafter) or generations (orchestrator) in flight", registry=r
        )
        if role == "orchestrator":
            self._orchestrator(r)

    def _orchestrator(self, r: CollectorRegistry) -> None:
        def counter(name: str, doc: str, *labels: str, known: tuple = ()) -> Counter:
            return _known(Counter(f"kakeya_{name}", doc, labels, registry=r), known)

        def histogram(name: str, doc: str, *labels: str, known: tuple = ()) -> Histogram:
            return _known(Histogram(f"kakeya_{name}_seconds", doc, labels, buckets=LATENCY_BUCKETS, registry=r), known)

        self.num_drafts = counter("spec_decode_num_drafts", "blocks the drafter proposed candidates for")
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "candidate tokens proposed")
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "candidate tokens the target accepted")
        by_pos = "accepted candidates by position in the block (0 = first)"
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos", by_pos, "position")
        self.request_success = counter("request_success", "generations finished", "finished_reason", known=FINISHED)
        self.running = Gauge("kakeya_num_requests_running", "generations in flight", registry=r)
        self.waiting = Gauge("kakeya_num_requests_waiting", "generations queued for admission (--queue)", registry=r)
        self.prompt_tokens = counter("prompt_tokens", "prompt tokens (prefix-cached ones included)")
        cached = "prompt tokens resumed from a prefix cache instead of prefilled"
        self.cached_tokens = counter("prompt_tokens_cached", cached)
        self.generation_tokens = counter("generation_tokens", "tokens generated")
        self.ttft = histogram("time_to_first_token", "request start to first token streamed (prefill included)")
        itl = "time between streamed blocks (one observation per block, as vLLM per step)"
        self.itl = histogram("inter_token_latency", itl)
        self.e2e = histogram("e2e_request_latency", "request start to Complete")
        phase = "one decode block's time by phase (wire: split deployments only)"
        self.block_latency = histogram("block_latency", phase, "phase")
        fallbacks = f"generations the verifier finished alone, by reason ({', '.join(FALLBACKS)}); no client's cancel"
        self.ar_fallbacks = counter("ar_fallbacks", fallbacks, "reason", known=FALLBACKS)
        self.takeovers = counter("takeovers", "sessions reopened on another replica after theirs was lost mid-stream,"
                                 " by role (verifier, drafter)", "role", known=ROLES)  # fmt: skip
        self.drain_handoffs = counter("drain_handoffs", "sessions moved to another replica because theirs was"
                                      " draining (SIGTERM), by role (verifier, drafter); no failure: not in"
                                      " kakeya_takeovers", "role", known=ROLES)  # fmt: skip
        self.takeover_pause = histogram("takeover_pause", "a take-over's or drain hand-off's pause: the replica's loss"
                                        " (or drain) noticed to the session reopened (its prefill done), by role",
                                        "role", known=ROLES)  # fmt: skip

    def takeover(self, role: str, pause_s: float, drained: bool = False) -> None:
        """One take-over (``orchestrator/decode/takeover.py``) and its pause; ``drained``: a draining replica's
        hand-off, counted apart from the losses."""
        (self.drain_handoffs if drained else self.takeovers).labels(role).inc()
        self.takeover_pause.labels(role).observe(pause_s)

    def track_sessions(self, live: Callable[[], int], total: Callable[[], int]) -> None:
        """``kakeya_sessions_live`` and ``kakeya_sessions_total``, read from the server at scrape time."""
        self.sessions_live.set_function(lambda: float(live()))
        self.registry.register(_Scraped("kakeya_sessions", "sessions (orchestrator: generations) started", total))
        if self.role == "orchestrator":
            self.running.set_function(lambda: float(live()))

    def track_kv_bytes(self, read: Callable[[], dict[str, int]]) -> None:
        """``kakeya_kv_cache_bytes{kind}``: bytes held by live sessions' caches, read at scrape time."""
        self.registry.register(_Scraped("kakeya_kv_cache_bytes", "KV cache bytes held by live sessions", read, "kind"))

    def track_kv_usage(self, read: Callable[[], float]) -> None:
        """``kakeya_kv_cache_usage_perc``: the K/V bytes admitted sessions may grow to, as a fraction (0..1) of the
        budget admission counts against (``--max-kv-bytes``; 0 without one), read at scrape time: the Gateway API
        Inference Extension's KVCacheUtilization, vLLM's ``vllm:kv_cache_usage_perc`` (docs/deploy.md)."""
        doc = "K/V bytes reserved by admitted sessions over the --max-kv-bytes budget (0..1; 0 without a budget)"
        Gauge("kakeya_kv_cache_usage_perc", doc, registry=self.registry).set_function(lambda: float(read()))

    def track_prefix_cache(self, cache: Any) -> None:
        """``kakeya_prefix_cache_*`` of a ``PrefixCache`` (``core/prefix.py``), read at scrape time."""
        self.registry.register(_PrefixCacheMetrics(cache.stats))

    def track_steps(self, names: tuple[str, str], doc: str, calls: Callable[[], int], items: Callable[[], int]):
        """Calls and the session steps they carried, read at scrape time as ``kakeya_<names[0]>_total`` and
        ``kakeya_<names[1]>_total`` (their ratio: steps per call): a ``ComputeThread``'s batched runner calls, a
        session server's round calls (``runtime/servicer.py``)."""
        self.registry.register(_Scraped(f"kakeya_{names[0]}", doc, calls))
        self.registry.register(_Scraped(f"kakeya_{names[1]}", "session steps those calls carried", items))

    def generation(self, verifier_session: Any, drafter_session: Any, params: Any, t0: float) -> GenerationObserver:
        """The observer of one generation of ``params`` (a ``CheckedRequest``) begun at ``t0``, before it prefilled."""
        n = len(params.prompt_ids)
        log.info("generate: %d prompt tokens, max_tokens %d, block %d", n, params.max_tokens, params.block_size)
        return GenerationObserver(self, verifier_session, drafter_session, t0)


class GenerationObserver:
    """Feeds one generation's blocks into the orchestrator's metrics as they stream."""

    def __init__(self, metrics: ServerMetrics, vs: Any, ds: Any, t0: float):
        self.m, self.vs, self.ds, self.t0 = metrics, vs, ds, t0
        self.t_last: float | None = None
        self.server_s = self._server_total()
        self.accepted = self.drafts = 0

    def _server_total(self) -> float | None:
        v = self.vs.server_s  # (``service._SessionTime``: a remote session's backend time so far; None in process)
        return None if v is None else v + (self.ds.server_s or 0.0)

    def block(self, b) -> None:
        m, now = self.m, time.perf_counter()
        total = self._server_total()
        if self.t_last is None:  # the prefill's token
            m.ttft.observe(now - self.t0)
        else:
            m.itl.observe(now - self.t_last)
            m.block_latency.labels("draft").observe(b.draft_s)
            m.block_latency.labels("verify").observe(b.verify_s)
            if total is not None and self.server_s is not None:
                # client time minus the backends' own handler time (their Session responses' elapsed_s)
                client = b.verify_s + (b.draft_s if self.ds.server_s is not None else 0.0)
                m.block_latency.labels("wire").observe(max(0.0, client - (total - self.server_s)))
        self.t_last, self.server_s = now, total
        if b.drafted > 0:
            self.drafts, self.accepted = self.drafts + 1, self.accepted + b.accepted
            m.num_drafts.inc()
            m.num_draft_tokens.inc(b.drafted)
            m.num_accepted_tokens.inc(b.accepted)
            for pos in range(b.accepted):
                m.accepted_per_pos.labels(str(pos)).inc()

    def finish(self, reason: str, *, fallback: str | None = None, prompt_tokens=0, tokens=0, cached_tokens=0) -> None:
        """The generation ended (``reason``: its finish reason); ``fallback``: why it lost its drafter, if it did;
        ``cached_tokens``: prompt positions resumed from the prefix caches."""
        self.m.request_success.labels(reason).inc()
        self.m.e2e.observe(time.perf_counter() - self.t0)
        self.m.prompt_tokens.inc(prompt_tokens)
        self.m.cached_tokens.inc(cached_tokens)
        self.m.generation_tokens.inc(tokens)
        log.info("finished: %s, %d tokens, %d drafts, %d accepted", reason, tokens, self.drafts, self.accepted)
        if fallback:
            self.m.ar_fallbacks.labels(fallback).inc()
            log.warning("the verifier finished alone: AR fallback (%s)", fallback)


NO_OBSERVER = SimpleNamespace(block=lambda b: None, finish=lambda reason, **kw: None)  # a generation not observed


class RpcInterceptor(grpc.ServerInterceptor):
    """Counts non-OK statuses into ``kakeya_errors_total{code}`` and binds the request id (``x-request-id`` metadata,
    else the request's ``request_id``) for logs."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def _count(self, context, exc: BaseException | None) -> None:
        code = context.code()
        if code is None and exc is not None:
            code = grpc.StatusCode.CANCELLED if isinstance(exc, GeneratorExit) else grpc.StatusCode.UNKNOWN
        if code is not None and code != grpc.StatusCode.OK:  # counted, and logged under the call's request id
            self.metrics.errors.labels(name := getattr(code, "name", str(code))).inc()
            logging.getLogger("kakeya").info("call ended with %s", name)  # on every server, not the orchestrator alone

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None:
            return None
        rid = dict(details.invocation_metadata or ()).get("x-request-id", "")
        rid = rid if len(rid) <= bounds.MAX_REQUEST_ID_CHARS and bounds.REQUEST_ID.fullmatch(rid) else ""  # as checked

        def bound(request):
            own = "" if hasattr(request, "__next__") else getattr(request, "request_id", "")
            return logs.bind(request_id=rid or own)

        if handler.unary_unary:
            inner = handler.unary_unary

            def unary(request, context):
                token = bound(request)
                try:
                    out = inner(request, context)
                except BaseException as exc:
                    self._count(context, exc)
                    raise
                finally:
                    logs.reset(token)
                self._count(context, None)
                return out

            return grpc.unary_unary_rpc_method_handler(unary, handler.request_deserializer, handler.response_serializer)

        def streaming(inner):
            def run(request, context):
                token = bound(request)
                try:
                    yield from inner(request, context)
                except BaseException as exc:
                    self._count(context, exc)
                    raise
                else:
                    self._count(context, None)
                finally:
                    logs.reset(token)

            return run

        for kind in ("unary_stream", "stream_stream"):
            if inner := getattr(handler, kind):
                serde = handler.request_deserializer, handler.response_serializer
                return getattr(grpc, f"{kind}_rpc_method_handler")(streaming(inner), *serde)
        return handler  # client streaming: none in kakeya's services
