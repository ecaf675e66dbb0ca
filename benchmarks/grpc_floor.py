"""The floor under a split block's wire time: a bare gRPC round trip on this machine.

A split block makes two round trips on its critical path (a draft to the drafter, a verify to the
verifier), each over a bidirectional ``Session`` stream whose server sat idle while the other
server worked. This measures the same round trip with nothing of Kakeya's in it: a separate
process serves a bidirectional stream that echoes raw bytes (the sync gRPC server Kakeya's servers
use, a generic handler, no protobuf), and this process sends each message the way
``orchestrator/remote/streams.py`` does (a queue feeding the call's request iterator, ``next`` on the
responses), after an idle gap like a block's (both sides asleep meanwhile). What is left of the
wire above twice this floor is Kakeya's own: messages, the servers' handler code around the
forward, the loop.

    python benchmarks/grpc_floor.py                       # gaps 0, 1, 3, 10 ms; 4 KB; sync and aio servers
    python benchmarks/grpc_floor.py --gaps-ms 0 3 --bytes 4096 --rounds 400 --servers sync
    python benchmarks/grpc_floor.py --block --verify-ms 5.6 --draft-ms 1.1   # + a block: two round trips vs a relay chain

The same echo is measured against an asyncio server (``grpc.aio``) too: whether moving Kakeya's
servers to it would lower the floor.

``--block`` measures a whole block's wire the two ways a split could run it, with the servers
burning CPU for their compute (``--verify-ms``, ``--draft-ms``) as a forward does, so on a small
machine they contend for cores as the real ones do:

- two round trips (Kakeya's shape): verify to the verifier and back, then draft to the drafter and back;
- a relay chain (the shape issue "The split without a tax" proposes: three one-way hops instead of
  four): the draft request is posted with the verify, the verifier forwards its verdict to the
  drafter over its own stream when it has verified, the drafter drafts on it and answers.

Each is the client-observed block time minus the compute: what moving the aux off the
orchestrator's path would save here before any of Kakeya's own work.

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

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: record.py, the results' one writer
from record import write_result

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

# The block shape: a "verifier" that burns its compute and answers (and, for a message marked R,
# forwards it to the drafter's Relay stream first), and a "drafter" whose Session waits for the
# relayed verdict of a message marked R, burns its compute and answers. Raw bytes, generic handlers.
BLOCK_COMMON = """
import queue, sys, time
from concurrent import futures
import grpc
def burn(s):  # a forward's compute: the CPU is busy, as it is with a real model
    end = time.perf_counter() + s
    while time.perf_counter() < end:
        pass
ident = lambda b: b
def serve(service, methods):
    handlers = {k: grpc.stream_stream_rpc_method_handler(f, ident, ident) for k, f in methods.items()}
    server = grpc.server(futures.ThreadPoolExecutor(8))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    sys.stdin.read()  # until the parent closes it
    server.stop(0)
"""
BLOCK_SERVERS = {
    "drafter": BLOCK_COMMON
    + """
compute = float(sys.argv[1])
verdicts = queue.SimpleQueue()
def relay(requests, context):  # the verifier's verdicts, one per relayed block
    for message in requests:
        verdicts.put(message)
    return iter(())
def session(requests, context):
    for message in requests:
        if message[:1] == b"R":
            verdicts.get()  # drafts on the verdict the verifier relayed
        burn(compute)
        yield message
serve("kakeya.bench.Drafter", {"Session": session, "Relay": relay})
""",
    "verifier": BLOCK_COMMON
    + """
compute, drafter = float(sys.argv[1]), sys.argv[2]
outbox = queue.SimpleQueue()
relay = grpc.insecure_channel(drafter).stream_stream("/kakeya.bench.Drafter/Relay", request_serializer=None,
                                                    response_deserializer=None)(iter(outbox.get, None))
def session(requests, context):
    for message in requests:
        burn(compute)
        if message[:1] == b"R":
            outbox.put(message)  # the verdict goes to the drafter first
        yield message
