"""One report, four translations: ``kakeya generate --json``, the gRPC ``Complete``, ``kakeya client`` (the
report rebuilt from the stream) and the HTTP API's ``usage`` and ``kakeya`` fields agree on one request."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kakeya.orchestrator.assembly import build_local_engine
from kakeya.orchestrator.fronts.grpc_api import report_from_stream
from kakeya.orchestrator.fronts.grpc_server import GenerationServicer
from kakeya.orchestrator.fronts.http_server import HttpCall, HttpFront
from kakeya.wire.kakeya.v1 import generate_pb2 as pb

PROMPT = "def add(a, b):"
MAX_TOKENS, BLOCK = 24, 4
# What is decided by the request and the models alone (timings differ from run to run)
SAME = ("token_ids", "prompt_token_ids", "text", "finish_reason", "block_size", "block_sizes", "acceptance_lengths",
        "mean_acceptance", "copied_blocks", "forced_blocks", "cached_tokens", "cache_policy", "cache_bounded", "verifier_kv_bytes",
        "quality", "sampling", "seed", "drafter_fallback")  # fmt: skip


@pytest.fixture(scope="module")
def front(tiny_pair):
    servicer = GenerationServicer(
        lambda: build_local_engine(str(tiny_pair.target), str(tiny_pair.draft), "mlx"), colocated=True
    )
    servicer.load()
    servicer.ready = True
    http = HttpFront(servicer, 0, "tiny")
    port = http.start("127.0.0.1")
    yield servicer, f"http://127.0.0.1:{port}"
    http.drain()
    http.join(5)


def _cli(tiny_pair) -> dict:
    """``kakeya generate --json`` in its own process, as a user runs it. Not ``main()`` in this one: here the
    servicer's compute thread already ran mlx-lm's module-level ``mx.compile`` functions, and MLX 0.32 (mlx#4327,
    mlx#4347) erases a compiled function's cache entries only in the thread that compiled it first, so the main
    thread's entries would outlive the interpreter and their thread-local destructor segfault at exit (rc 139)."""
    pair = ["--target", str(tiny_pair.target), "--draft", str(tiny_pair.draft), "--backend", "mlx"]
    args = ["generate", *pair, "--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS), "--block-size", str(BLOCK)]
    cmd = [sys.executable, "-m", "kakeya.app.main", *args, "--ignore-eos", "--json", "--ngram", "on"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


class _GrpcCall(HttpCall):
    """A gRPC servicer context as ``Generate`` reads it: a caller, no metadata."""

    def invocation_metadata(self):
        return ()

    def send_initial_metadata(self, metadata):  # grpc's: Generate sends the request id in it
        self.sent_metadata = metadata

    set_trailing_metadata = send_initial_metadata  # and in its trailers


def _grpc(servicer) -> tuple[pb.GenerateResponse.Complete, dict]:
    """The gRPC stream's Complete, and the report ``kakeya client`` rebuilds from the whole stream."""
    sp = pb.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ids, text, complete = [], [], None
    for resp in servicer.Generate(pb.GenerateRequest(text=PROMPT, sampling_params=sp, block_size=BLOCK), _GrpcCall()):
        if resp.HasField("chunk"):
            ids += resp.chunk.token_ids
            text.append(resp.chunk.text)
        else:
            complete = resp.complete
    model = servicer.GetModelInfo(pb.GetModelInfoRequest(), None)
    backend = servicer.GetServerInfo(pb.GetServerInfoRequest(), None).verifier_backend
    return complete, report_from_stream(model, backend, complete, ids, "".join(text)).to_json()


def _http(base) -> dict:
    import urllib.request

    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "block_size": BLOCK}
    req = urllib.request.Request(
        base + "/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_the_cli_grpc_client_and_http_report_one_request_alike(front, tiny_pair):
    servicer, base = front
    cli = _cli(tiny_pair)
    complete, client = _grpc(servicer)
    http = _http(base)
    assert len(cli["token_ids"]) == MAX_TOKENS and cli["finish_reason"] == "length"
    # kakeya client's JSON is kakeya generate's, field for field; a server names its checkpoints, never their paths
    assert {k: client[k] for k in SAME} == {k: cli[k] for k in SAME}
    assert (client["target"], client["draft"]) == (Path(cli["target"]).name, Path(cli["draft"]).name)
    # the Complete carries what the report says
    assert list(complete.stats.acceptance_lengths) == cli["acceptance_lengths"]
    assert (
        list(complete.stats.block_sizes) == cli["block_sizes"] and complete.stats.copied_blocks == cli["copied_blocks"]
    )
    assert (
        complete.completion_tokens == len(cli["token_ids"])
        and list(complete.prompt_token_ids) == cli["prompt_token_ids"]
    )
    # HTTP: the text, the usage and the kakeya fields
    assert http["choices"][0]["text"] == cli["text"] and http["choices"][0]["finish_reason"] == "length"
    usage = http["usage"]
    assert usage["prompt_tokens"] == len(cli["prompt_token_ids"]) and usage["completion_tokens"] == MAX_TOKENS
    assert usage["prompt_tokens_details"]["cached_tokens"] == cli["cached_tokens"]
    kakeya = http["kakeya"]
    for key in ("token_ids", "acceptance_lengths", "block_sizes", "block_size", "copied_blocks", "forced_blocks", "cache_policy",
                "mean_acceptance", "drafter_fallback"):  # fmt: skip
        assert kakeya[key] == cli[key], key
