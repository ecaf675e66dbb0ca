"""What a new user sees: README command 1 (`kakeya generate --compare-ar`) in fresh processes.

    python benchmarks/first_request.py                        # torch, auto vs fixed 4/8/16, 5 rounds
    python benchmarks/first_request.py --backend mlx --rounds 3
    python benchmarks/first_request.py --extra --temperature 0.7 --seed 1 --out benchmarks/results/first_request_t07.json
    python benchmarks/first_request.py --backend mlx --quantize 4 --sizes 0,8 --rounds 3 \
        --out benchmarks/results/first_request_mlx_q4.json   # the demo target, 4-bit by mlx_lm.convert

``--target DIR`` / ``--draft DIR`` run the command on a checkpoint brought from elsewhere (default: the
embedded pair). ``--quantize BITS`` (MLX) first quantizes the target with ``mlx_lm.convert`` (group size
``--group-size``) into a temporary directory -- the demo target when no ``--target`` is given -- and runs
the demo drafter (or ``--draft``) over it: on MLX, greedy ``--compare-ar`` compares against mlx-lm's own
plain generation (``generate_step``) of that same quantized model, so the speed-up is against mlx-lm.

Every run is a new process doing exactly what the README's first command does (load the
embedded pair, warm up, one speculative generation, then AR for comparison) with one block-size
setting: auto (the default) or a fixed size. The settings alternate within each round, so a
noisy shared machine hits them alike. Reported per setting: the median speculative and AR decode
tok/s and their median ratio (the speed-up printed at the end of the command), the mean
acceptance, the mean block auto chose, whether every run was lossless, and auto's ratio to the
best fixed size -- cold, since each process serves exactly one request. The summary line each
run printed is kept (``lines``): the README quotes one of them, and
``tests/test_readme_figures.py`` checks that the quoted line is in this file.

Writes ``benchmarks/results/first_request.json`` (``--out``) through ``record.write_result`` (commit, date,
machine, command).
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
OUT = ROOT / "benchmarks" / "results" / "first_request.json"


def one_run(block_size: int, backend: str, extra: list[str]) -> dict:
    """One fresh `kakeya generate --compare-ar --json` process; its JSON result and summary line."""
    from kakeya.app.options import summary_line

    cmd = [sys.executable, "-m", "kakeya.app.main", "generate", "--compare-ar", "--json", "--backend", backend]
    cmd += ["--block-size", str(block_size)] if block_size else []
    res = subprocess.run(cmd + extra, capture_output=True, text=True, timeout=900, cwd=ROOT)
    if res.returncode:
        raise RuntimeError(f"{' '.join(cmd + extra)} failed:\n{res.stderr[-2000:]}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    out["summary_line"] = summary_line(out)
    return out


def quote_in_readme(rs: list[dict], readme: Path = ROOT / "README.md") -> str:
    """Replace the Quick start's quoted first-run line by the line of the run with the median speed-up."""
    ranked = sorted(rs, key=lambda o: o["decode_tok_s"] / o["ar_decode_tok_s"])
    line = ranked[len(ranked) // 2]["summary_line"]
    text = readme.read_text(encoding="utf-8")
    start = text.index("## Quick start")
    end = text.index("\n## ", start + 1)
    quick = text[start:end].splitlines(keepends=True)
    quick = [line + "\n" if ln.startswith("speculative (") else ln for ln in quick]
    readme.write_text(text[:start] + "".join(quick) + text[end:], encoding="utf-8")
    return line


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="torch", choices=["torch", "mlx"])
    ap.add_argument("--sizes", default="0,4,8,16", help="block sizes to compare (0: auto, the default)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--target", type=Path, help="target checkpoint directory (default: the embedded pair)")
    ap.add_argument("--draft", type=Path, help="drafter checkpoint directory (default: the embedded pair)")
    ap.add_argument("--quantize", type=int, choices=[4, 8], help="MLX: quantize the target with mlx_lm.convert first")
    ap.add_argument("--group-size", type=int, default=64, help="--quantize's group size (mlx_lm.convert's default)")
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more `kakeya generate` arguments")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument(
        "--readme",
        action="store_true",
        help="then quote, in README.md's Quick start, the line of the auto run with the median speed-up "
        "(tests/test_readme_figures.py checks the quote is a printed line)",
    )
    args = ap.parse_args(argv)
    if args.quantize and args.backend != "mlx":
        ap.error("--quantize: mlx_lm.convert's quantized weights are read by the MLX backend only (--backend mlx)")
    with tempfile.TemporaryDirectory() as tmp:
        return _measure(args, _model_flags(args, Path(tmp)))


