"""Many streams at once: aggregate tok/s and latency against streams, per deployment, on loopback.

::

    python benchmarks/concurrency.py                      # demo pair, CPU: colocated torch, colocated MLX, split
    python benchmarks/concurrency.py --deployments colocated-torch split --streams 1 8 --repeats 1
    python benchmarks/concurrency.py --serve-args "--device cuda"   # on a GPU node

Starts each deployment of the embedded demo pair as its own server process, as a user would:
``colocated-torch`` and ``colocated-mlx`` are ``kakeya serve orchestrator`` with the models in the
server's process (the Mac's shape, ``deploy/mac/run.sh``); ``split`` is ``kakeya serve all`` (a verifier,
a drafter and an orchestrator process). For each number of streams, each deployment in turn (the order
alternating, repeat by repeat, so machine noise falls on all alike) serves that many client threads, each
streaming ``--requests`` greedy Generate requests back to back, every request its own prompt. Reports
aggregate tok/s (its ratio to one stream, the median of the repeats), request latency p50/p99 and time to
first token, and checks every output against the same request run alone on the same deployment, token
for token.

Then the newcomer's wait: while ``--busy`` streams decode long requests, a short request arrives; its time
to first token is reported beside its time alone (the issue's goal: within 2x).

Writes benchmarks/results/concurrency.json and concurrency.png (tok/s and p50/p99 latency against streams).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import grpc
from load import cpu_seconds, percentile, serve_all, stop_serve_all, stream

from kakeya.wire.kakeya.v1 import generate_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: record.py, the results' one writer
from record import write_result

ROLES = {  # deployment -> (serve role, its arguments)
    "colocated-torch": ("orchestrator", ["--backend", "torch"]),
    "colocated-mlx": ("orchestrator", ["--backend", "mlx"]),
    "split": ("all", ["--verifier-backend", "torch", "--drafter-backend", "torch"]),
}
TOPICS = ["parse a config file", "walk a directory tree", "merge two sorted lists", "retry a network call",
          "format a table", "count words in a file", "validate an email address", "cache a function's results",
          "read a CSV file", "compute a checksum", "flatten a nested list", "parse command-line arguments",
          "schedule a periodic task", "compress a file", "diff two strings", "serialise a dataclass"]  # fmt: skip


def prompt(stream_id: int, request: int) -> str:
    """Every request its own prompt (no two share a prefix past the first line)."""
    topic = TOPICS[(stream_id + 5 * request) % len(TOPICS)]
    return f"# {topic} (variant {stream_id}.{request})\ndef "


def servers_cpu_seconds(pids: dict[str, int]) -> dict[str, float] | None:
    """CPU seconds each server process (by role) has used so far; None where ``/proc`` cannot tell."""
    seconds = {role: cpu_seconds(pid) for role, pid in pids.items()}
    return None if None in seconds.values() else seconds


def run_streams(stub, n: int, requests: int, max_tokens: int, block_size: int, refs: dict, pids=None) -> dict:
    lock = threading.Lock()
    lat, ttfts, bad, tokens = [], [], [], [0]

    def client(i: int) -> None:
        for r in range(requests):
            try:
                ids, _complete, ttft, total = stream(stub, prompt(i, r), max_tokens, block_size)
            except grpc.RpcError as exc:
                with lock:
                    bad.append(f"stream {i}: {exc.code().name}: {exc.details()}")
                continue
            with lock:
                if ids != refs[(i, r)]:
                    bad.append(f"stream {i} request {r}: output differs from the request alone")
                lat.append(total)
                ttfts.append(ttft)
                tokens[0] += len(ids)

    cpu0 = servers_cpu_seconds(pids or {})
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    cpu1 = servers_cpu_seconds(pids or {})
    # the cores each server process kept busy on average (the client's own threads are not counted)
    cores = {role: round((cpu1[role] - cpu0[role]) / wall, 3) for role in cpu1} if cpu0 and cpu1 else {}
    return {
        "cores": cores,
        "aggregate_tok_s": tokens[0] / wall,
        "latency_p50_s": percentile(lat, 50),
        "latency_p99_s": percentile(lat, 99),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "failed_or_mismatched": bad[:5],
    }


def newcomer(stub, busy: int, max_tokens: int, block_size: int, short_tokens: int, repeats: int) -> dict:
    """A short request's time to first token alone, then while ``busy`` streams decode (median of repeats)."""
    alone = [stream(stub, prompt(99, k), short_tokens, block_size)[2] for k in range(repeats)]
    during, stop = [], threading.Event()

    def decode(i: int) -> None:
        r = 0
        while not stop.is_set():
            stream(stub, prompt(i, 50 + r), max_tokens, block_size)
            r += 1

    threads = [threading.Thread(target=decode, args=(i,)) for i in range(busy)]
    for t in threads:
        t.start()
    try:
        time.sleep(2.0)  # let the busy streams reach steady decoding (a warm-up, not an ordering)
        for k in range(repeats):
            during.append(stream(stub, prompt(98, k), short_tokens, block_size)[2])
    finally:
        stop.set()
        for t in threads:
            t.join()
    a, d = statistics.median(alone), statistics.median(during)
    return {"busy_streams": busy, "short_tokens": short_tokens, "ttft_alone_s": round(a, 4),
            "ttft_while_busy_s": round(d, 4), "ratio": round(d / a, 2)}  # fmt: skip


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, rows in out["deployments"].items():
        ns = [int(n) for n in rows]
        ax1.plot(ns, [rows[str(n)]["aggregate_tok_s"] for n in ns], marker="o", label=name)
        line = ax2.plot(ns, [rows[str(n)]["latency_p50_s"] for n in ns], marker="o", label=f"{name} p50")
        ax2.plot(
            ns, [rows[str(n)]["latency_p99_s"] for n in ns], ls="--", color=line[0].get_color(), label=f"{name} p99"
        )
    for ax, label in ((ax1, "aggregate tok/s"), (ax2, "request latency, s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"demo pair, {out['max_tokens']} tokens a request, block {out['block_size'] or 'auto'}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--deployments", nargs="+", default=list(ROLES), choices=list(ROLES))
    p.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--requests", type=int, default=2, help="requests per stream, back to back")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--block-size", type=int, default=0, help="0: auto")
    p.add_argument("--repeats", type=int, default=3, help="passes over every (deployment, streams); medians")
    p.add_argument("--busy", type=int, default=8, help="streams decoding while the newcomer arrives (0: skip)")
    p.add_argument("--newcomer-repeats", type=int, default=11, help="short requests alone and while busy; medians")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--serve-args", default="", help="extra arguments for every server, e.g. '--device cuda'")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/concurrency.json"))
    args = p.parse_args(argv)
    extra = args.serve_args.split()
    out = {
        "command": " ".join(["python", "benchmarks/concurrency.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "pair": "embedded demo pair",
        "max_tokens": args.max_tokens,
        "block_size": args.block_size,
        "requests_per_stream": args.requests,
        "repeats": args.repeats,
        "deployments": {},
        "over_one_stream": {},
        "newcomer": {},
    }
    keys = [(i, r) for i in range(max(args.streams)) for r in range(args.requests)]
    with tempfile.TemporaryDirectory(prefix="kakeya-concurrency-") as tmp:
        procs, stubs, refs, pids = {}, {}, {}, {}
        try:
            for name in args.deployments:
                role, role_args = ROLES[name]
                procs[name], info = serve_all(
                    Path(tmp), ["--max-sessions", "64", *role_args, *extra], args.start_timeout, name=name, role=role
                )
                stubs[name] = generate_pb2_grpc.GenerationStub(grpc.insecure_channel(info["addr"]))
                pids[name] = info.get("pids") or {"orchestrator": procs[name].pid}  # serve all: each child's
                t0 = time.perf_counter()
                refs[name] = {k: stream(stubs[name], prompt(*k), args.max_tokens, args.block_size)[0] for k in keys}
                print(f"{name}: up; {len(keys)} requests alone in {time.perf_counter() - t0:.1f} s", flush=True)
            runs = {name: {n: [] for n in args.streams} for name in args.deployments}
            for rep in range(args.repeats):
                for n in args.streams:
                    order = args.deployments if (rep + n) % 2 == 0 else args.deployments[::-1]
                    for name in order:
                        r = run_streams(
                            stubs[name], n, args.requests, args.max_tokens, args.block_size, refs[name], pids[name]
                        )
                        runs[name][n].append(r)
                        cores = " + ".join(f"{c:.2f}" for c in r["cores"].values())
                        print(f"pass {rep + 1}: {name:>15} {n:>2} streams {r['aggregate_tok_s']:7.1f} tok/s, "
                              f"p50 {r['latency_p50_s']:.2f} s, p99 {r['latency_p99_s']:.2f} s, cores {cores}", flush=True)  # fmt: skip
            for name in args.deployments:
                rows = {}
                for n in args.streams:
                    rs = runs[name][n]
                    rows[str(n)] = {k: round(statistics.median(x[k] for x in rs), 4) for k in rs[0] if k.endswith("_s")}
                    rows[str(n)]["runs_tok_s"] = [round(x["aggregate_tok_s"], 1) for x in rs]
                    if rs[0]["cores"]:  # each server process's busy cores, the median of the passes
                        rows[str(n)]["cores"] = {
                            role: round(statistics.median(x["cores"][role] for x in rs), 2) for role in rs[0]["cores"]
                        }
                    rows[str(n)]["failed_or_mismatched"] = [b for x in rs for b in x["failed_or_mismatched"]][:5]
                out["deployments"][name] = rows
                if 1 in args.streams:  # each pass's ratio to its own one-stream run, then their median
                    out["over_one_stream"][name] = {
                        str(n): round(statistics.median(
                            a["aggregate_tok_s"] / b["aggregate_tok_s"] for a, b in zip(runs[name][n], runs[name][1])
                        ), 2) for n in args.streams
                    }  # fmt: skip
                    print(f"{name}: x one stream {out['over_one_stream'][name]}", flush=True)
            if args.busy:
                for name in args.deployments:
                    out["newcomer"][name] = newcomer(
                        stubs[name], args.busy, args.max_tokens, args.block_size, 16, args.newcomer_repeats
                    )
                    print(f"{name}: newcomer {out['newcomer'][name]}", flush=True)
        finally:
            for proc in procs.values():
                stop_serve_all(proc)
    out["all_identical_to_alone"] = all(
        not row["failed_or_mismatched"] for rows in out["deployments"].values() for row in rows.values()
    )
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_result(path, out)
    plot(out, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}; every output identical to the request alone: "
          f"{out['all_identical_to_alone']}")  # fmt: skip
    return 0 if out["all_identical_to_alone"] else 1


if __name__ == "__main__":
    sys.exit(main())
