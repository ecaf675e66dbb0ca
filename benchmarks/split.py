"""Split vs colocated: one stream at each block size, where a split block's time goes, many streams.

Starts ``kakeya serve verifier`` and ``kakeya serve drafter`` as processes on
loopback and runs the same greedy generations of the same pair two ways,
alternating run by run so machine noise falls on all alike:

- colocated: verifier and drafter in this process (``build_local_engine``);
- split: the same loop in this process over ``GrpcVerifier`` / ``GrpcDrafter``
  (``split_engine``): one verifier and one drafter round trip a block;
- split_here: the verifier over gRPC, the drafter in this process (``serve orchestrator
  --verifier ... --target ... --draft ...``): one round trip a block.
  (Pre-drafting, a third mode until 2026-12-06, was removed: docs/benchmarks.md, History.)

Per split block, the critical path (the loop's client-observed block time) is
split into compute (the servers' own ``elapsed_s`` of the block's verify and
draft) and wire (the rest: serialisation, gRPC, thread hand-offs). Then
1/4/8/16 concurrent streams through the split engine, aggregate tok/s. Every output is checked against the colocated one token for token. Last, the floor
under the wire: a bare gRPC round trip to another process after idle gaps like a block's
(``grpc_floor.py``).

    python benchmarks/split.py                                   # demo pair, CPU, a few minutes
    python benchmarks/split.py --block-sizes 8 --streams 1 4 --repeats 3 --max-tokens 64
    python benchmarks/split.py --backend torch --device cuda     # on a GPU node (gpu_session.sh: part split)

Writes benchmarks/results/split.json and split.png (tok/s by block size; wire
vs compute per block).
"""

from __future__ import annotations

import argparse
import json
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

from grpc_floor import block_wire, floor
from wire import start, stop

from kakeya.app.options import DEFAULT_PROMPT
from kakeya.orchestrator.decode.engine import Request

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: record.py, the results' one writer
from record import write_result

MODES = ("colocated", "split", "split_here")
SPLITS = MODES[1:]
TIMED = ("split",)  # the mode whose servers time every step: a block's compute and wire apart
STEP_TIMEOUT_S = 30.0  # a loaded machine is slow, not hung: no step deadline should end a measured run


def med(xs):
    return statistics.median(xs) if xs else 0.0


class Sessions:
    """Keeps the sessions a remote engine opens, so a run's server-side times can be read per block."""

    def __init__(self, engine, remote_drafter: bool):
        """``remote_drafter`` False (split_here): the drafter is the colocated engine's own, left unwrapped."""
        self.verifier = self.drafter = None
        v_open, d_open = engine.verifier.open_session, engine.drafter.open_session

        def open_verifier(*args, **kwargs):
            self.verifier = v_open(*args, **kwargs)
            return self.verifier

        def open_drafter(*args, **kwargs):
            self.drafter = d_open(*args, **kwargs)
            return self.drafter

        engine.verifier.open_session = open_verifier
        if remote_drafter:
            engine.drafter.open_session = open_drafter

    def server_s(self) -> float:
        """The servers' time on the critical path so far: the verifier's steps and the drafter's drafts."""
        return self.verifier.server_s + (self.drafter.server_s if self.drafter is not None else 0.0)

    def verify_s(self) -> float:
        """The verifier's part of :meth:`server_s`."""
        return self.verifier.server_s


def cpu_ms(pids: dict[str, int]) -> dict[str, float]:
    """CPU milliseconds so far of each process in ``pids`` (every thread's, from ``/proc``), and ``grpc``: the
    part of them gRPC's own threads ran (C-core's, named ``event_engine`` / ``grpc_*``). {} without ``/proc``."""
    out: dict[str, float] = {}
    for role, pid in pids.items():
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            return {}
        for tid in tasks:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    ms = int(f.read().split()[0]) / 1e6
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    grpc_thread = f.read().startswith(("event_engine", "grpc"))
            except (OSError, ValueError, IndexError):  # a thread that ended meanwhile
                continue
            out[role] = out.get(role, 0.0) + ms
            out["grpc"] = out.get("grpc", 0.0) + (ms if grpc_thread else 0.0)
    return out


