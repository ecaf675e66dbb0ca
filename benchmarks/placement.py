"""Pinned vs unpinned split processes, side by side: ``split.py --placement off`` and ``auto``, alternating.

``serve all --placement auto`` (the default; ``services/runtime/placement.py``) pins, on Linux with
torch on the CPU, the verifier to its own CPUs and the drafter and the orchestrator to the rest.
This runs ``benchmarks/split.py`` both ways in turn, ``--pairs`` times (off, auto, off, auto, ...:
drifts in machine load fall on both alike), and reports per block size the split's wire per block,
its decode tok/s and its ratio to colocated, and per stream count the split's aggregate tok/s, each
as the median over the runs of that placement, with auto / off.

    python benchmarks/placement.py                                   # 3 pairs, block 8 and auto, 1 and 16 streams
    python benchmarks/placement.py --pairs 2 -- --block-sizes 4 8 --streams 1 4 16 --repeats 3

Writes benchmarks/results/placement.json (every run's figures, then the medians).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: record.py, the results' one writer
from record import write_result

ROOT = Path(__file__).resolve().parents[1]
SPLIT_ARGS = ["--block-sizes", "8", "0", "--streams", "1", "16", "--repeats", "3"]


def figures(split: dict) -> dict:
    """What one split.py run says of the split: per block size and per stream count."""
    blocks = {
        str(r["block_size"] or "auto"): {
            "wire_ms": r["critical_path_ms_median"]["split"]["wire"],
            "split_tok_s": r["decode_tok_s_median"]["split"],
            "over_colocated": r["over_colocated"]["split"],
            "identical": r["output_identical"],
        }
        for r in split["one_stream"]
    }
    streams = {str(s["streams"]): {"aggregate_tok_s": s["split"]["aggregate_tok_s"], "mismatched": s["split"]["mismatched"]}
               for s in split["streams"]}  # fmt: skip
    return {"placement": split["placement"], "block": blocks, "streams": streams}


def medians(runs: list[dict]) -> dict:
    """Per placement, the median of each figure over its runs; then auto / off."""
    out: dict = {}
    for pl in ("off", "auto"):
        mine = [r for r in runs if r["asked"] == pl]
        out[pl] = {
            "block": {b: {k: round(statistics.median(r["block"][b][k] for r in mine), 3) for k in ("wire_ms", "split_tok_s", "over_colocated")}
                      for b in mine[0]["block"]},
            "streams": {n: round(statistics.median(r["streams"][n]["aggregate_tok_s"] for r in mine), 1) for n in mine[0]["streams"]},
        }  # fmt: skip
    off, auto = out["off"], out["auto"]
    out["auto_over_off"] = {
        "block": {
            b: {k: round(auto["block"][b][k] / off["block"][b][k], 3) for k in off["block"][b]} for b in off["block"]
        },
        "streams": {n: round(auto["streams"][n] / off["streams"][n], 3) for n in off["streams"]},
    }
    return out


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split_args = argv[argv.index("--") + 1 :] if "--" in argv else SPLIT_ARGS
    own = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=3, help="off/auto pairs of split.py runs")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "placement.json"))
    args = ap.parse_args(own)
    runs = []
    with tempfile.TemporaryDirectory(prefix="kakeya-placement-") as tmp:
        for i in range(args.pairs):
            for pl in ("off", "auto"):
                print(f"pair {i + 1}/{args.pairs}: split.py --placement {pl} ...", file=sys.stderr, flush=True)
                out = Path(tmp) / f"{pl}{i}.json"
                cmd = [
                    sys.executable,
                    str(ROOT / "benchmarks" / "split.py"),
                    *split_args,
                    "--placement",
                    pl,
                    "--out",
                    str(out),
                ]
                subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                runs.append({"asked": pl, "pair": i} | figures(json.loads(out.read_text())))
    result = {
        "benchmark": "placement",
        "split_args": split_args,
        "pairs": args.pairs,
        "runs": runs,
        "median": medians(runs),
        "identical": all(b["identical"] for r in runs for b in r["block"].values())
        and not any(s["mismatched"] for r in runs for s in r["streams"].values()),
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": "python benchmarks/placement.py " + " ".join(argv),
        "notes": "Each run is a whole benchmarks/split.py (its own server processes, warm-up and alternating colocated / "
                 "split runs); placement 'off' leaves the processes to the scheduler, 'auto' pins them as serve all does "
                 "(runs[].placement: the CPUs each role got; 'off' where this machine cannot pin). Medians over the runs "
                 "of each placement.",
    }  # fmt: skip
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_result(path, result)
    print(json.dumps(result["median"]["auto_over_off"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
