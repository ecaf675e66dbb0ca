"""Load suite: concurrent streaming clients against a real `kakeya serve all` on loopback.

::

    python benchmarks/load.py [--clients 8] [--seconds 60] [--max-tokens 64] [--block-size 0]
                              [--target DIR --draft DIR] [--addr HOST:PORT] [--out benchmarks/results/load.json]

Starts `serve all` (the embedded default pair unless --target/--draft; or uses a
running one with --addr), computes each prompt's greedy AR reference once
through the same server with block size 1, then runs ``--clients`` threads that
stream Generate requests back to back for ``--seconds``. Every output must be
its reference token for token. Reports failed requests, mismatches, latency
p50/p99 (whole request and first token), aggregate tok/s and the server
processes' RSS before and after (psutil if installed, else /proc). Exit status
1 when any request failed or differed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc

from kakeya.wire.kakeya.v1 import generate_pb2 as pb
from kakeya.wire.kakeya.v1 import generate_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: record.py, the results' one writer
from record import write_result

# The tiny pair's drafter learnt counting-like id runs, not text: token-id prompts show it speculating.
TINY_PROMPTS = [[2] + list(range(40 + 3 * k, 52 + 3 * k)) for k in range(8)]
TEXT_PROMPTS = [
    "The quick brown fox",
    "Once upon a time",
    "In the beginning",
    "def fibonacci(n):",
    "The capital of France is",
    "1, 2, 3, 4,",
    "Speculative decoding works by",
    "A list of colours: red,",
]


def rss_bytes(pid: int) -> int:
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss
    except ImportError:
        pass
    except Exception:  # noqa: BLE001 - a figure we cannot read is reported as 0
        return 0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds process ``pid`` (every thread) has used so far; None where ``/proc`` cannot
    tell (not Linux, or the process is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime in clock ticks


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def stream(stub, prompt: str | list[int], max_tokens: int, block_size: int, timeout: float = 120.0):
    """One streamed Generate: (token ids, Complete, seconds to first chunk, seconds in all)."""
    req = pb.GenerateRequest(
        block_size=block_size, sampling_params=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    )
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.tokenized.ids.extend(prompt)
    t0 = time.perf_counter()
    ids, ttft, complete = [], None, None
    for resp in stub.Generate(req, timeout=timeout):
        if resp.HasField("chunk"):
            if ttft is None:
                ttft = time.perf_counter() - t0
            ids.extend(resp.chunk.token_ids)
        else:
            complete = resp.complete
    return ids, complete, ttft or 0.0, time.perf_counter() - t0


def serve_all(
    tmp: Path, extra: list[str], timeout: float, name: str = "all", role: str = "all"
) -> tuple[subprocess.Popen, dict]:
    """Start `kakeya serve ROLE --port 0 EXTRA...` (default: all) and wait for its ready file: (process, ready info)."""
    ready, log_path = tmp / f"{name}.json", tmp / f"serve-{name}.log"
    cmd = [
        sys.executable,
        "-m",
        "kakeya.app.main",
        "serve",
        role,
        "--port",
        "0",
        "--grace",
        "5",
        "--ready-file",
        str(ready),
        *extra,
    ]
    with open(log_path, "wb") as out:  # the child holds its own copy of the descriptor
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout
    while not ready.is_file():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"serve {role} did not start:\n{log_path.read_text(errors='replace')[-3000:]}")
        time.sleep(0.1)
    return proc, json.loads(ready.read_text())


def stop_serve_all(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def run_load(addr: str, args, pids: dict[str, int]) -> dict:
    stub = generate_pb2_grpc.GenerationStub(grpc.insecure_channel(addr))
    prompts = TEXT_PROMPTS if args.target else TINY_PROMPTS
    refs = [stream(stub, p, args.max_tokens, 1)[0] for p in prompts]  # block 1: the verifier alone, greedy AR
    rss_before = {n: rss_bytes(pid) for n, pid in pids.items()}
    lock = threading.Lock()
    lat, ttfts, failures, mismatches = [], [], [], []
    tokens, requests, accept = 0, 0, []
    stop_at = time.monotonic() + args.seconds

    def client(i: int) -> None:
        nonlocal tokens, requests
        k = i
        while time.monotonic() < stop_at:
            j = k % len(prompts)
            prompt = prompts[j]
            k += 1
            try:
                ids, complete, ttft, total = stream(stub, prompt, args.max_tokens, args.block_size)
            except grpc.RpcError as exc:
                with lock:
                    requests += 1
                    failures.append(f"{exc.code().name}: {exc.details()}")
                continue
            with lock:
                requests += 1
                if complete is None or complete.finish_reason == pb.FINISH_REASON_ERROR:
                    failures.append(complete.error_message if complete else "no Complete message")
                elif ids != refs[j]:
                    mismatches.append(j)
                lat.append(total)
                ttfts.append(ttft)
                tokens += len(ids)
                if complete is not None:
                    accept.append(complete.stats.mean_acceptance)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    time.sleep(2.0)  # sessions freed, caches dropped
    rss_after = {n: rss_bytes(pid) for n, pid in pids.items()}
    return {
        "clients": args.clients,
        "seconds": args.seconds,
        "wall_s": round(wall, 2),
        "max_tokens": args.max_tokens,
        "block_size": args.block_size,
        "requests": requests,
        "failed": len(failures),
        "failures": failures[:10],
        "mismatched": len(mismatches),
        "identical_to_ar": requests - len(failures) - len(mismatches),
        "latency_s": {"p50": round(percentile(lat, 50), 4), "p99": round(percentile(lat, 99), 4)},
        "ttft_s": {"p50": round(percentile(ttfts, 50), 4), "p99": round(percentile(ttfts, 99), 4)},
        "aggregate_tok_s": round(tokens / wall, 1) if wall else 0.0,
        "tokens": tokens,
        "mean_acceptance": round(sum(accept) / len(accept), 3) if accept else 0.0,
        "rss_bytes": {"before": rss_before, "after": rss_after},
        "rss_growth_pct": {
            n: round(100 * (rss_after[n] - rss_before[n]) / rss_before[n], 1) for n in pids if rss_before.get(n)
        },
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--block-size", type=int, default=0, help="0: the drafter's default")
    p.add_argument("--target", help="target checkpoint (default: the embedded default pair)")
    p.add_argument("--draft", help="drafter checkpoint")
    p.add_argument("--addr", help="a running orchestrator instead of starting `serve all` (no RSS then)")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/load.json"))
    args = p.parse_args(argv)
    if args.clients < 1 or args.seconds <= 0:
        p.error("--clients must be >= 1 and --seconds > 0")
    if bool(args.target) != bool(args.draft):
        p.error("give both --target and --draft, or neither")
    with tempfile.TemporaryDirectory(prefix="kakeya-load-") as tmp:
        proc = None
        if args.addr:
            addr, pids = args.addr, {}
        else:
            proc, info = serve_all(
                Path(tmp), ["--target", args.target, "--draft", args.draft] if args.target else [], args.start_timeout
            )
            addr, pids = info["addr"], info["pids"]
        try:
            out = run_load(addr, args, pids)
        finally:
            if proc is not None:
                stop_serve_all(proc)
    out["pair"] = {"target": args.target or "embedded default pair", "draft": args.draft or "embedded default pair"}
    out["prompts"] = "text" if args.target else "token ids"
    out["machine"] = {"platform": platform.platform(), "cpus": os.cpu_count()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, out)
    print(
        json.dumps(
            {k: out[k] for k in ("requests", "failed", "mismatched", "latency_s", "aggregate_tok_s", "rss_growth_pct")}
        )
    )
    return 0 if out["failed"] == 0 and out["mismatched"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