def one_run(engine, req, sessions: Sessions | None, pids: dict[str, int] | None = None):
    """One generation; per decode block (the block, servers' compute s or None, the verifier's part or None);
    and the CPU ms each of ``pids``' processes spent from the first decode block's start to the last's end."""
    blocks, cpu = [], {}
    with engine.start(req) as run:
        before = None
        for block in run:
            if not cpu and pids:  # the prefill's block: decoding starts now
                cpu = cpu_ms(pids)
            now = (sessions.server_s(), sessions.verify_s()) if sessions is not None else None
            if before is not None or sessions is None:
                blocks.append((block, *((None, None) if now is None else (now[0] - before[0], now[1] - before[1]))))
            before = now
        end = cpu_ms(pids) if cpu else {}
    gen = run.result
    spent = {k: end[k] - cpu[k] for k in end if k in cpu}
    return gen, [(b, s, v) for b, s, v in blocks if b is not gen.blocks[0]], spent


def measure_block_size(engines, sessions, prompt, args, block_size, pids):
    """``pids``: per mode, the processes whose CPU a decode block costs (colocated: this one; split: all three;
    split_here: this one and the verifier)."""
    req = Request(prompt, max_tokens=args.max_tokens, block_size=block_size, ignore_eos=True)
    for mode in MODES:  # warm-up (and, for block size 0, the cost curve's calibration)
        one_run(engines[mode], req, sessions.get(mode))
    tok_s = {m: [] for m in MODES}
    block_ms = {m: [] for m in MODES}
    compute_ms = {m: [] for m in TIMED}
    verify_ms = {m: [] for m in MODES}  # colocated: the loop's verify_s; the splits: the verifier's own elapsed_s
    verify_wire_ms = {m: [] for m in SPLITS}  # the splits: the loop's verify_s less the verifier's own elapsed_s
    draft_ms = []  # colocated: the loop's draft_s
    wire_ms = {m: [] for m in TIMED}
    accepted = {m: [] for m in MODES}
    cpu = {m: [] for m in MODES}  # per run: each process's CPU ms over its decode blocks
    identical = True
    for _ in range(args.repeats):  # alternating, so drifts in machine load hit every mode alike
        outputs = {}
        for mode in MODES:
            gen, blocks, spent = one_run(engines[mode], req, sessions.get(mode), pids[mode])
            if spent and blocks:
                cpu[mode].append({k: v / len(blocks) for k, v in spent.items()})
            outputs[mode] = gen.token_ids
            tok_s[mode].append(gen.decode_tok_s)
            accepted[mode] += [b.accepted for b, _, _ in blocks]
            for b, server_s, server_verify_s in blocks:
                block_ms[mode].append(b.total_s * 1e3)
                if server_s is not None:
                    if mode in TIMED:
                        compute_ms[mode].append(server_s * 1e3)
                        wire_ms[mode].append((b.total_s - server_s) * 1e3)
                    verify_ms[mode].append(server_verify_s * 1e3)
                    verify_wire_ms[mode].append((b.verify_s - server_verify_s) * 1e3)
                else:
                    verify_ms[mode].append(b.verify_s * 1e3)
                    if mode == "colocated":
                        draft_ms.append(b.draft_s * 1e3)
        identical &= all(outputs[m] == outputs["colocated"] for m in SPLITS)
    co = med(tok_s["colocated"])
    return {
        "block_size": block_size,
        "output_identical": identical,
        "decode_tok_s_median": {m: round(med(v), 1) for m, v in tok_s.items()},
        "over_colocated": {m: round(med(tok_s[m]) / co, 3) if co else 0.0 for m in SPLITS},
        # each alternation's own ratio (its split run against the colocated run beside it): the spread
        "over_colocated_each": {m: [round(x / c, 3) for x, c in zip(tok_s[m], tok_s["colocated"])] for m in SPLITS},
        "block_ms_median": {m: round(med(v), 3) for m, v in block_ms.items()},
        "critical_path_ms_median": {
            m: {"compute": round(med(compute_ms[m]), 3), "wire": round(med(wire_ms[m]), 3)} for m in compute_ms
        },
        "verify_ms_median": {m: round(med(v), 3) for m, v in verify_ms.items()},
        "verify_wire_ms_median": {m: round(med(v), 3) for m, v in verify_wire_ms.items()},
        "colocated_draft_ms_median": round(med(draft_ms), 3),
        "mean_accepted": {m: round(statistics.mean(v), 3) if v else 0.0 for m, v in accepted.items()},
        # The processes take turns (the loop waits for each step), so a block's wall time is about the CPU they
        # spend on it: what the split adds shows here as CPU, by process, gRPC's own threads apart.
        "cpu_ms_per_block_median": {
            m: {k: round(med([r.get(k, 0.0) for r in runs]), 3) for k in runs[0]} for m, runs in cpu.items() if runs
        },
    }


