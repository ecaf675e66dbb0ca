"""Where a batched round's time goes: N streams through one in-process engine, every scheduler round timed.

The colocated server's shape without its gRPC front: the embedded demo pair loaded once on a model
thread (``runtime/compute.py``), N threads each generating ``--requests`` greedy requests of
``--max-tokens`` (every request its own prompt, EOS ignored so every stream decodes its full length),
all through the engine's one scheduler. Every round is recorded: sessions in it, rows verified (each
block's last token and candidates), tokens committed, the batched draft's and verify's seconds. Reported
per backend and stream count: aggregate tok/s, the medians over full rounds (at least 3/4 of the streams
in them), and what ``block_sizing.RoundCosts`` fitted from them: ``g`` (a round's fixed cost), ``f`` (each
session's) and ``s`` (each row's), in ms -- what prices a block when sessions share a round. Also
``--block-size`` to hold every block at one size instead of the sizer's choice (the comparison that
shows what the sizer's choice under batching is worth). ``busy_share`` is the rounds' share of the wall time
(rounds run back to back when it is near 1 less the prefills); ``--profile`` (torch) runs ``torch.profiler``
on the model thread over 20 full rounds' verifies and reports the operators' shares of their CPU time
(``verify_ops``): where a batched verify's time goes (the profiler's own time lands in that run's tok/s and
busy share: take those from a run without it).

    python benchmarks/rounds.py --backends torch mlx --streams 1 8 16   # -> benchmarks/results/rounds.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: record.py, the results' one writer
from record import write_result

ROOT = Path(__file__).resolve().parent.parent


PROFILED = (10, 30)  # the full rounds whose verify --profile records (after the first shapes' warm-up)


def measure(
    backend: str, streams: int, requests: int, max_tokens: int, block_size: int, device: str, profile: bool = False
) -> dict:
    import kakeya.orchestrator.decode.scheduler as scheduler_mod
    from kakeya.app.options import DEFAULT_PROMPT
    from kakeya.core.request import Request
    from kakeya.orchestrator.assembly import build_local_engine, set_torch_threads
    from kakeya.orchestrator.decode.engine import RunOptions
    from kakeya.runtime import heap
    from kakeya.runtime.compute import ComputeThread

    rounds, verify_round = [], scheduler_mod.verify_round
    prof = {"full": 0, "profiler": None}

    def profiled(drafted, decide_many):  # on the model thread, where the profiler must start and stop
        if not profile or len(drafted.live) < max(1, streams * 3 // 4):
            return verify_round(drafted, decide_many)
        import torch

        prof["full"] += 1
        if prof["full"] == PROFILED[0]:
            prof["profiler"] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            prof["profiler"].start()
        try:
            return verify_round(drafted, decide_many)
        finally:
            if prof["full"] == PROFILED[1] - 1:
                prof["profiler"].stop()

    def timed(drafted, decide_many):  # the scheduler's round (its second half), with what it did
        out = profiled(drafted, decide_many)
        if out:
            b = out[0][1]
            rows = sum(x.drafted + 1 for _, x in out)
            rounds.append((len(out), rows, sum(len(x.tokens) for _, x in out), b.draft_s, b.verify_s))
        return out

    heap.keep_freed_memory()  # as every kakeya command does (runtime/heap.py): this is a server's engine
    compute = ComputeThread("bench")
    engine = compute.run(build_local_engine, None, None, backend, device if backend == "torch" else None, None)
    if engine.verifier.info.backend == "torch":
        compute.run(set_torch_threads, None, engine.device, True)
    options = RunOptions(step=compute.run)

    def request(i: int, r: int) -> Request:
        return engine.check(
            Request(
                DEFAULT_PROMPT[: 200 + 13 * i + 7 * r], max_tokens=max_tokens, block_size=block_size, ignore_eos=True
            )
        )

    engine.generate(request(0, 99), options)  # warm-up: calibration, first shapes
    scheduler_mod.verify_round = timed
    tokens = [0] * streams

    def stream(i: int) -> None:
        for r in range(requests):
            tokens[i] += len(engine.generate(request(i, r), options).token_ids)

    try:
        t0 = time.perf_counter()
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(streams)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - t0
    finally:
        scheduler_mod.verify_round = verify_round
        compute.shutdown()
    full = [r for r in rounds if r[0] >= max(1, streams * 3 // 4)] or rounds

    def med(k: int) -> float:
        return round(statistics.median(r[k] for r in full), 4)

    ops = None
    if prof["profiler"] is not None and prof["full"] >= PROFILED[1] - 1:
        events = [e for e in prof["profiler"].key_averages() if e.self_cpu_time_total > 0]
        total = sum(e.self_cpu_time_total for e in events)
        top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:8]
        ops = {e.key: round(e.self_cpu_time_total / total, 3) for e in top}
    policy = engine.adaptive  # None at a fixed block size: nothing sized, nothing fitted
    fitted = policy.rounds.params if policy is not None else None
    return {
        "tok_s": round(sum(tokens) / seconds, 1),
        "rounds": len(rounds),
        "full_rounds": len(full),
        "median_sessions": med(0),
        "median_rows": med(1),
        "median_tokens": med(2),
        "median_draft_ms": round(1000 * med(3), 2),
        "median_verify_ms": round(1000 * med(4), 2),
        "busy_share": round(sum(r[3] + r[4] for r in rounds) / seconds, 3),
        "verify_ops": ops,
        "tokens_per_row": round(sum(r[2] for r in rounds) / max(sum(r[1] for r in rounds), 1), 3),
        "fitted_ms": None if fitted is None else dict(zip("gfs", (round(1000 * x, 3) for x in fitted))),
        "alone_curve_ms": {k: round(1000 * v, 2) for k, v in sorted(policy.costs.seconds.items())} if policy else None,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", nargs="+", default=["torch"], choices=["torch", "mlx"])
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("--requests", type=int, default=1, help="requests per stream, back to back")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--block-size", type=int, default=0, help="0: auto (the sizer's choice)")
    p.add_argument("--device", default="cpu", help="torch's device (cuda on a GPU)")
    p.add_argument("--profile", action="store_true", help="torch: operators' shares of 20 full rounds' verify time")
    p.add_argument("--child", help=argparse.SUPPRESS)  # one (backend, streams) in a fresh process
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/rounds.json"))
    args = p.parse_args(argv)
    if args.child:
        backend, streams = args.child.split(":")
        r = measure(backend, int(streams), args.requests, args.max_tokens, args.block_size, args.device, args.profile)
        print(json.dumps(r))
        sys.stdout.flush()
        os._exit(0)  # MLX's threads can abort a normal interpreter exit ("terminate called"): the result is out
    import subprocess

    out = {
        "command": " ".join(["python", "benchmarks/rounds.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "pair": "embedded demo pair",
        "max_tokens": args.max_tokens,
        "block_size": args.block_size,
        "results": {},
    }
    for backend in args.backends:
        out["results"][backend] = {}
        for n in args.streams:  # each in a fresh process: what one measurement learnt never primes the next
            cmd = [sys.executable, __file__, "--child", f"{backend}:{n}", "--requests", str(args.requests)]
            cmd += ["--max-tokens", str(args.max_tokens), "--block-size", str(args.block_size), "--device", args.device]
            cmd += ["--profile"] if args.profile and backend == "torch" else []
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                print(done.stderr[-2000:], file=sys.stderr)
                return 1
            r = json.loads(done.stdout.strip().splitlines()[-1])
            out["results"][backend][str(n)] = r
            print(f"{backend} {n:>2} streams: {r['tok_s']:7.1f} tok/s, rows {r['median_rows']}, "
                  f"verify {r['median_verify_ms']} ms, fitted {r['fitted_ms']}", flush=True)  # fmt: skip
        one = out["results"][backend].get("1")
        if one:
            out.setdefault("over_one_stream", {})[backend] = {
                n: round(r["tok_s"] / one["tok_s"], 2) for n, r in out["results"][backend].items()
            }
    write_result(args.out, out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
