"""The torch hot path on the CPU, before vs after a change: median ms per verify(1), verify(8), draft(8).

Runs the demo pair (float32, torch CPU, one intra-op thread) through the real
session objects: a verifier session prefilled with a prompt, then ``verify(L) +
commit(0)`` (the cache stays at the same length, so every call has the same
shapes), and a drafter session drafting a block of 8 with one new aux row per
call. Each code tree is measured in its own subprocess (``PYTHONPATH`` = that
tree), the trees alternate round by round so a noisy shared CPU hits both alike.

    python benchmarks/cpu_fastpath.py --before /tmp/main_checkout   # main vs this tree
    python benchmarks/cpu_fastpath.py                                # this tree only

Per tree: the median over ``--reps`` calls in each round; reported: the best round (a shared CPU
only adds time) and the median of the rounds. Writes ``benchmarks/results/cpu_fastpath.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: record.py, the results' one writer
from record import write_result

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "cpu_fastpath.json"


def worker(reps: int, ctx: int, package: str, pair: Path | None = None) -> dict:
    import importlib

    import torch

    torch.set_num_threads(1)
    assembly = importlib.import_module(f"{package}.orchestrator.assembly")
    embedded_paths, local_drafter, local_verifier = (
        assembly.embedded_paths,
        assembly.local_drafter,
        assembly.local_verifier,
    )

    target, draft = (str(pair / "target"), str(pair / "draft")) if pair else embedded_paths()
    drafter = local_drafter(draft, target, "torch", device="cpu", dtype="float32")
    verifier = local_verifier(target, drafter.target_layer_ids, "torch", device="cpu", dtype="float32")
    prompt = [2] + [5 + (7 * i) % 1000 for i in range(ctx - 1)]
    vs = verifier.open_session()
    first, aux = vs.prefill(prompt)
    ds = drafter.open_session()
    ds.draft(aux, first, 2)
    block = [5 + (3 * i) % 1000 for i in range(16)]

    def verify(L):
        def f():
            vs.verify(block[:L])
            vs.commit(0)

        return f

    def draft8():
        ds.draft(aux[-1:], first, 8)

    out = {}
    for name, fn in (("verify1", verify(1)), ("verify8", verify(8)), ("draft8", draft8)):
        for _ in range(5):
            fn()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        out[name] = statistics.median(ts) * 1e3
    return out


def run_tree(tree: Path, reps: int, ctx: int, pair: Path) -> dict:
    """One worker on ``tree``'s code: trees from before the move to the ``kakeya`` import name import as
    ``services`` from the tree itself; later ones as ``kakeya`` through a link to their ``services/``."""
    if (tree / "services" / "contract.py").is_file():
        package, path = "services", str(tree)
    else:
        shim = Path(tempfile.mkdtemp(prefix="kakeya-tree-"))
        (shim / "kakeya").symlink_to(tree / "services")
        package, path = "kakeya", str(shim)
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        "--reps",
        str(reps),
        "--ctx",
        str(ctx),
        "--package",
        package,
        "--pair",
        str(pair),
    ]
    res = subprocess.run(cmd, env=env, cwd=str(tree), capture_output=True, text=True, timeout=600)
    if res.returncode:
        raise RuntimeError(f"worker in {tree} failed:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=Path, default=None, help="a checkout of the code to compare against")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--ctx", type=int, default=100)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--package", default="kakeya", help=argparse.SUPPRESS)
    ap.add_argument(
        "--pair",
        type=Path,
        default=ROOT / "services" / "models" / "demo",
        help="the pair every tree runs (default: this tree's demo pair, so trees shipping another still compare)",
    )
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.reps, args.ctx, args.package, args.pair)))
        return 0
    trees = {"after": ROOT} | ({"before": args.before.resolve()} if args.before else {})
    rounds: dict[str, list[dict]] = {k: [] for k in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            rounds[name].append(run_tree(tree, args.reps, args.ctx, args.pair.resolve()))
    # a shared CPU only ever adds time: the best round is the cleanest measurement; the median is kept too
    summary = {name: {k: min(r[k] for r in rs) for k in rs[0]} for name, rs in rounds.items()}
    medians = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in rounds.items()}
    result = {
        "benchmark": "cpu_fastpath",
        "device": "cpu",
        "device_name": platform.processor() or platform.machine(),
        "pair": f"{args.pair}, float32, torch CPU, 1 thread",
        "ctx": args.ctx,
        "reps_per_round": args.reps,
        "rounds": args.rounds,
        "best_round_median_ms": summary,
        "median_of_rounds_ms": medians,
        "per_round_ms": rounds,
        "trees": {k: str(v) for k, v in trees.items()},
    }
    if "before" in summary:
        result["after_over_before"] = {k: summary["after"][k] / summary["before"][k] for k in summary["after"]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, result)
    for name, s in summary.items():
        print(name, " ".join(f"{k} {v:.3f} ms" for k, v in s.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