def overlap_ceiling(row: dict, round_trip_ms: float) -> dict:
    """What split / colocated could reach if every draft were hidden beside the previous verify and were as good
    as a fresh one (no acceptance lost), with one bare round trip a block.

    A block then costs the verifier's forward plus that round trip; ``with_split_verify`` prices the forward
    as the split's verifier took it (its own elapsed_s, idle gaps and all), ``with_colocated_verify`` as the
    colocated loop did (the most any overlap could buy here)."""
    colocated = row["block_ms_median"]["colocated"]
    split_verify, colocated_verify = row["verify_ms_median"]["split"], row["verify_ms_median"]["colocated"]
    return {
        "colocated_block_ms": colocated,
        "round_trip_ms": round_trip_ms,
        "with_split_verify": round(colocated / (split_verify + round_trip_ms), 3) if split_verify else 0.0,
        "with_colocated_verify": round(colocated / (colocated_verify + round_trip_ms), 3) if colocated_verify else 0.0,
    }


def measure_streams(engine, prompts, refs, n, args):
    """``n`` client threads, each running ``--stream-requests`` generations back to back; aggregate tok/s."""
    lock = threading.Lock()
    tokens, mismatched, failed = [0], [0], []

    def client(i):
        for r in range(args.stream_requests):
            j = (i + r) % len(prompts)
            req = Request(prompts[j], max_tokens=args.max_tokens, block_size=args.stream_block_size, ignore_eos=True)
            try:
                gen = engine.generate(req)
            except Exception as exc:  # noqa: BLE001 -- reported in the results, the other streams go on
                with lock:
                    failed.append(str(exc)[:200])
                continue
            with lock:
                tokens[0] += len(gen.token_ids)
                mismatched[0] += gen.token_ids != refs[j]

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"aggregate_tok_s": round(tokens[0] / wall, 1), "mismatched": mismatched[0], "failed": failed[:3]}


