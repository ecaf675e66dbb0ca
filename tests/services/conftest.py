"""Real server processes on loopback, started with the project's own commands.

Every process is started as ``python -m kakeya.app.main serve ...``
with ``--port 0`` (or a port it had before, for restarts) and a ``--ready-file``
it writes once SERVING. Each runs in its own process group, and every fixture's
finalizer terminates it (SIGTERM, then SIGKILL of the group), so a failing test
never leaves a server behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from kakeya.wire.kakeya.v1 import (
    drafter_pb2,
    drafter_pb2_grpc,
    generate_pb2,
    generate_pb2_grpc,
    verifier_pb2,
    verifier_pb2_grpc,
)
from kakeya.wire.limits import channel_options

from ..waiting import holds_for, wait_until  # noqa: F401  (re-exported: the server tests import them from here)

ROOT = Path(__file__).resolve().parents[2]


def _tiny() -> list[str]:
    from kakeya.checkpoints.tiny import default_pair

    p = default_pair()
    return ["--target", str(p.target), "--draft", str(p.draft)]


# serve's default is the embedded demo pair on the fastest backend; these tests run the tiny random
# pair (sliding window 32: rings wrap within a few hundred tokens) on MLX, the mlx-lm reference's.
TINY = _tiny()
TINY_MLX = [*TINY, "--backend", "mlx"]
TINY_ALL_MLX = [*TINY, "--verifier-backend", "mlx", "--drafter-backend", "mlx"]
START_TIMEOUT = 180.0  # model servers import mlx + mlx-lm and warm up; slow on 2 shared cores
# The orchestrators' step deadline of silence (--backend-timeout) in these tests: one only a hung backend trips.
# The 2-s default failed 3 of 1,558 tests (honest steps, "verifier did not answer in time") in a full run while
# two `kakeya generate` loops and a test run kept both cores busy (load ~9). The tests of hung backends and of
# Progress pass their own short one.
TEST_BACKEND_TIMEOUT_S = 60


class Server:
    """One `kakeya serve ...` process."""

    def __init__(self, name: str, argv: list[str], tmp: Path, port: int = 0, prefix: list[str] | None = None):
        self.name, self.argv, self.tmp = name, list(argv), tmp
        self.prefix = list(prefix or [])  # e.g. ``Hosts.prefix(host)``: run it on a test host (tests/hosts.py)
        self.port = port
        self.proc: subprocess.Popen | None = None
        self.addr = ""
        self.info: dict = {}
        self.starts = 0

    def start(self) -> Server:
        self.starts += 1
        tag = f"{self.name}-{id(self):x}-{self.starts}"
        self.ready_file = self.tmp / f"{tag}.ready.json"
        self.log_file = self.tmp / f"{tag}.log"
        cmd = [*self.prefix, sys.executable, "-m", "kakeya.app.main", "serve", *self.argv]
        if self.argv[0] in ("orchestrator", "all") and "--backend-timeout" not in self.argv:
            cmd += ["--backend-timeout", str(TEST_BACKEND_TIMEOUT_S)]
        cmd += ["--port", str(self.port), "--ready-file", str(self.ready_file)]
        with open(self.log_file, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def wait_ready(self, timeout: float = START_TIMEOUT) -> Server:
        deadline = time.monotonic() + timeout
        while not self.ready_file.is_file():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}) before ready:\n{self.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not ready after {timeout} s:\n{self.log()}")
            time.sleep(0.05)
        self.info = json.loads(self.ready_file.read_text())
        self.addr = self.info["addr"]
        if "port" in self.info:
            self.port = self.info["port"]  # a restart comes back on the same port
        return self

    def log(self) -> str:
        try:
            return self.log_file.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM, ``grace`` seconds to drain, then SIGKILL the whole process group (children of `serve all`
        included). ``grace`` 0: SIGKILL at once (``stop_all`` has sent the SIGTERM and waited already)."""
        if self.proc is None:
            return
        if self.proc.poll() is None and grace > 0:
            self.proc.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # our own child's group: nothing else is in it
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass


