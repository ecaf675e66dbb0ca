"""Adaptive block size against every fixed block size, side by side in one run.

    python benchmarks/adaptive.py [--backends torch mlx] [--prompts 6] [--max-tokens 128] [--rounds 3]
    python benchmarks/adaptive.py --backends torch --device cuda --out benchmarks/results/adaptive_cuda.json

For each backend, loads the embedded demo pair once and decodes each held-out
prompt with ``block_size`` = 2, 4, 8, 16 and 0 (auto), in an interleaved order
repeated ``--rounds`` times, so machine noise falls on every setting alike.
Reports the median decode tok/s per setting, auto's ratio to the best fixed
size, the sizes auto chose, and that every run produced the same tokens.
Writes ``benchmarks/results/adaptive.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: record.py, the results' one writer
from record import write_result

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FIXED = (2, 4, 8, 16)


def run_backend(backend: str, prompts: list[list[int]], max_tokens: int, rounds: int, device: str = "cpu") -> dict:
    from kakeya.core.request import Request
    from kakeya.orchestrator.assembly import build_local_engine, set_torch_threads

    if backend == "torch" and device == "cpu":
        set_torch_threads(1, "cpu", embedded=True)
    engine = build_local_engine(None, None, backend, device if backend == "torch" else None)
    engine.generate(Request(prompts[0], max_tokens=16, block_size=0, ignore_eos=True))  # warm-up + calibration
    settings = [*FIXED, 0]
    tok_s: dict[int, list[float]] = {b: [] for b in settings}
    tokens: dict[tuple[int, int], list[int]] = {}
    chosen: list[int] = []
    for r in range(rounds):
        for i, prompt in enumerate(prompts):
            order = settings if (r + i) % 2 == 0 else settings[::-1]
            for b in order:
                g = engine.generate(Request(prompt, max_tokens=max_tokens, block_size=b, ignore_eos=True))
                tok_s[b].append(g.decode_tok_s)
                if b == 0:
                    chosen += [blk.drafted + 1 for blk in g.blocks[1:]]
                key = (i, b)
                assert tokens.setdefault(key, g.token_ids) == g.token_ids
        print(f"{backend}: round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
    identical = all(tokens[(i, b)] == tokens[(i, FIXED[0])] for i in range(len(prompts)) for b in settings)
    med = {b: statistics.median(v) for b, v in tok_s.items()}
    best = max(FIXED, key=lambda b: med[b])
    return {
        "median_decode_tok_s": {("auto" if b == 0 else str(b)): round(v, 1) for b, v in med.items()},
        "best_fixed": best,
        "auto_vs_best_fixed": round(med[0] / med[best], 3),
        "auto_sizes": {str(s): chosen.count(s) for s in sorted(set(chosen))},
        "auto_mean_size": round(sum(chosen) / len(chosen), 2) if chosen else 0,
        "cost_curve_ms": {str(k): round(v * 1e3, 3) for k, v in sorted(engine.adaptive.costs.seconds.items())},
        "all_outputs_identical": identical,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", nargs="+", default=["torch", "mlx"], choices=["torch", "mlx"])
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cpu", help="torch's device (cuda: the CUDA-graph path)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "adaptive.json"))
    args = p.parse_args()

    from kakeya.checkpoints.tiny import embedded_pair

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from suite import held_out_prompts  # the suite's held-out code prompts (stdlib files the pair never saw)

    pair = embedded_pair()
    prompts = held_out_prompts(args.prompts, 48)
    out = {
        "command": " ".join(sys.argv),
        "machine": platform.platform(),
        "pair": str(pair.target.parent),
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "device": args.device,
        "backends": {b: run_backend(b, prompts, args.max_tokens, args.rounds, args.device) for b in args.backends},
    }
    write_result(args.out, out)
    print(json.dumps(out["backends"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
