"""The pause a take-over adds, against one prefill of the same context (issue 59's goal: <= 2x).

Starts two ``kakeya serve verifier`` and two ``kakeya serve drafter`` processes on loopback (the demo pair
unless ``--target``/``--draft``) and drives one greedy stream at a time through a split engine in this
process over both replicas of each role (``ipv4:A,B``, as ``serve orchestrator --verifier`` takes them),
take-over on (``RunOptions.takeover``, as a server runs it). Once the stream has ``--kill-after`` tokens, the
replica of ``--role`` that holds its session (the one whose GetInfo counts a live session) is SIGKILLed; the
stream goes on elsewhere (``decode/takeover.py``) and the run's ``takeovers`` record the pause: the loss
noticed to the session reopened (its prefill of prompt + committed tokens done). The killed replica is
restarted on its port before the next repeat. Every output is checked against the same request run
uninterrupted. The baseline: a cold request whose prompt is as long as the take-over's context (random ids,
never cached), its prefill time as the run reports it (sessions opened to first token), on the same servers.

``--signal term`` sends SIGTERM instead: the replica drains (docs/operations.md, "Drains and rolling updates"),
its session moves at its next step (a drain hand-off, not a take-over), and the row also records how long the
replica was out of service: SIGTERM to its process's exit.

    python benchmarks/takeover.py                          # demo pair, both roles, 3 repeats each
    python benchmarks/takeover.py --roles verifier --repeats 5 --kill-after 96
    python benchmarks/takeover.py --signal term            # a drain: writes benchmarks/results/drain.json

Writes benchmarks/results/takeover.json (``--signal term``: drain.json).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from record import provenance, write_result

from kakeya.orchestrator.decode.engine import Request, RunOptions


class Replica:
    """One ``kakeya serve ROLE`` process, restartable on the port it first got."""

    def __init__(self, role: str, name: str, argv: list[str], tmp: Path):
        self.role, self.name, self.argv, self.tmp = role, name, argv, tmp
        self.port, self.proc, self.addr = 0, None, ""

    def start(self) -> Replica:
        ready = self.tmp / f"{self.name}.json"
        ready.unlink(missing_ok=True)
        with open(self.tmp / f"{self.name}.log", "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kakeya.app.main", "serve", self.role, *self.argv, "--port", str(self.port),
                 "--ready-file", str(ready)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + 300
        while not ready.is_file():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{self.name} did not start:\n{(self.tmp / f'{self.name}.log').read_text()[-3000:]}")
            time.sleep(0.05)
        info = json.loads(ready.read_text())
        self.addr, self.port = info["addr"], info.get("port") or int(info["addr"].rsplit(":", 1)[1])
        return self

    def live_sessions(self) -> int:
        from kakeya.orchestrator.remote.streams import backend_channel
        from kakeya.wire.kakeya.v1 import drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc

        ch = backend_channel(self.addr)
        try:
            if self.role == "verifier":
                stub = verifier_pb2_grpc.VerifierServiceStub(ch)
                return stub.GetInfo(verifier_pb2.GetVerifierInfoRequest(), timeout=10).live_sessions
            stub = drafter_pb2_grpc.DrafterServiceStub(ch)
            return stub.GetInfo(drafter_pb2.GetDrafterInfoRequest(), timeout=10).live_sessions
        finally:
            ch.close()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def terminate(self) -> dict:
        """SIGTERM; the returned dict gets ``exit_s`` (SIGTERM to the process's exit) once it has exited."""
        out, t0 = {}, time.perf_counter()
        self.proc.send_signal(signal.SIGTERM)

        def watch(proc=self.proc):
            proc.wait()
            out["exit_s"] = time.perf_counter() - t0

        threading.Thread(target=watch, daemon=True).start()
        return out

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def med(xs):
    return statistics.median(xs) if xs else None


def one_takeover(engine, replicas, role, prompt, args, reference):
    """One stream with the holder of its ``role`` session killed (or SIGTERMed) at ``--kill-after`` tokens."""
    req = Request(prompt, max_tokens=args.max_tokens, block_size=args.block_size, ignore_eos=True)
    heard = []  # (role, pause, drained) of each take-over or hand-off
    options = RunOptions(takeover=True, drafter_fallback=True, on_takeover=lambda *event: heard.append(event))
    killed, times, t_kill, t_after, exited = None, [], None, None, {}
    with engine.start(req, options) as run:
        for _block in run:
            now = time.perf_counter()
            if t_kill is None:
                times.append(now)
            elif t_after is None:
                t_after = now  # the first block after the kill: the take-over's pause is in this gap
            gen = run._decode.generation
            if killed is None and len(gen.token_ids) >= args.kill_after:
                holders = [r for r in replicas[role] if r.live_sessions() > 0]
                assert len(holders) == 1, f"{role} sessions on {len(holders)} replicas"
                killed = holders[0]
                context = len(gen.prompt_ids) + len(gen.token_ids) - 1
                if args.signal == "term":
                    exited = killed.terminate()
                else:
                    killed.kill()
                t_kill = time.perf_counter()
    gen = run.result
    assert gen.token_ids == reference, "the take-over changed the output"
    drain = args.signal == "term"
    assert [(r, d) for r, _, d in heard] == [(role, drain)], f"take-overs {heard}"
    assert [r for r, _ in run.takeovers] == ([] if drain else [role]), f"take-overs {run.takeovers}"
    assert not gen.drafter_fallback, "the stream fell back to the verifier alone"
    block_gaps = [b - a for a, b in itertools.pairwise(times)]
    during = t_after - t_kill
    row = {"context_tokens": context, "pause_s": heard[0][1], "gap_s": during, "block_gap_median_s": med(block_gaps)}
    if drain:
        killed.proc.wait(60)
        row["out_of_service_s"] = exited["exit_s"]  # SIGTERM to exit: the drain's whole length
    killed.start()  # back on its port for the next repeat
    return row


def cold_prefill_s(engine, n: int, vocab: int, rng) -> float:
    ids = [2, *(rng.randrange(100, vocab) for _ in range(n - 1))]
    with engine.start(Request(ids, max_tokens=1, ignore_eos=True), RunOptions()) as run:
        for _ in run:
            pass
    return run.result.prefill_s


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--roles", nargs="+", default=["verifier", "drafter"], choices=["verifier", "drafter"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--kill-after", type=int, default=64)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument(
        "--signal",
        choices=["kill", "term"],
        default="kill",
        help="SIGKILL the holder (a take-over) or SIGTERM it (a drain hand-off)",
    )
    p.add_argument("--target", help="the verifier's checkpoint (default: the embedded demo pair)")
    p.add_argument("--draft", help="the drafter's checkpoint")
    p.add_argument("--out", help="default: benchmarks/results/takeover.json (--signal term: drain.json)")
    args = p.parse_args(argv)
    args.out = args.out or str(
        ROOT / "benchmarks" / "results" / ("drain.json" if args.signal == "term" else "takeover.json")
    )
    record = provenance()
    from kakeya.orchestrator.assembly import split_engine

    model = (["--target", args.target] if args.target else []) + (["--draft", args.draft] if args.draft else [])
    tmp = Path(tempfile.mkdtemp(prefix="takeover-"))
    replicas = {
        "verifier": [Replica("verifier", f"verifier-{k}", model, tmp) for k in range(2)],
        "drafter": [Replica("drafter", f"drafter-{k}", model, tmp) for k in range(2)],
    }
    everyone = [r for rs in replicas.values() for r in rs]
    try:
        for r in everyone:
            r.start()
        engine = split_engine(
            "ipv4:" + ",".join(r.addr for r in replicas["verifier"]),
            "ipv4:" + ",".join(r.addr for r in replicas["drafter"]),
            None, 60.0, backend_timeout_s=30.0,
        )  # fmt: skip
        vocab = engine.verifier.info.vocab_size
        rng = random.Random(59)
        rows = {role: [] for role in args.roles}
        for k in range(args.repeats):
            for role in args.roles:
                prompt = [2, *(rng.randrange(100, vocab) for _ in range(args.prompt_tokens - 1))]
                reference = engine.generate(Request(prompt, max_tokens=args.max_tokens, block_size=args.block_size,
                                                    ignore_eos=True)).token_ids  # fmt: skip
                row = one_takeover(engine, replicas, role, prompt, args, reference)
                row["prefill_s"] = cold_prefill_s(engine, row["context_tokens"], vocab, rng)
                row["pause_over_prefill"] = row["pause_s"] / row["prefill_s"]
                rows[role].append(row)
                print(f"{role} #{k}: pause {row['pause_s'] * 1e3:.0f} ms, one prefill of {row['context_tokens']}"
                      f" tokens {row['prefill_s'] * 1e3:.0f} ms: {row['pause_over_prefill']:.2f}x; the block gap"
                      f" it fell in {row['gap_s'] * 1e3:.0f} ms (median gap {row['block_gap_median_s'] * 1e3:.0f} ms)"
                      + (f"; out of service {row['out_of_service_s']:.2f} s" if "out_of_service_s" in row else ""),
                      flush=True)  # fmt: skip
    finally:
        for r in everyone:
            r.stop()
    summary = {
        role: {
            "pause_s_median": med([r["pause_s"] for r in rs]),
            "prefill_s_median": med([r["prefill_s"] for r in rs]),
            "pause_over_prefill_median": med([r["pause_over_prefill"] for r in rs]),
            "pause_over_prefill_max": max(r["pause_over_prefill"] for r in rs),
        }
        | (
            {
                "out_of_service_s_median": med([r["out_of_service_s"] for r in rs]),
                "out_of_service_s_max": max(r["out_of_service_s"] for r in rs),
            }
            if args.signal == "term"
            else {}
        )
        for role, rs in rows.items()
    }
    goal = "pause <= 2x one prefill of the context" + ("; out of service <= 10 s" if args.signal == "term" else "")
    result = {"args": vars(args), "runs": rows, "summary": summary, "goal": goal}
    write_result(Path(args.out), result, record=record)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