def _device_name(device: str | None) -> str | None:
    """The GPU's name on CUDA (figures are committed with it), else None."""
    if not str(device or "").startswith("cuda"):
        return None
    import torch

    return torch.cuda.get_device_name()


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = out["one_stream"]
    labels = [str(r["block_size"] or "auto") for r in rows]
    x = range(len(rows))
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for k, mode in enumerate(MODES):
        a.bar([i + (k - 1) * 0.27 for i in x], [r["decode_tok_s_median"][mode] for r in rows], 0.27, label=mode)
    a.set_xticks(list(x), labels)
    a.set_xlabel("block size")
    a.set_ylabel("decode tok/s (median)")
    a.set_title("one stream")
    a.legend()
    for mode in TIMED:
        compute = [r["critical_path_ms_median"][mode]["compute"] for r in rows]
        wire = [r["critical_path_ms_median"][mode]["wire"] for r in rows]
        b.bar(list(x), compute, 0.6, label=f"{mode}: compute")
        b.bar(list(x), wire, 0.6, bottom=compute, label=f"{mode}: wire", alpha=0.6)
    b.set_xticks(list(x), labels)
    b.set_xlabel("block size")
    b.set_ylabel("ms per block (median)")
    b.set_title("split critical path per block")
    b.legend(fontsize=7)
    fig.suptitle(f"{out['target']} / {out['draft']} ({out['backend']}, {out['machine']['platform']})", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", help="default: the embedded demo pair")
    ap.add_argument("--draft")
    ap.add_argument("--backend", default="auto", help="mlx, torch or auto (the fastest here), for every process alike")
    ap.add_argument("--device", help="torch: cpu or cuda")
    ap.add_argument("--dtype", help="torch: float32 (the default), bfloat16 or float16, for every process alike")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT, help="default: README command 1's")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 0], help="0: auto")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--streams", type=int, nargs="*", default=[1, 4, 8, 16])
    ap.add_argument("--stream-requests", type=int, default=2, help="generations per stream, back to back")
    ap.add_argument("--stream-block-size", type=int, default=8)
    ap.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch CPU threads of every process alike (default: the product's: 1 for the demo pair on a CPU)",
    )
    ap.add_argument(
        "--placement",
        default="auto",
        choices=["auto", "off"],
        help="as `serve all --placement`: auto pins the verifier to its own CPUs, the drafter and this "
        "process (the orchestrator's loop; the colocated runs too) to the rest, torch on a Linux CPU",
    )
    ap.add_argument(
        "--no-floor",
        action="store_true",
        help="skip the bare gRPC round trips (grpc_floor.py) and the overlap ceiling they price",
    )
    ap.add_argument(
        "--graphed-min-batch",
        type=int,
        default=None,
        help="the drafters' --graphed-min-batch, served and colocated (a GPU node's A/B; default: the product's)",
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "split.json"))
    args = ap.parse_args(argv)

    from kakeya.checkpoints.tiny import demo_pair
    from kakeya.orchestrator.assembly import build_local_engine, resolve_backend, set_torch_threads, split_engine
    from kakeya.runtime import placement

    embedded = args.target is None
    if embedded:
        pair = demo_pair()
        args.target, args.draft = str(pair.target), str(pair.draft)
    backend, device = resolve_backend(args.backend, args.device)
    on_cpu = backend == "torch" and device == "cpu"  # as serve all: measured for torch on the CPU only
    cpus = placement.for_split(args.placement, on_cpu)  # as serve all places its processes
    allowed = placement.available() if placement.can_pin() else []
    if cpus:  # before this process starts any thread: they all inherit it
        placement.pin_process(placement.parse_cpus(cpus["orchestrator"]))
    threads = set_torch_threads(args.torch_threads, device, embedded) if backend == "torch" else None
    min_batch = {} if args.graphed_min_batch is None else {"graphed_min_batch": args.graphed_min_batch}
    local = build_local_engine(args.target, args.draft, backend, device, args.dtype, torch_options=min_batch)
    where = ["--backend", backend] + (["--device", device] if backend == "torch" and device else [])
    where += ["--dtype", args.dtype] if args.dtype else []
    where += ["--torch-threads", str(threads or 0)] if backend == "torch" else []
    pair_args = ["--target", args.target, "--draft", args.draft, *where]
    drafter_args = [] if args.graphed_min_batch is None else ["--graphed-min-batch", str(args.graphed_min_batch)]
    prompt = local.codec.encode(args.prompt)
    stream_prompts = [local.codec.encode(f"{args.prompt}# part {k}\n    ") for k in range(8)]
    procs = []
    with tempfile.TemporaryDirectory(prefix="kakeya-split-") as tmp:
        tmp = Path(tmp)
        try:
            pinned = {role: ["--cpus", c] for role, c in cpus.items()}
            vp, vaddr = start("verifier", [*pair_args, "--max-sessions", "64", *pinned.get("verifier", [])], tmp)
            procs.append(vp)
            dp, daddr = start(
                "drafter", [*pair_args, *drafter_args, "--max-sessions", "64", *pinned.get("drafter", [])], tmp
            )
            procs.append(dp)
            me = {"orchestrator": os.getpid()}
            pids = {"colocated": me, "split": me | {"verifier": vp.pid, "drafter": dp.pid}}
            pids["split_here"] = me | {"verifier": vp.pid}
            engines = {"colocated": local}
            engines["split"] = split_engine(vaddr, daddr, args.target, 60.0, backend_timeout_s=STEP_TIMEOUT_S)
            # split_here's drafter: the colocated engine's own (the modes take turns; each opens its own sessions)
            engines["split_here"] = split_engine(
                vaddr, local.drafter, args.target, 60.0, backend_timeout_s=STEP_TIMEOUT_S
            )
            sessions = {m: Sessions(engines[m], remote_drafter=m == "split") for m in SPLITS}
            one = []
            for b in args.block_sizes:
                print(f"one stream, block size {b or 'auto'} ...", file=sys.stderr, flush=True)
                one.append(measure_block_size(engines, sessions, prompt, args, b, pids))
                print(json.dumps(one[-1]), file=sys.stderr, flush=True)
            refs = [
                local.generate(Request(p, max_tokens=args.max_tokens, block_size=1, ignore_eos=True)).token_ids
                for p in stream_prompts
            ]
            streams = []
            for n in args.streams:
                print(f"{n} streams, split ...", file=sys.stderr, flush=True)
                streams.append(
                    {"streams": n, "split": measure_streams(engines["split"], stream_prompts, refs, n, args)}
                )
        finally:
            stop(procs)
    grpc_floor = None
    if not args.no_floor:
        print("bare gRPC round trips (grpc_floor.py) ...", file=sys.stderr, flush=True)
        if cpus:  # the floor is gRPC's alone, as before: its processes (children inherit this one's CPUs) unpinned
            placement.pin_process(allowed)
        # After idle gaps like a block's: the verifier sleeps through a draft (~1-3 ms), the drafter
        # through a verify (~5-10 ms); a block's wire is two such round trips and what Kakeya adds.
        grpc_floor = floor(gaps_ms=(0.0, 3.0, 10.0), size=4096, servers=("sync", "aio"))
        # ... and a bare block both ways a split could run it: two round trips, or a verifier -> drafter relay
        grpc_floor["block"] = block_wire(repeats=2)
        round_trip = grpc_floor["round_trip_ms"]["sync"]["0"]
        for row in one:
            row["overlap_ceiling"] = overlap_ceiling(row, round_trip)
    base = {"split": streams[0]["split"]["aggregate_tok_s"]} if streams else {}
    for row in streams:
        for m, one_stream in base.items():
            row[m]["over_one_stream"] = round(row[m]["aggregate_tok_s"] / one_stream, 2) if one_stream else 0.0
    out = {
        "benchmark": "split",
        "target": local.target,
        "draft": local.draft,
        "backend": local.verifier.info.backend,
        "device": local.device,
        "device_name": _device_name(local.device),
        "dtype": args.dtype or "float32",
        "knobs": {"graphed_min_batch": args.graphed_min_batch},  # None: default
        "torch_threads": threads or "torch's default",
        "placement": cpus or "off",
        "prompt_tokens": len(prompt),
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "one_stream": one,
        "streams": streams,
        "stream_block_size": args.stream_block_size,
        "grpc_floor": grpc_floor,
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()},
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "notes": (
            "Loopback; verifier, drafter and this client (the loop) are separate processes sharing the machine's cores, "
            "pinned as `serve all --placement` pins them (placement: each role's CPUs; the colocated runs are in this "
            "process, on the orchestrator's). split_here: the verifier over gRPC, the drafter in this process. "
            "Medians over alternating runs after a warm-up. critical_path_ms: per split block, compute = the servers' "
            "elapsed_s of its verify and draft, wire = the client-observed block time minus that. grpc_floor: "
            "a bare bidirectional-stream echo of 4 KB to another process (benchmarks/grpc_floor.py; a sync grpc.server "
            "as Kakeya's, and a grpc.aio one), each message sent after an idle gap of 0 / 3 / 10 ms: the least a round "
            "trip costs here. grpc_floor.block: a bare block's wire with the servers burning a block's compute, as two "
            "round trips and as a relay chain (verifier -> drafter -> client). verify_ms_median: colocated, the loop's "
            "verify time a block; the splits, the verifier's own elapsed_s. verify_wire_ms_median: the splits' verify round "
            "trip less the verifier's own elapsed_s (gRPC both ways, the messages' handling, the aux decoded). overlap_ceiling: colocated block ms / (a verify + "
            "the bare round trip with no gap), the verify priced as the split's verifier took it or as the colocated one "
            "did: what split / colocated could reach if every draft were hidden beside the previous verify and were as "
            "good as a fresh one. cpu_ms_per_block_median: per decode block (prefill, open and close left out), the CPU "
            "ms each process spent (colocated: this one, as 'orchestrator'; split: this one and both servers; split_here: "
            "this one and the verifier; 'grpc': "
            "the part gRPC's C-core threads ran, inside the others), from /proc schedstat; median over the runs."
        ),
    }
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_result(path, out)
    plot(out, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}", file=sys.stderr)


if __name__ == "__main__":
    main()