def start_all(servers: list[Server]) -> None:
    for s in servers:
        s.start()
    for s in servers:
        s.wait_ready()


def stop_all(servers: list[Server], grace: float = 15.0) -> None:
    """Stop servers together: SIGTERM to every one (the last started, e.g. orchestrators, first), ``grace`` seconds
    for all their drains at once, then SIGKILL what is left. One by one, each waited out its own drain after the
    last: test_hosts.py's seven servers took 54 s of teardown."""
    live = [s for s in reversed(servers) if s.alive()]
    for s in live:
        s.proc.terminate()
    deadline = time.monotonic() + grace
    for s in live:
        try:
            s.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for s in servers:
        s.stop(grace=0)


@pytest.fixture(scope="module")
def server_factory(tmp_path_factory):
    """Start servers that are stopped when the module is done, whatever happens."""
    tmp = tmp_path_factory.mktemp("servers")
    started: list[Server] = []

    def make(name: str, argv: list[str], port: int = 0, prefix: list[str] | None = None) -> Server:
        s = Server(name, argv, tmp, port, prefix)
        started.append(s)
        return s

    yield make
    stop_all(started)


# --------------------------------------------------------------------------- clients


def channel(addr: str, token: str | None = None) -> grpc.Channel:
    """A plaintext channel; ``token``: sent as ``authorization: Bearer`` on every call."""
    from kakeya.runtime.security.auth import with_bearer

    return with_bearer(grpc.insecure_channel(addr, options=channel_options()), token)


def generation_stub(addr: str, token: str | None = None):
    return generate_pb2_grpc.GenerationStub(channel(addr, token))


def verifier_stub(addr: str, token: str | None = None):
    return verifier_pb2_grpc.VerifierServiceStub(channel(addr, token))


def drafter_stub(addr: str, token: str | None = None):
    return drafter_pb2_grpc.DrafterServiceStub(channel(addr, token))


def verifier_info(addr: str, token: str | None = None):
    return verifier_stub(addr, token).GetInfo(verifier_pb2.GetVerifierInfoRequest(), timeout=10)


def drafter_info(addr: str, token: str | None = None):
    return drafter_stub(addr, token).GetInfo(drafter_pb2.GetDrafterInfoRequest(), timeout=10)


def internal_rpcs(service: str, addr: str, token: str | None = None) -> list:
    """Every RPC of a verifier or drafter (GetInfo, a short Session, a round naming no session of the caller) as calls of a client holding ``token``."""
    if service == "verifier":
        v, V = verifier_stub(addr, token), verifier_pb2.VerifierRequest
        return [
            lambda: v.GetInfo(verifier_pb2.GetVerifierInfoRequest(), timeout=10),
            lambda: list(v.Session(iter([V(open=V.Open()), V(prefill=V.Prefill(token_ids=[2, 40, 41]))]), timeout=10)),
            lambda: list(v.VerifyRound(verifier_pb2.VerifyRoundRequest(items=[{"session_id": "0" * 12}]), timeout=10)),
        ]
    d, D = drafter_stub(addr, token), drafter_pb2.DrafterRequest
    return [
        lambda: d.GetInfo(drafter_pb2.GetDrafterInfoRequest(), timeout=10),
        lambda: list(d.Session(iter([D(open=D.Open())]), timeout=10)),
        lambda: list(d.DraftRound(drafter_pb2.DraftRoundRequest(items=[{"session_id": "0" * 12}]), timeout=10)),
    ]


def assert_unauthenticated(service: str, addr: str, token: str | None = None) -> None:
    """Every RPC of the verifier or drafter at ``addr`` is UNAUTHENTICATED for a client holding ``token``."""
    for call in internal_rpcs(service, addr, token):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, (service, err.value.details())


def request(
    ids=None, text=None, max_tokens=16, block_size=8, ignore_eos=True, **sampling
) -> generate_pb2.GenerateRequest:
    """A Generate request; ``block_size`` 8 (the tiny drafter's trained size) unless asked: 0 is auto."""
    sp = generate_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, **sampling)
    req = generate_pb2.GenerateRequest(sampling_params=sp, block_size=block_size)
    if text is not None:
        req.text = text
    elif ids is not None:
        req.tokenized.ids.extend(ids)
        req.tokenized.SetInParent()
    return req


