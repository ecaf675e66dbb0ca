"""Hostile insiders: public load while other processes attack the verifier and drafter ports.

::

    python benchmarks/hostile_internal.py [--clients 4] [--seconds 30] [--rounds 2] [--max-tokens 32] [--holders 6]
                                          [--target DIR --draft DIR] [--out benchmarks/results/hostile_internal.json]

Starts a split deployment on loopback the way the manifests do (verifier and drafter
behind an internal token, ``--max-sessions-per-peer``, idle reclaim and a short wait
queue; the orchestrator sends the token), computes each prompt's greedy AR reference
(block size 1), then runs the public load for ``--seconds`` quiet, then under attack,
``--rounds`` times alternating (this box's load drifts: compare the medians). The attack,
all at once:

- a client without the token calling every verifier and drafter RPC (must all be UNAUTHENTICATED);
- a client holding the token from another address (``[::1]``: a leaked credential)
  that keeps ``--holders`` verifier sessions open and idle, re-opening each one the
  server ends (the red team's 300-idle-sessions attack);
- public requests cancelled after their first chunk, and public requests whose deadline passes;
- malformed public requests (a subnormal temperature, an invalid top_p, an empty prompt).

Reports per phase: public requests, failures by status, outputs different from AR,
p50/p99 latency, tok/s; for the attack: what each hostile call got, the held sessions
admitted/refused/reclaimed, and ``kakeya_ar_fallbacks_total`` by reason. Exit status 1
on any public failure, any output different from AR, any INTERNAL/UNKNOWN, any
unauthenticated call let through, or any AR fallback counted (the drafter never fails here).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc

from benchmarks.load import TEXT_PROMPTS, TINY_PROMPTS, percentile, stream
from benchmarks.load import cpu_seconds as process_cpu_seconds
from kakeya.runtime.security.auth import new_token, with_bearer
from kakeya.wire.kakeya.v1 import drafter_pb2, drafter_pb2_grpc, generate_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from kakeya.wire.kakeya.v1 import generate_pb2 as pb

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: record.py, the results' one writer
from record import write_result

V, D = verifier_pb2.VerifierRequest, drafter_pb2.DrafterRequest
BAD = {"INTERNAL", "UNKNOWN"}


def start(tmp: Path, name: str, args: list[str], timeout: float) -> tuple[subprocess.Popen, dict]:
    """`kakeya serve NAME ARGS` with a ready file: (process, ready info)."""
    ready, log = tmp / f"{name}.json", tmp / f"{name}.log"
    cmd = [
        sys.executable,
        "-m",
        "kakeya.app.main",
        "serve",
        *args,
        "--port",
        "0",
        "--grace",
        "2",
        "--ready-file",
        str(ready),
    ]
    with open(log, "wb") as out:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while not ready.is_file():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"{name} did not start:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.1)
    return proc, json.loads(ready.read_text())


def fallbacks(metrics_port: int) -> dict[str, float]:
    """``kakeya_ar_fallbacks_total`` by reason."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {s.labels["reason"]: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == "kakeya_ar_fallbacks_total"}  # fmt: skip


class Tally:
    """Status codes by kind of call, thread-safe."""

    def __init__(self):
        self.lock, self.codes = threading.Lock(), collections.defaultdict(collections.Counter)

    def add(self, kind: str, code: str) -> None:
        with self.lock:
            self.codes[kind][code] += 1

    def call(self, kind: str, fn) -> None:
        try:
            fn()
            self.add(kind, "OK")
        except grpc.RpcError as exc:
            self.add(kind, exc.code().name)


def cpu_seconds(pids) -> float:
    """User + system CPU time of these processes so far (Linux /proc; 0 elsewhere)."""
    return sum(s for pid in pids if (s := process_cpu_seconds(pid)) is not None)


def public_load(addr: str, prompts, refs, args, seconds: float, pids) -> dict:
    """``args.clients`` streaming clients for ``seconds``; ``pids``: the servers, whose CPU time is counted."""
    stub = generate_pb2_grpc.GenerationStub(grpc.insecure_channel(addr))
    lock = threading.Lock()
    lat, failures, mismatches, tokens = [], collections.Counter(), 0, 0
    stop_at = time.monotonic() + seconds

    def client(i: int) -> None:
        nonlocal mismatches, tokens
        k = i
        while time.monotonic() < stop_at:
            j = k % len(prompts)
            k += 1
            try:
                ids, _, _, took = stream(stub, prompts[j], args.max_tokens, args.block_size)
            except grpc.RpcError as exc:
                with lock:
                    failures[exc.code().name] += 1
                continue
            with lock:
                lat.append(took)
                tokens += len(ids)
                mismatches += ids != refs[j]

    t0, cpu0 = time.perf_counter(), cpu_seconds(pids)
    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall, cpu = time.perf_counter() - t0, cpu_seconds(pids) - cpu0
    return {"requests": len(lat) + sum(failures.values()), "failed": dict(failures), "different_from_ar": mismatches,
            "latency_p50_s": round(percentile(lat, 50), 3), "latency_p99_s": round(percentile(lat, 99), 3),
            "tok_s": round(tokens / wall, 1), "server_cpu_s": round(cpu, 1),
            "tokens_per_server_cpu_s": round(tokens / cpu, 1) if cpu else None}  # fmt: skip


