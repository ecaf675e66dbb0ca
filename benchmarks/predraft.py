"""What pre-drafts are worth, in tokens: their hit rate and how much the blocks that use them commit.

    python benchmarks/predraft.py [--draft DIR] [--prompts 12] [--block-sizes 4 8 16] [--alternatives 0 2]
                                  [--predraft-blocks 2 4 8 64]

Loads the demo target with a drafter (default: the embedded one) in this process (torch, CPU)
and decodes README command 1's prompt and ``--prompts`` held-out code prompts greedily at each
block size: without pre-drafting, then with pre-drafts prepared for the full acceptance alone
(``--alternatives 0``) and for a rejection at each candidate too (2: the drafter's next two
likeliest tokens there; ``serve orchestrator --predraft-alternatives``), at most
``--predraft-blocks`` blocks a pre-draft, the likeliest verdicts by the drafter's own probabilities
(each value a row of its own, as ``serve drafter --predraft-blocks`` sets it; the default cap when
not given; 1 + k(B - 1) or more prepares every verdict). N-gram copies are off,
so every block is the drafter's. Per setting: tokens committed per block over all blocks, the
hit rate (pre-drafts used / started) and the tokens per block of the blocks that used one, and
that every run committed the same tokens as the one without pre-drafts.

No timing: in one process a pre-draft runs before its block is verified, not beside it. What
a hit saves is a drafter round trip on a split block's critical path (``benchmarks/split.py
--predraft-alternatives N`` measures that); what it costs shows here: a pre-draft's context
lacks the aux of the block it follows, so the blocks that use one may commit less than fresh
drafts would. Writes ``benchmarks/results/predraft.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: record.py, the results' one writer
from record import write_result

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def measure(
    engine, prompts, block_size: int, alternatives: int | None, max_tokens: int, blocks: int | None = None
) -> dict:
    from kakeya.core.request import Request
    from kakeya.drafter import session
    from kakeya.orchestrator.decode.engine import RunOptions

    engine.drafter.predraft_blocks = blocks or session.PREDRAFT_BLOCKS  # what serve drafter --predraft-blocks sets

    lengths, used_lengths, started, outputs = [], [], 0, []
    for p in prompts:
        options = RunOptions(ngram=False, predraft=alternatives is not None, predraft_alternatives=alternatives or 0)
        g = engine.generate(Request(p, max_tokens=max_tokens, block_size=block_size, ignore_eos=True), options)
        lengths += g.acceptance_lengths
        started += g.predrafts
        used_lengths += [len(b.tokens) for b in g.blocks[1:] if b.predrafted]
        outputs.append(g.token_ids)
    return {
        "tokens_per_block": round(statistics.mean(lengths), 3),
        "blocks": len(lengths),
        "predrafts_started": started,
        "hit_rate": round(len(used_lengths) / started, 3) if started else None,
        "tokens_per_used_block": round(statistics.mean(used_lengths), 3) if used_lengths else None,
        "outputs": outputs,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None, help="default: the embedded demo pair's")
    ap.add_argument("--draft", default=None, help="default: the embedded demo pair's")
    ap.add_argument("--prompts", type=int, default=12, help="held-out code prompts (the suite's)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--alternatives", type=int, nargs="+", default=[0, 2])
    ap.add_argument(
        "--predraft-blocks",
        type=int,
        nargs="+",
        default=None,
        help="caps on the blocks one pre-draft prepares, each measured (default: the shipped cap)",
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "predraft.json"))
    args = ap.parse_args(argv)

    from suite import held_out_prompts

    from kakeya.app.options import DEFAULT_PROMPT
    from kakeya.drafter import session
    from kakeya.orchestrator.assembly import build_local_engine, embedded_paths, set_torch_threads

    target, draft = embedded_paths()
    target, draft = args.target or target, args.draft or draft
    set_torch_threads(1, "cpu", embedded=True)
    engine = build_local_engine(target, draft, "torch", "cpu")
    sets = {"readme_prompt": [engine.codec.encode(DEFAULT_PROMPT)], "held_out": held_out_prompts(args.prompts, 64)}
    results: dict = {}
    identical = True
    for name, prompts in sets.items():
        for B in args.block_sizes:
            row = {"none": measure(engine, prompts, B, None, args.max_tokens)}
            for k in args.alternatives:
                for cap in (args.predraft_blocks or [None]) if k else [None]:
                    name_k = f"alternatives_{k}" + (f"_blocks_{cap}" if cap else "")
                    row[name_k] = measure(engine, prompts, B, k, args.max_tokens, cap)
            reference = row["none"]["outputs"]
            for setting in row.values():
                identical &= setting.pop("outputs") == reference
            results.setdefault(name, {})[str(B)] = row
            print(
                f"{name} block {B}: "
                + ", ".join(
                    f"{s} {r['tokens_per_block']} (hit {r['hit_rate']}, used {r['tokens_per_used_block']})"
                    for s, r in row.items()
                ),
                file=sys.stderr,
                flush=True,
            )
    out = {
        "benchmark": "predraft",
        "target": str(target),
        "draft": str(draft),
        "backend": "torch",
        "device": "cpu",
        "prompts": {"readme_prompt": 1, "held_out": args.prompts},
        "max_tokens": args.max_tokens,
        "predraft_blocks": args.predraft_blocks or [session.PREDRAFT_BLOCKS],
        "results": results,
        "all_outputs_identical": identical,
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "notes": "Greedy, n-gram copies off. tokens_per_block: over every block of the run; hit_rate: pre-drafts used /"
        " started; tokens_per_used_block: the blocks that opened with a pre-draft. alternatives_k: each"
        " pre-draft prepared for the full acceptance and for a rejection at each candidate with each of the"
        " drafter's k next likeliest tokens there, the likeliest verdicts first, at most predraft_blocks blocks"
        " (alternatives_k_blocks_m: at most m; 1 + k(B - 1) or more: every verdict).",
    }
    write_result(args.out, out)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
