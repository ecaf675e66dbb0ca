"""What the bounded verifier cache costs in recall: ``kakeya niah`` on the recall pair, policy by policy.

    python benchmarks/niah_recall.py --pairs DIR [DIR ...] [--contexts 64 128 256] [--depths 0 0.25 0.5 0.75 0.9 1]
        [--out benchmarks/results/niah_recall.json] [--plot PNG]

Each DIR holds a pair, ``target/`` and ``draft/``, and optionally its f_theta, ``ftheta/`` (meant for a
target that recalls: a Gemma-4-shaped one, sliding and full layers, and one whose every layer slides;
docs/ftheta.md, "A target that recalls", says why none ships yet). For each, runs ``run_niah``
(``orchestrator/niah.py``: needle in stdlib-docstring haystack, question at the end, greedy
speculative decoding through the MLX engine) over contexts x depths under ``native``, ``sink-window``
at two windows (half and a quarter of the model's), each with ``+kv8`` / ``+kv4`` (quantized
full-layer K/V) and ``+restore`` (f_theta; the half window only: the quarter's band is wider than
f_theta's trained split). Reports per policy: recall, recall as a share of native's, recall by
context, recall of the needles in the band between the policy's window and the model's own (where
only restoration can bring a needle back on the all-sliding target), and the largest KV bytes a
session held (sliding ring + exact full layers + the restore latent ring). Writes the JSON through
``record.py`` and, with matplotlib, a plot of recall against KV bytes per session.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: record.py, the results' one writer
from record import write_result

ROOT = Path(__file__).resolve().parents[1]


def policies_for(window: int, sink: int, restore: str | None) -> dict:
    from kakeya.orchestrator.niah import parse_policy

    half, quarter = window // 2, window // 4
    names = {"native": ("native", half)}
    for w, tag in ((half, ""), (quarter, f"@{quarter}")):
        for mod in ("", "+kv8", "+kv4"):
            names[f"sink-window{mod}{tag}"] = (f"sink-window{mod}", w)
    if restore:
        names["sink-window+restore"] = ("sink-window+restore", half)
        names["sink-window+kv8+restore"] = ("sink-window+kv8+restore", half)
    return {k: parse_policy(name, sink, w, restore) for k, (name, w) in names.items()}


def run_target(pair: Path, contexts, depths, sink: int) -> dict:
    from kakeya.orchestrator.assembly import build_local_engine, set_torch_threads
    from kakeya.orchestrator.niah import run_niah

    set_torch_threads(1, "cpu", embedded=False, backend="mlx")
    name = pair.name
    target, draft, ftheta = pair / "target", pair / "draft", pair / "ftheta"
    if not (target / "config.json").is_file() or not (draft / "config.json").is_file():
        raise SystemExit(f"--pairs: {pair} needs target/ and draft/ checkpoint directories")
    engine = build_local_engine(str(target), str(draft), "mlx")
    window = engine.verifier.info.sliding_window
    policies = policies_for(window, sink, str(ftheta) if ftheta.is_dir() else None)
    t0 = time.time()
    log = lambda m: print(f"{name}: {m}", file=sys.stderr, flush=True)
    table = run_niah(engine, contexts, depths, policies, max_tokens=8, block_size=8, seed=0, log=log)
    native = table["native"]["recall"]
    for key, row in table.items():
        pol = policies[key]
        w = pol.resolve(window).window if pol.kind != "native" else window
        band = [c for c in row["cases"] if c["needle_distance"] and w < c["needle_distance"] <= window]
        row["window"] = w
        row["recall_share_of_native"] = None if not native else round(row["recall"] / native, 4)
        row["band"] = {
            "between": [w, window],
            "cases": len(band),
            "recall": None if not band else round(sum(c["recalled"] for c in band) / len(band), 4),
        }
        row["kv_bytes_per_session"] = sum(row["max_kv_bytes"].values())
    return {"target": str(target), "model_window": window, "seconds": round(time.time() - t0, 1)} | {"policies": table}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(result["targets"]), figsize=(6 * len(result["targets"]), 4.5), squeeze=False)
    for ax, (name, res) in zip(axes[0], result["targets"].items()):
        for key, row in res["policies"].items():
            ax.scatter(row["kv_bytes_per_session"] / 1024, row["recall"], label=key)
        ax.set_xscale("log")
        ax.set_xlabel("KV KiB per session (largest context)")
        ax.set_ylabel("needle recall")
        ax.set_ylim(-0.05, 1.05)
        ax.set_title(f"{name} (window {res['model_window']})")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", nargs="+", required=True, help="directories with target/, draft/ and ftheta/")
    ap.add_argument("--contexts", type=int, nargs="+", default=[96, 128, 256])
    ap.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 0.9, 1.0])
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "niah_recall.json"))
    ap.add_argument("--plot", default=str(ROOT / "benchmarks" / "results" / "niah_recall.png"))
    args = ap.parse_args()
    result = {
        "contexts": args.contexts,
        "depths": args.depths,
        "sink": args.sink,
        "max_tokens": 8,
        "block_size": 8,
        "targets": {Path(p).name: run_target(Path(p), args.contexts, args.depths, args.sink) for p in args.pairs},
    }
    write_result(args.out, result)
    try:
        plot(result, Path(args.plot))
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
    for name, res in result["targets"].items():
        for key, row in res["policies"].items():
            band = row["band"]
            print(
                f"{name}  {key:<28} recall {row['recall']:.2f}  share {row['recall_share_of_native']}  "
                f"band {band['between']} {band['recall']} ({band['cases']})  KV {row['kv_bytes_per_session']}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
