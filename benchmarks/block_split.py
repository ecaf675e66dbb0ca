"""Per-block time split of the colocated engine: draft forward, verify forward, the rest.

"The rest" (accept/trim, the drafter's aux hand-off, loop bookkeeping) is the
engine's own overhead; it should be a small fraction of a block.

    python benchmarks/block_split.py                      # embedded default pair
    python benchmarks/block_split.py --target T --draft D --block-sizes 4 8 16

Writes benchmarks/results/block_split.json. Medians over repeated runs after a
warm-up run; everything measured side by side in one process.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kakeya.orchestrator.assembly import build_local_engine
from kakeya.orchestrator.decode.engine import Request

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: record.py, the results' one writer
from record import write_result


def measure(engine, prompt_ids, max_tokens, block_size, repeats):
    req = Request(prompt_ids, max_tokens=max_tokens, block_size=block_size, ignore_eos=True)
    engine.generate(req)  # warm-up: compiles kernels, sizes buffers
    per_block = {"draft_s": [], "verify_s": [], "rest_s": [], "total_s": []}
    tok_s, accept = [], []
    for _ in range(repeats):
        gen = engine.generate(req)
        for b in gen.blocks[1:]:  # blocks[0] is the prefill token
            per_block["draft_s"].append(b.draft_s)
            per_block["verify_s"].append(b.verify_s)
            per_block["rest_s"].append(b.total_s - b.draft_s - b.verify_s)
            per_block["total_s"].append(b.total_s)
        tok_s.append(gen.decode_tok_s)
        accept.append(gen.mean_acceptance)
    med = {k: statistics.median(v) for k, v in per_block.items()}
    return {
        "block_size": block_size,
        "blocks_measured": len(per_block["total_s"]),
        "median_ms": {k: round(v * 1e3, 4) for k, v in med.items()},
        "rest_fraction_of_block": round(med["rest_s"] / med["total_s"], 4),
        "decode_tok_s_median": round(statistics.median(tok_s), 2),
        "mean_acceptance": round(statistics.mean(accept), 3),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--prompt", default="import os\nimport sys\n\ndef main(argv):\n    ")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/block_split.json"))
    args = ap.parse_args(argv)

    engine = build_local_engine(args.target, args.draft)
    prompt_ids = engine.codec.encode(args.prompt)
    rows = []
    for b in args.block_sizes:
        print(f"block size {b} ...", file=sys.stderr, flush=True)
        rows.append(measure(engine, prompt_ids, args.max_tokens, b, args.repeats))
        r = rows[-1]["median_ms"]
        print(
            f"  draft {r['draft_s']:.3f} ms  verify {r['verify_s']:.3f} ms  rest {r['rest_s']:.3f} ms "
            f"({rows[-1]['rest_fraction_of_block']:.1%} of a block)",
            file=sys.stderr,
        )
    result = {
        "benchmark": "block_split",
        "target": engine.target,
        "draft": engine.draft,
        "backend": engine.verifier.info.backend,
        "prompt_tokens": len(prompt_ids),
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "python": platform.python_version(),
        },
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, result)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