def attack(
    ready: dict, token: str, public: str, stop: threading.Event, tally: Tally, holders: int, max_tokens: int
) -> list:
    """Start the hostile threads; they run until ``stop``."""
    stranger_v = verifier_pb2_grpc.VerifierServiceStub(grpc.insecure_channel(ready["verifier"]))
    stranger_d = drafter_pb2_grpc.DrafterServiceStub(grpc.insecure_channel(ready["drafter"]))
    port = ready["verifier"].rsplit(":", 1)[1]
    leaked = verifier_pb2_grpc.VerifierServiceStub(with_bearer(grpc.insecure_channel(f"[::1]:{port}"), token))
    gen = generate_pb2_grpc.GenerationStub(grpc.insecure_channel(public))

    def strangers():
        while not stop.is_set():
            tally.call(
                "no_token.verifier.GetInfo",
                lambda: stranger_v.GetInfo(verifier_pb2.GetVerifierInfoRequest(), timeout=5),
            )
            tally.call(
                "no_token.verifier.Session",
                lambda: list(
                    stranger_v.Session(iter([V(open=V.Open()), V(prefill=V.Prefill(token_ids=[2, 40]))]), timeout=5)
                ),
            )
            tally.call(
                "no_token.drafter.GetInfo", lambda: stranger_d.GetInfo(drafter_pb2.GetDrafterInfoRequest(), timeout=5)
            )
            tally.call(
                "no_token.drafter.Session", lambda: list(stranger_d.Session(iter([D(open=D.Open())]), timeout=5))
            )
            stop.wait(0.2)

    def holder():  # one idle session at a time, re-opened whenever the server ends it
        while not stop.is_set():

            def requests():
                yield V(open=V.Open(max_positions=64))
                yield V(prefill=V.Prefill(token_ids=[2, 40, 41, 42]))
                stop.wait(120)

            call = leaked.Session(requests(), timeout=120)
            try:
                for _ in call:
                    tally.add("leaked_token.held_session", "admitted")
                    break
                for _ in call:
                    pass
            except grpc.RpcError as exc:
                tally.add(
                    "leaked_token.held_session", exc.code().name
                )  # ABORTED: reclaimed; RESOURCE_EXHAUSTED: capped
            call.cancel()
            stop.wait(0.05)

    def cancels():
        while not stop.is_set():
            req = pb.GenerateRequest(sampling_params=pb.SamplingParams(max_tokens=10 * max_tokens, ignore_eos=True))
            req.tokenized.ids.extend(TINY_PROMPTS[0])
            call = gen.Generate(req, timeout=60)
            tally.call("public.cancelled", lambda c=call: next(c))
            call.cancel()
            tally.call("public.deadline", lambda r=req: list(gen.Generate(r, timeout=0.3)))
            stop.wait(0.5)

    def malformed():
        bad = [pb.SamplingParams(max_tokens=4, temperature=1e-39), pb.SamplingParams(max_tokens=4, temperature=1.0, top_p=2.0),
               pb.SamplingParams(max_tokens=4, temperature=float("nan"))]  # fmt: skip
        while not stop.is_set():
            for sp in bad:
                req = pb.GenerateRequest(sampling_params=sp)
                req.tokenized.ids.extend(TINY_PROMPTS[1])
                tally.call("public.malformed", lambda r=req: list(gen.Generate(r, timeout=10)))
            tally.call("public.malformed", lambda: list(gen.Generate(pb.GenerateRequest(), timeout=10)))
            stop.wait(0.5)

    threads = [threading.Thread(target=f, daemon=True) for f in (strangers, cancels, malformed)]
    threads += [threading.Thread(target=holder, daemon=True) for _ in range(holders)]
    for t in threads:
        t.start()
    return threads


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=4, help="public streaming clients (default 4)")
    p.add_argument("--seconds", type=float, default=30.0, help="each phase's length (default 30)")
    p.add_argument("--rounds", type=int, default=2, help="quiet/attack phase pairs, alternating (default 2)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--block-size", type=int, default=0, help="0: the drafter's default")
    p.add_argument("--holders", type=int, default=6, help="idle verifier sessions the leaked-token client keeps open")
    p.add_argument(
        "--max-sessions", type=int, default=8, help="the verifier's and drafter's --max-sessions (default 8)"
    )
    p.add_argument("--target", help="target checkpoint (default: the embedded default pair)")
    p.add_argument("--draft", help="drafter checkpoint")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/hostile_internal.json"))
    args = p.parse_args(argv)

    pair = [*(["--target", args.target] if args.target else []), *(["--draft", args.draft] if args.draft else [])]
    procs = []
    with tempfile.TemporaryDirectory(prefix="kakeya-hostile-") as tmp_s:
        tmp = Path(tmp_s)
        token = new_token()
        (tmp / "token").write_text(token + "\n")
        # "localhost": 127.0.0.1 and ::1, so the leaked-token client is a peer of its own
        guard = ["--host", "localhost", "--auth-token-file", str(tmp / "token"), "--max-sessions", str(args.max_sessions),
                 "--max-sessions-per-peer", str(max(1, args.max_sessions - 2)), "--reclaim-idle", "1",
                 "--queue", str(args.max_sessions), "--queue-timeout", "10"]  # fmt: skip
        try:
            v, vinfo = start(tmp, "verifier", ["verifier", *pair, *guard], args.start_timeout)
            d, dinfo = start(tmp, "drafter", ["drafter", *pair, *guard], args.start_timeout)
            procs += [v, d]
            vaddr, daddr = f"127.0.0.1:{vinfo['port']}", f"127.0.0.1:{dinfo['port']}"
            o, oinfo = start(tmp, "orchestrator", ["orchestrator", "--verifier", vaddr, "--drafter", daddr,
                                                   "--backend-token-file", str(tmp / "token"), "--metrics-port", "0",
                                                   *(["--tokenizer", args.target] if args.target else [])], args.start_timeout)  # fmt: skip
            procs.append(o)
            addr, pids = oinfo["addr"], [proc.pid for proc in procs]
            stub = generate_pb2_grpc.GenerationStub(grpc.insecure_channel(addr))
            prompts = TEXT_PROMPTS if args.target else TINY_PROMPTS
            refs = [stream(stub, q, args.max_tokens, 1)[0] for q in prompts]  # block 1: the verifier alone, greedy AR
            for q in prompts:  # warm the speculative path up too, or the first phase measures it
                stream(stub, q, args.max_tokens, args.block_size)

            quiet, attacked, tally = [], [], Tally()
            before = fallbacks(oinfo["metrics_port"])
            for _ in range(args.rounds):  # alternating: this box's load drifts
                quiet.append(public_load(addr, prompts, refs, args, args.seconds, pids))
                stop = threading.Event()
                threads = attack(
                    {"verifier": vaddr, "drafter": daddr}, token, addr, stop, tally, args.holders, args.max_tokens
                )
                attacked.append(public_load(addr, prompts, refs, args, args.seconds, pids))
                stop.set()
                for t in threads:
                    t.join(30)
            time.sleep(1.0)  # the last runs' ends are counted as their streams close
            after = fallbacks(oinfo["metrics_port"])
            why = [line for line in (tmp / "orchestrator.log").read_text(errors="replace").splitlines()
                   if "the drafter stopped" in line or "AR fallback" in line][:10]  # fmt: skip
        finally:
            for proc in reversed(procs):
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()

    hostile = {k: dict(c) for k, c in sorted(tally.codes.items())}
    ar_fallbacks = {r: after.get(r, 0) - before.get(r, 0) for r in sorted(set(before) | set(after))}
    failed = collections.Counter()
    for phase in (*quiet, *attacked):
        failed.update(phase["failed"])
    internal = sum(n for c in [*tally.codes.values(), failed]
                   for code, n in c.items() if code in BAD)  # fmt: skip
    let_through = sum(
        n
        for k, c in tally.codes.items()
        if k.startswith("no_token")
        for code, n in c.items()
        if code != "UNAUTHENTICATED"
    )
    config = {"clients": args.clients, "seconds": args.seconds, "max_tokens": args.max_tokens, "block_size": args.block_size,
              "holders": args.holders, "max_sessions": args.max_sessions, "pair": args.target or "embedded default",
              "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs"}  # fmt: skip
    result = {
        "config": config,
        "quiet": quiet,
        "under_attack": attacked,
        "tok_s_median_quiet": statistics.median(q["tok_s"] for q in quiet),
        "tok_s_median_under_attack": statistics.median(a["tok_s"] for a in attacked),
        "hostile_calls": hostile,
        "ar_fallbacks": ar_fallbacks,
        "ar_fallback_log": why,
        "internal_or_unknown": internal,
        "unauthenticated_let_through": let_through,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, result)
    print(json.dumps(result, indent=1))
    ok = (not failed and not any(phase["different_from_ar"] for phase in (*quiet, *attacked))
          and not internal and not let_through and not any(ar_fallbacks.values()))  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
