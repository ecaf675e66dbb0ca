"""Concurrent streams, batched vs serialised, against real `kakeya serve all` processes on loopback.

::

    python benchmarks/concurrency.py [--streams 1 2 4 8 16] [--requests 2] [--max-tokens 64]
                                     [--block-size 0] [--long-prompt 6000] [--out benchmarks/results/concurrency.json]

Starts two `serve all` deployments of the embedded demo pair: one with the
default ``--max-batch 16`` (concurrent sessions' verify and draft steps that
queue up run as one batched forward) and one with ``--max-batch 1`` (every step
alone, in turn: the serialised baseline). For each number of streams, each
deployment in turn serves that many client threads, each streaming
``--requests`` Generate requests back to back; the two deployments alternate,
so machine noise falls on both alike. Reports aggregate tok/s, request
latency p50/p99 and time to first token, and checks every output against the
greedy AR reference token for token.

Then the long-prompt stall: a ``--long-prompt``-token prefill on one stream and
a short request on another, started just after it. The verifier prefills in
chunks on its compute thread and runs other sessions' steps between them, so
the short request's latency is reported beside its latency alone.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import grpc
from load import TINY_PROMPTS, percentile, serve_all, stop_serve_all, stream

from kakeya.wire.kakeya.v1 import generate_pb2_grpc


def run_streams(stub, n: int, requests: int, max_tokens: int, block_size: int, refs: list[list[int]]) -> dict:
    lock = threading.Lock()
    lat, ttfts, bad, tokens = [], [], [], [0]

    def client(i: int) -> None:
        for r in range(requests):
            j = (i * requests + r) % len(TINY_PROMPTS)
            try:
                ids, _complete, ttft, total = stream(stub, TINY_PROMPTS[j], max_tokens, block_size)
            except grpc.RpcError as exc:
                with lock:
                    bad.append(f"{exc.code().name}: {exc.details()}")
                continue
            with lock:
                if ids != refs[j]:
                    bad.append(f"prompt {j}: output differs from greedy AR")
                lat.append(total)
                ttfts.append(ttft)
                tokens[0] += len(ids)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {
        "aggregate_tok_s": round(tokens[0] / wall, 1),
        "latency_s": {"p50": round(percentile(lat, 50), 4), "p99": round(percentile(lat, 99), 4)},
        "ttft_s": {"p50": round(percentile(ttfts, 50), 4), "p99": round(percentile(ttfts, 99), 4)},
        "requests": len(lat) + len(bad),
        "failed_or_mismatched": bad[:5],
    }


def long_prompt_stall(stub, long_tokens: int, short_tokens: int) -> dict:
    """A short request's latency alone, then while a long prompt prefills on another stream."""
    short = TINY_PROMPTS[0]
    _, _, _, alone = stream(stub, short, short_tokens, 0)
    long_prompt = [2] + [40 + (i % 400) for i in range(long_tokens - 1)]
    result = {}

    def run_long() -> None:
        _, _, ttft, total = stream(stub, long_prompt, 4, 0, timeout=600)
        result["long_ttft_s"], result["long_total_s"] = ttft, total

    t = threading.Thread(target=run_long)
    t.start()
    time.sleep(0.2)  # the long prefill has started
    _, _, _, during = stream(stub, short, short_tokens, 0)
    t.join()
    return {
        "long_prompt_tokens": long_tokens,
        "short_request_tokens": short_tokens,
        "short_alone_s": round(alone, 4),
        "short_during_long_prefill_s": round(during, 4),
        "long_prefill_ttft_s": round(result["long_ttft_s"], 3),
        "short_finished_before_long_prefill": during + 0.2 < result["long_ttft_s"],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, nargs="*", default=[1, 2, 4, 8, 16], help="none: the long-prompt check only")
    p.add_argument("--requests", type=int, default=2, help="requests per stream, back to back")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--block-size", type=int, default=0, help="0: auto")
    p.add_argument("--long-prompt", type=int, default=6000, help="tokens of the long-prompt stall check (0: skip)")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument(
        "--serve-args",
        default="",
        help="extra `serve all` arguments, e.g. '--verifier-backend torch --drafter-backend torch --device cuda'",
    )
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/concurrency.json"))
    args = p.parse_args(argv)
    extra = args.serve_args.split()
    modes = {"batched": 16, "serialised": 1}
    out = {
        "command": " ".join(sys.argv),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "pair": "embedded demo pair",
        "max_tokens": args.max_tokens,
        "block_size": args.block_size,
        "requests_per_stream": args.requests,
        "streams": {},
    }
    with tempfile.TemporaryDirectory(prefix="kakeya-concurrency-") as tmp:
        procs, stubs = {}, {}
        try:
            for mode, mb in modes.items():
                extra_mode = ["--max-batch", str(mb), "--max-sessions", "64", *extra]
                procs[mode], info = serve_all(Path(tmp), extra_mode, args.start_timeout, name=mode)
                stubs[mode] = generate_pb2_grpc.GenerationStub(grpc.insecure_channel(info["addr"]))
            refs = [stream(stubs["serialised"], q, args.max_tokens, 1)[0] for q in TINY_PROMPTS]  # greedy AR
            for n in args.streams:
                row = {}
                order = list(modes) if n % 2 else list(modes)[::-1]
                for mode in order:
                    row[mode] = run_streams(stubs[mode], n, args.requests, args.max_tokens, args.block_size, refs)
                row["batched_vs_serialised"] = round(
                    row["batched"]["aggregate_tok_s"] / row["serialised"]["aggregate_tok_s"], 3
                )
                out["streams"][str(n)] = row
                print(
                    f"{n:>2} streams: batched {row['batched']['aggregate_tok_s']:>7.1f} tok/s "
                    f"(p50 {row['batched']['latency_s']['p50']:.3f} s), serialised {row['serialised']['aggregate_tok_s']:>7.1f} "
                    f"tok/s (p50 {row['serialised']['latency_s']['p50']:.3f} s) -> {row['batched_vs_serialised']:.2f}x",
                    flush=True,
                )
            if args.long_prompt:  # the issue's 3-token request, and one as long as the streams'
                out["long_prompt_stall"] = [
                    long_prompt_stall(stubs["batched"], args.long_prompt, n) for n in (3, args.max_tokens)
                ]
                for row in out["long_prompt_stall"]:
                    print(json.dumps(row))
        finally:
            for proc in procs.values():
                stop_serve_all(proc)
    out["all_identical_to_ar"] = all(not r[m]["failed_or_mismatched"] for r in out["streams"].values() for m in modes)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}; every output identical to greedy AR: {out['all_identical_to_ar']}")
    return 0 if out["all_identical_to_ar"] else 1


if __name__ == "__main__":
    sys.exit(main())
