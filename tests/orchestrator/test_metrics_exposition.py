"""The orchestrator's ``/metrics`` as a Prometheus operator reads it: what docs/operations.md's tables promise.

A colocated servicer in this process (tiny pair, MLX), its registry rendered as ``/metrics`` serves it and parsed
with ``prometheus_client``'s own text parser: each documented family is there with its type and labels, the
latencies measure what the table says they measure, and the series whose label values are known in advance exist
before anything happened, so an alert or a ratio over them reads 0 rather than nothing.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kakeya.orchestrator.assembly import build_local_engine
from kakeya.orchestrator.fronts.grpc_server import GenerationServicer
from kakeya.orchestrator.fronts.http_server import HttpCall
from kakeya.wire.kakeya.v1 import generate_pb2 as pb

DOC = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


@pytest.fixture(scope="module")
def servicer(tiny_pair):
    s = GenerationServicer(
        lambda: build_local_engine(str(tiny_pair.target), str(tiny_pair.draft), "mlx"), colocated=True
    )
    s.load()
    s.ready = True
    return s


class _Call(HttpCall):
    def invocation_metadata(self):
        return ()

    def send_initial_metadata(self, metadata):
        pass

    set_trailing_metadata = send_initial_metadata


def _families(servicer) -> dict:
    return {f.name: f for f in text_string_to_metric_families(generate_latest(servicer.metrics.registry).decode())}


def _value(fams: dict, family: str, sample: str) -> float:
    return sum(s.value for s in fams[family].samples if s.name == sample)


def _documented_orchestrator_metrics() -> dict[str, tuple[str, set[str]]]:
    """operations.md's "All servers" and "Orchestrator" tables: {name: (type, label names)}."""
    text = DOC.read_text().split("## Prefix cache")[0]
    out = {}
    for names, kind in re.findall(r"^\| (`kakeya_[^|]+)\| (\w+) \|", text, re.MULTILINE):
        for name, labels in re.findall(r"`(kakeya_\w+)(\{[^}]*\})?`", names):
            out[name] = (kind, set(re.findall(r"\w+", labels)))
    return out


def test_every_documented_metric_is_exported_with_its_type_and_labels(servicer):
    fams = _families(servicer)
    documented = _documented_orchestrator_metrics()
    assert len(documented) >= 20, documented  # the tables were read
    for name, (kind, labels) in documented.items():
        family = fams.get(name.removesuffix("_total") if kind == "counter" else name)
        assert family is not None and family.type == kind, (name, family and family.type)
        assert family.documentation, name  # HELP
        got = {k for s in family.samples for k in s.labels if k != "le"}
        assert got <= labels, (name, got, labels)


def test_time_to_first_token_and_e2e_latency_include_the_prefill(servicer):
    """TTFT is documented as "request start to the first token streamed (includes prefill)", but the observer's
    clock started only once the run had opened its sessions and prefilled: a colocated request whose prefill took
    tens of milliseconds reported a TTFT of a few microseconds, and its end-to-end latency left the prefill out."""
    before = _families(servicer)
    sp = pb.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    req = pb.GenerateRequest(text="def add(a, b):" * 8, sampling_params=sp, block_size=4)
    (complete,) = [r.complete for r in servicer.Generate(req, _Call()) if r.HasField("complete")]
    after = _families(servicer)

    def delta(family, sample):
        return _value(after, family, sample) - _value(before, family, sample)

    assert delta("kakeya_time_to_first_token_seconds", "kakeya_time_to_first_token_seconds_count") == 1
    prefill_s, total_s = complete.stats.prefill_s, complete.stats.total_s
    assert prefill_s > 0
    ttft = delta("kakeya_time_to_first_token_seconds", "kakeya_time_to_first_token_seconds_sum")
    assert ttft >= prefill_s, (ttft, prefill_s)
    e2e = delta("kakeya_e2e_request_latency_seconds", "kakeya_e2e_request_latency_seconds_sum")
    assert e2e >= total_s, (e2e, total_s)


