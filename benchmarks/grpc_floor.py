"""The floor under a split block's wire time: a bare gRPC round trip on this machine.

A split block makes two round trips on its critical path (a draft to the drafter, a verify to the
verifier), each over a bidirectional ``Session`` stream whose server sat idle while the other
server worked. This measures the same round trip with nothing of Kakeya's in it: a separate
process serves a bidirectional stream that echoes raw bytes (the sync gRPC server Kakeya's servers
use, a generic handler, no protobuf), and this process sends each message the way
``orchestrator/streams.py`` does (a queue feeding the call's request iterator, ``next`` on the
responses), after an idle gap like a block's (both sides asleep meanwhile). What is left of the
wire above twice this floor is Kakeya's own: messages, the servers' handler code around the
forward, the loop.

    python benchmarks/grpc_floor.py                       # gaps 0, 1, 3, 10 ms; 4 KB; sync and aio servers
    python benchmarks/grpc_floor.py --gaps-ms 0 3 --bytes 4096 --rounds 400 --servers sync

The same echo is measured against an asyncio server (``grpc.aio``) too: whether moving Kakeya's
servers to it would lower the floor.

``split.py`` measures it beside every run (``grpc_floor`` in split.json). Writes
benchmarks/results/grpc_floor.json when run alone.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import queue
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
METHOD = "/kakeya.bench.Echo/Session"

SERVERS = {
    # grpc.server, as Kakeya's servers: the handler thread reads and answers; a poller thread takes
    # each event off the completion queue and wakes it
    "sync": """
import sys
from concurrent import futures
import grpc
def session(requests, context):
    for message in requests:
        yield message
ident = lambda b: b
handler = grpc.method_handlers_generic_handler(
    "kakeya.bench.Echo", {"Session": grpc.stream_stream_rpc_method_handler(session, ident, ident)})
server = grpc.server(futures.ThreadPoolExecutor(4))
server.add_generic_rpc_handlers((handler,))
port = server.add_insecure_port("127.0.0.1:0")
server.start()
print(port, flush=True)
sys.stdin.read()  # until the parent closes it
server.stop(0)
""",
    # grpc.aio.server: the handler is a coroutine on the event loop's thread
    "aio": """
import asyncio, sys
import grpc
async def session(requests, context):
    async for message in requests:
        yield message
async def main():
    ident = lambda b: b
    handler = grpc.method_handlers_generic_handler(
        "kakeya.bench.Echo", {"Session": grpc.stream_stream_rpc_method_handler(session, ident, ident)})
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes it
    await server.stop(0)
asyncio.run(main())
""",
}


class EchoServer:
    """The echo server (``kind``: sync or aio) in its own process, as the verifier and the drafter are;
    ended on exit."""

    def __init__(self, kind: str = "sync"):
        self.kind = kind

    def __enter__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", SERVERS[self.kind]], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.addr = f"127.0.0.1:{int(self.proc.stdout.readline())}"
        return self

    def __exit__(self, *exc):
        self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def round_trips_ms(addr: str, gap_s: float, size: int, rounds: int, warmup: int = 50) -> float:
    """Median milliseconds of one message's round trip over one stream, each sent ``gap_s`` after the last answer."""
    end = object()
    with grpc.insecure_channel(addr) as channel:
        call = channel.stream_stream(METHOD, request_serializer=None, response_deserializer=None)
        requests: queue.SimpleQueue = queue.SimpleQueue()
        responses = call(iter(requests.get, end))
        message, times = os.urandom(size), []
        for i in range(warmup + rounds):
            if gap_s:
                time.sleep(gap_s)
            t0 = time.perf_counter()
            requests.put(message)
            echoed = next(responses)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
            if echoed != message:
                raise RuntimeError("the echo server answered other bytes")
        requests.put(end)
    return statistics.median(times) * 1e3


def floor(gaps_ms=(0.0, 3.0), size: int = 4096, rounds: int = 300, servers=("sync",)) -> dict:
    """``{"bytes": size, "round_trip_ms": {server: {gap: median}}}``: the bare round trip after each idle
    gap, per kind of server; the kinds alternate gap by gap, so drifts in machine load hit both alike."""
    got: dict = {kind: {} for kind in servers}
    with contextlib.ExitStack() as stack:
        running = {kind: stack.enter_context(EchoServer(kind)) for kind in servers}
        for g in gaps_ms:
            for kind, server in running.items():
                got[kind][f"{g:g}"] = round(round_trips_ms(server.addr, g / 1e3, size, rounds), 4)
    return {"bytes": size, "rounds": rounds, "round_trip_ms": got}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gaps-ms", type=float, nargs="+", default=[0, 1, 3, 10], help="idle time before each message")
    ap.add_argument("--bytes", type=int, default=4096, help="message size (a block-8 draft or verify answer: ~4 KB)")
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--servers", nargs="+", default=["sync", "aio"], choices=sorted(SERVERS),
                    help="echo servers to measure (sync: grpc.server, as Kakeya's; aio: grpc.aio.server)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "grpc_floor.json"))
    args = ap.parse_args(argv)
    out = {"benchmark": "grpc_floor", "grpcio": grpc.__version__} | floor(args.gaps_ms, args.bytes, args.rounds, args.servers)
    out |= {"machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()},
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": "python benchmarks/grpc_floor.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out["round_trip_ms"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