def _model_flags(args, tmp: Path) -> list[str]:
    """``--target`` / ``--draft`` for every run; with ``--quantize`` the target is mlx_lm.convert's output."""
    target, draft = args.target, args.draft
    if args.quantize:
        import importlib

        from kakeya.checkpoints.tiny import demo_pair

        demo = demo_pair()
        target, draft = target or demo.target, draft or demo.draft
        out = tmp / f"q{args.quantize}"
        importlib.import_module("mlx_lm.convert").convert(
            str(target), str(out), quantize=True, q_bits=args.quantize, q_group_size=args.group_size
        )
        args.quantized_from = str(target)
        target = out
    flags = ["--target", str(target)] if target else []
    return flags + (["--draft", str(draft)] if draft else [])


def _measure(args, model_flags: list[str]) -> int:
    extra = model_flags + args.extra
    sizes = [int(s) for s in args.sizes.split(",")]
    runs: dict[int, list[dict]] = {s: [] for s in sizes}
    for r in range(args.rounds):
        for s in sizes if r % 2 == 0 else sizes[::-1]:
            out = one_run(s, args.backend, extra)
            runs[s].append(out)
            print(
                f"round {r + 1}/{args.rounds} block {s or 'auto'}: {out['summary_line']}", file=sys.stderr, flush=True
            )

    def summary(rs: list[dict]) -> dict:
        sizes_used = [b for o in rs for b in o["block_sizes"]]
        return {
            "median_decode_tok_s": round(statistics.median(o["decode_tok_s"] for o in rs), 1),
            "median_ar_decode_tok_s": round(statistics.median(o["ar_decode_tok_s"] for o in rs), 1),
            "median_speedup": round(statistics.median(o["decode_tok_s"] / o["ar_decode_tok_s"] for o in rs), 3),
            "speedups": [round(o["decode_tok_s"] / o["ar_decode_tok_s"], 3) for o in rs],
            # torch: transformers' own greedy generate on the same weights, the baseline that shares no code
            **(
                {
                    "median_speedup_over_hf": round(statistics.median(o["speedup_over_hf"] for o in rs), 3),
                    "hf_identical": all(o["hf_identical"] for o in rs),
                }
                if all(o.get("speedup_over_hf") for o in rs)
                else {}
            ),
            "mean_acceptance": round(statistics.mean(o["mean_acceptance"] for o in rs), 3),
            "mean_block_size": round(statistics.mean(sizes_used), 2) if sizes_used else 0,
            "lossless": all(o.get("lossless", False) for o in rs),
            "degenerate": any(o["quality"]["degenerate"] for o in rs),
            "lines": [o["summary_line"] for o in rs],
        }

    result = {
        "benchmark": "first_request",
        "command": "kakeya generate --compare-ar" + "".join(f" {a}" for a in args.extra),
        "backend": args.backend,
        "machine": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "rounds": args.rounds,
        "quantized": {
            "bits": args.quantize,
            "group_size": args.group_size,
            "from": getattr(args, "quantized_from", None),
            "tool": "mlx_lm.convert",
        }
        if args.quantize
        else None,
        "draft": str(args.draft) if args.draft else ("demo" if args.quantize else "embedded"),
        "settings": {("auto" if s == 0 else str(s)): summary(rs) for s, rs in runs.items()},
    }
    fixed = {k: v for k, v in result["settings"].items() if k != "auto"}
    if "auto" in result["settings"] and fixed:
        best = max(fixed, key=lambda k: fixed[k]["median_decode_tok_s"])
        result["best_fixed"] = int(best)
        result["auto_vs_best_fixed"] = round(
            result["settings"]["auto"]["median_decode_tok_s"] / fixed[best]["median_decode_tok_s"], 3
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, result)
    print(
        json.dumps(
            {k: {kk: vv for kk, vv in v.items() if kk != "lines"} for k, v in result["settings"].items()}, indent=1
        )
    )
    if args.readme:
        quote_in_readme(runs[0] if 0 in runs else next(iter(runs.values())))
    for k in ("best_fixed", "auto_vs_best_fixed"):
        if k in result:
            print(k, result[k])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