serve("kakeya.bench.Verifier", {"Session": session})
""",
}


class EchoServer:
    """The echo server (``kind``: sync or aio; or ``script``, a block-shape server, with ``args``) in its own
    process, as the verifier and the drafter are; ended on exit."""

    def __init__(self, kind: str = "sync", script: str | None = None, args: tuple = ()):
        self.kind, self.script, self.args = kind, script or SERVERS[kind], [str(a) for a in args]

    def __enter__(self):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", self.script, *self.args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
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


def _stream(channel, service: str):
    requests: queue.SimpleQueue = queue.SimpleQueue()
    call = channel.stream_stream(
        f"/kakeya.bench.{service}/Session", request_serializer=None, response_deserializer=None
    )
    return requests, call(iter(requests.get, None))


def block_wire(
    verify_ms: float = 5.6, draft_ms: float = 1.1, size: int = 4096, rounds: int = 300, repeats: int = 4
) -> dict:
    """A block's wire (client-observed block time minus the servers' compute, median ms) as two round trips
    and as a relay chain, alternating ``repeats`` times: ``{"two_round_trips": ..., "relay_chain": ...,
    "saved_ms": ...}``."""
    verify_s, draft_s = verify_ms / 1e3, draft_ms / 1e3
    with contextlib.ExitStack() as stack:
        drafter = stack.enter_context(EchoServer("drafter", BLOCK_SERVERS["drafter"], (draft_s,)))
        verifier = stack.enter_context(EchoServer("verifier", BLOCK_SERVERS["verifier"], (verify_s, drafter.addr)))
        channels = [stack.enter_context(grpc.insecure_channel(a)) for a in (verifier.addr, drafter.addr)]
        (vq, vr), (dq, dr) = _stream(channels[0], "Verifier"), _stream(channels[1], "Drafter")
        message = os.urandom(size)

        def two_round_trips():
            vq.put(b"N" + message)
            next(vr)
            dq.put(b"N" + message)
            next(dr)

        def relay_chain():  # the draft waits at the drafter for the verdict the verifier relays
            vq.put(b"R" + message)
            dq.put(b"R" + message)
            next(vr)  # the verdict reaches the client beside the draft, off the critical path
            next(dr)

        got: dict[str, list[float]] = {"two_round_trips": [], "relay_chain": []}
        for _ in range(repeats):
            for name, block in (("two_round_trips", two_round_trips), ("relay_chain", relay_chain)):
                times = []
                for i in range(rounds + 20):
                    t0 = time.perf_counter()
                    block()
                    if i >= 20:
                        times.append(time.perf_counter() - t0)
                got[name].append(statistics.median(times) * 1e3 - verify_ms - draft_ms)
        for q in (vq, dq):
            q.put(None)
    two, chain = (round(statistics.median(got[k]), 4) for k in ("two_round_trips", "relay_chain"))
    return {
        "verify_ms": verify_ms,
        "draft_ms": draft_ms,
        "bytes": size,
        "rounds": rounds,
        "repeats": repeats,
        "wire_ms": {"two_round_trips": two, "relay_chain": chain},
        "saved_ms": round(two - chain, 4),
        "per_repeat_ms": {k: [round(v, 4) for v in vs] for k, vs in got.items()},
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gaps-ms", type=float, nargs="+", default=[0, 1, 3, 10], help="idle time before each message")
    ap.add_argument("--bytes", type=int, default=4096, help="message size (a block-8 draft or verify answer: ~4 KB)")
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument(
        "--servers",
        nargs="+",
        default=["sync", "aio"],
        choices=sorted(SERVERS),
        help="echo servers to measure (sync: grpc.server, as Kakeya's; aio: grpc.aio.server)",
    )
    ap.add_argument("--block", action="store_true", help="also a block's wire: two round trips vs a relay chain")
    ap.add_argument(
        "--verify-ms",
        type=float,
        default=5.6,
        help="--block: the verifier's compute a block (demo pair, block 8, this VM)",
    )
    ap.add_argument("--draft-ms", type=float, default=1.1, help="--block: the drafter's compute a block")
    ap.add_argument("--repeats", type=int, default=4, help="--block: alternations of the two shapes")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "grpc_floor.json"))
    args = ap.parse_args(argv)
    out = {"benchmark": "grpc_floor", "grpcio": grpc.__version__} | floor(
        args.gaps_ms, args.bytes, args.rounds, args.servers
    )
    if args.block:
        out["block"] = block_wire(args.verify_ms, args.draft_ms, args.bytes, args.rounds, args.repeats)
    out |= {
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()},
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": "python benchmarks/grpc_floor.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    write_result(args.out, out)
    print(json.dumps(out["round_trip_ms"]))
    if args.block:
        print(json.dumps(out["block"]["wire_ms"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