@pytest.mark.parametrize(
    ("family", "label", "values"),
    [
        ("kakeya_request_success", "finished_reason", {"stop", "length", "abort", "error"}),
        ("kakeya_ar_fallbacks", "reason", {"drafter_failed", "drafter_backoff", "drafter_busy", "drafter_full"}),
        ("kakeya_takeovers", "role", {"verifier", "drafter"}),
        ("kakeya_drain_handoffs", "role", {"verifier", "drafter"}),
        ("kakeya_takeover_pause_seconds", "role", {"verifier", "drafter"}),
    ],
)
def test_series_whose_labels_are_known_exist_before_anything_happened(servicer, family, label, values):
    """A labelled counter had no series until its first increment: ``rate(kakeya_request_success_total{
    finished_reason="error"}[5m])`` or an alert on ``increase(kakeya_takeovers_total[10m])`` read an empty result
    (no data) instead of 0 on a healthy server, and an error ratio over them had no value at all."""
    samples = _families(servicer)[family].samples
    assert {s.labels.get(label) for s in samples} >= values, sorted({s.labels.get(label) for s in samples} - {None})


class _Aborted(Exception):
    pass


def _refusal_lines(caplog, rid: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "request_id", "") == rid and r.levelno >= logging.INFO]


def test_a_refused_http_request_has_a_log_line_under_the_id_its_answer_names(servicer, caplog):
    """A refused request's answer names its id (``X-Request-Id``) for its client to quote to the operator, but the
    orchestrator logged nothing under it: ``generate:`` / ``finished:`` are written only for a run that starts. The
    line names the status and the field, never the request's text."""
    import http.client
    import json

    from kakeya.orchestrator.fronts.http_server import HttpFront

    front = HttpFront(servicer, 0, "tiny")
    port = front.start("127.0.0.1")
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        body = {"model": "tiny", "prompt": "SECRET-PROMPT", "max_tokens": -5}
        with caplog.at_level(logging.INFO):
            conn.request("POST", "/v1/completions", json.dumps(body), {"X-Request-Id": "obs-refused-1"})
            r = conn.getresponse()
            r.read()
        assert (r.status, r.getheader("X-Request-Id")) == (400, "obs-refused-1")
    finally:
        front.drain()
        front.join(5)
    (line,) = _refusal_lines(caplog, "obs-refused-1")
    assert "400" in line.getMessage() and "max_tokens" in line.getMessage(), line.getMessage()
    assert "SECRET" not in line.getMessage()


def test_a_refused_grpc_generate_has_a_log_line_under_the_id_its_trailers_name(servicer, caplog):
    """The same over gRPC, through the server's interceptor as a real server runs it, with the id the orchestrator
    made up (the client sent none): the trailers name it, and so does the log line."""
    import grpc

    from kakeya.runtime import logs
    from kakeya.runtime.metrics import RpcInterceptor

    class Context(_Call):
        code_ = None

        def abort(self, code, details):
            self.code_ = code
            raise _Aborted(details)  # as grpc's own abort raises

        def code(self):
            return self.code_

        def set_trailing_metadata(self, metadata):
            self.trailers = dict(metadata)

    handler = grpc.unary_stream_rpc_method_handler(servicer.Generate)
    details = type("Details", (), {"invocation_metadata": (), "method": "/kakeya.v1.Generation/Generate"})()
    wrapped = RpcInterceptor(servicer.metrics).intercept_service(lambda _: handler, details)
    sp = pb.SamplingParams(max_tokens=10**6)
    context = Context()
    caplog.handler.addFilter(logs.ContextFilter())  # as setup_logging's handler: the bound ids onto each record
    with caplog.at_level(logging.INFO), pytest.raises(_Aborted):
        list(wrapped.unary_stream(pb.GenerateRequest(text="SECRET-PROMPT", sampling_params=sp), context))
    assert context.code_ == grpc.StatusCode.INVALID_ARGUMENT
    (line,) = _refusal_lines(caplog, context.trailers["x-request-id"])
    assert "INVALID_ARGUMENT" in line.getMessage() and "SECRET" not in line.getMessage(), line.getMessage()


def test_the_gateway_gauges_are_served_while_the_orchestrator_loads(tiny_pair):
    """``/metrics`` is served from the start (before the models load), but ``kakeya_kv_cache_usage_perc`` was
    registered only at the end of ``load()``: while a replica loaded (minutes for a large checkpoint) it lacked one
    of the three gauges docs/deploy.md lists for the inference gateway, as a gap, not a 0."""
    loading = GenerationServicer(lambda: None, colocated=True)  # never loaded
    fams = _families(loading)
    for name in ("kakeya_num_requests_waiting", "kakeya_num_requests_running", "kakeya_kv_cache_usage_perc"):
        assert _value(fams, name, name) == 0, name