def generate(addr: str, req, timeout: float = 120):
    """Run one Generate; return (token ids, text, Complete, number of chunks)."""
    ids, text, complete, chunks = [], [], None, 0
    for resp in generation_stub(addr).Generate(req, timeout=timeout):
        if resp.HasField("chunk"):
            ids.extend(resp.chunk.token_ids)
            text.append(resp.chunk.text)
            chunks += 1
        else:
            assert complete is None, "two Complete messages"
            complete = resp.complete
    assert complete is not None, "no Complete message"
    return ids, "".join(text), complete, chunks


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """Every sample of a server's ``/metrics`` on loopback as {(name, sorted labels): value}."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def ar_fallbacks(port: int, reason: str | None = None) -> float:
    """The orchestrator's ``kakeya_ar_fallbacks_total`` for ``reason`` (None: every reason)."""
    return sum(v for (name, labels), v in scrape(port).items()
               if name == "kakeya_ar_fallbacks_total" and (reason is None or ("reason", reason) in labels))  # fmt: skip


def sessions_freed(verifier_addr: str, drafter_addr: str):
    v, d = verifier_info(verifier_addr), drafter_info(drafter_addr)
    return v.live_sessions == 0 and v.live_kv_bytes == 0 and d.live_sessions == 0 and d.live_kv_bytes == 0


def in_process_torch_verifier(tiny_pair, aux_layers, workers: int = 16):
    """A torch verifier server in this process (batching up to 16 steps), for tests that count or inspect its
    steps: yields ``(address, servicer)``; a module fixture's body (``yield from``)."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from kakeya.runtime.servicer import SessionLimits
    from kakeya.verifier.server import VerifierServicer
    from kakeya.verifier.torch_backend.target import torch_verifier
    from kakeya.wire.kakeya.v1 import verifier_pb2_grpc
    from kakeya.wire.limits import server_options

    torch.set_num_threads(1)
    v = VerifierServicer(SessionLimits(max_batch=16))
    v.compute.run(v._setup, lambda: torch_verifier(tiny_pair.target, aux_layers), tiny_pair.target, tuple(aux_layers))
    v.ready = True
    server = grpc.server(ThreadPoolExecutor(workers), options=server_options())
    verifier_pb2_grpc.add_VerifierServiceServicer_to_server(v, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", v
    finally:
        server.stop(0).wait()
        v.compute.shutdown()


def in_process_mlx_pair(tiny_pair, aux_layers):
    """A verifier and a drafter servicer (the tiny pair, MLX) on one in-process loopback server with gRPC health
    (SERVING), for tests that reach into the servicers: yields ``{"addr", "verifier", "drafter", "health"}``; a
    module fixture's body (``yield from``)."""
    from concurrent.futures import ThreadPoolExecutor

    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from kakeya.drafter.server import DrafterServicer
    from kakeya.verifier.server import VerifierServicer
    from kakeya.wire.limits import server_options

    v, d = VerifierServicer(), DrafterServicer()
    v.load(tiny_pair.target, aux_layers, "mlx")
    d.load(tiny_pair.draft, tiny_pair.target, "mlx")
    v.ready = d.ready = True
    status = health.HealthServicer(experimental_non_blocking=True)
    status.set("", health_pb2.HealthCheckResponse.SERVING)
    server = grpc.server(ThreadPoolExecutor(16), options=server_options())
    verifier_pb2_grpc.add_VerifierServiceServicer_to_server(v, server)
    drafter_pb2_grpc.add_DrafterServiceServicer_to_server(d, server)
    health_pb2_grpc.add_HealthServicer_to_server(status, server)
    addr = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    try:
        yield {"addr": addr, "verifier": v, "drafter": d, "health": status}
    finally:
        server.stop(0).wait()
        v.compute.shutdown()
        d.compute.shutdown()
