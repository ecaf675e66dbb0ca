"""What keeping freed heap memory buys (``runtime/heap.py``): two colocated servers side by side, glibc's
defaults (``KAKEYA_MALLOC=system``) and the thresholds every ``kakeya`` command sets, taking turns.

::

    python benchmarks/heap.py                      # -> benchmarks/results/heap.json
    python benchmarks/heap.py --streams 1 16 --windows 12 --window-s 8

Both servers are ``kakeya serve orchestrator --backend torch`` on the embedded demo pair (the Mac's shape,
as ``concurrency.py`` starts it), up at once. For each stream count, windows of ``--window-s`` seconds
alternate between them (A B A B: this machine's speed drifts by tens of percent over minutes, and windows
seconds apart see the same machine): N client threads stream greedy requests back to back (every request its
own prompt, EOS ignored) to that window's server, the other idle. Each window reports the tokens streamed per
second and the server's minor page faults per second (``/proc``); per stream count, the medians of each
server's windows and the median ratio of neighbouring windows.
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
from concurrency import prompt
from load import serve_all, stop_serve_all

from kakeya.wire.kakeya.v1 import generate_pb2 as pb
from kakeya.wire.kakeya.v1 import generate_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: record.py, the results' one writer
from record import write_result

SERVERS = {"system": "system", "kept": None}  # name -> KAKEYA_MALLOC for its process (None: unset)


def minor_faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def window(stub, pid: int, streams: int, seconds: float, max_tokens: int, first: int) -> dict:
    """``streams`` clients streaming requests for ``seconds``: tokens streamed a second, faults a second."""
    lock, tokens, stop = threading.Lock(), [0], threading.Event()

    def client(i: int) -> None:
        r = first
        while not stop.is_set():
            req = pb.GenerateRequest(
                text=prompt(i, r), sampling_params=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            )
            for resp in stub.Generate(req, timeout=120):
                if resp.HasField("chunk") and not stop.is_set():
                    with lock:
                        tokens[0] += len(resp.chunk.token_ids)
            r += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(streams)]
    f0, t0 = minor_faults(pid), time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(seconds)
    with lock:
        stop.set()
        elapsed, counted = time.perf_counter() - t0, tokens[0]
    faults = minor_faults(pid) - f0
    for t in threads:  # their requests in flight finish before the next window starts
        t.join()
    return {"tok_s": round(counted / elapsed, 1), "faults_s": round(faults / elapsed)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    p.add_argument("--windows", type=int, default=12, help="windows per stream count, the servers alternating")
    p.add_argument("--window-s", type=float, default=8.0)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/heap.json"))
    args = p.parse_args(argv)
    if not sys.platform.startswith("linux"):
        raise SystemExit("glibc's malloc thresholds and /proc: Linux only")
    out = {
        "command": " ".join(["python", "benchmarks/heap.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "libc": " ".join(platform.libc_ver())},
        "pair": "embedded demo pair",
        "max_tokens": args.max_tokens,
        "window_s": args.window_s,
        "results": {},
    }
    with tempfile.TemporaryDirectory(prefix="kakeya-heap-") as tmp:
        procs, stubs, pids = {}, {}, {}
        saved = os.environ.get("KAKEYA_MALLOC")
        try:
            for name, value in SERVERS.items():  # each server inherits this process's environment as it starts
                os.environ.pop("KAKEYA_MALLOC", None)
                if value is not None:
                    os.environ["KAKEYA_MALLOC"] = value
                procs[name], info = serve_all(
                    Path(tmp), ["--backend", "torch"], args.start_timeout, name=name, role="orchestrator"
                )
                stubs[name] = generate_pb2_grpc.GenerationStub(grpc.insecure_channel(info["addr"]))
                pids[name] = procs[name].pid
                window(stubs[name], pids[name], 2, 2.0, args.max_tokens, 90)  # warm-up: calibration, first shapes
            for n in args.streams:
                rows = {name: [] for name in SERVERS}
                for w in range(args.windows):
                    name = list(SERVERS)[w % 2]
                    rows[name].append(window(stubs[name], pids[name], n, args.window_s, args.max_tokens, 10 * w))
                    print(f"  {n:>2} streams, {name:>6}: {rows[name][-1]['tok_s']:7.1f} tok/s, "
                          f"{rows[name][-1]['faults_s']:>6} faults/s", flush=True)  # fmt: skip
                out["results"][str(n)] = r = {
                    "windows": rows,
                    **{name: {k: statistics.median(x[k] for x in rows[name]) for k in ("tok_s", "faults_s")} for name in SERVERS},
                    "tok_s_ratio_pairs": round(statistics.median(
                        b["tok_s"] / a["tok_s"] for a, b in zip(rows["system"], rows["kept"])), 3),
                }  # fmt: skip
                print(f"{n} streams: {r['system']['tok_s']:.1f} -> {r['kept']['tok_s']:.1f} tok/s (pairs: "
                      f"{r['tok_s_ratio_pairs']}x), faults/s {r['system']['faults_s']:.0f} -> {r['kept']['faults_s']:.0f}",
                      flush=True)  # fmt: skip
        finally:
            if saved is None:
                os.environ.pop("KAKEYA_MALLOC", None)
            else:
                os.environ["KAKEYA_MALLOC"] = saved
            for proc in procs.values():
                stop_serve_all(proc)
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_result(path, out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
