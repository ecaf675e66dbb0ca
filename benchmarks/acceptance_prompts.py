"""How precise is a drafter's held-out acceptance, and how much lower is it than on the target's own training text?

    python benchmarks/acceptance_prompts.py                          # the embedded demo pair
    python benchmarks/acceptance_prompts.py --pair first=/tmp/oldpair/services/models/demo
                                                                     # ... and another pair beside it

The model card measures acceptance on 32 held-out prompts (``drafter_eval``). This runs the same
measurement -- the real loop, greedy, the drafter alone (n-gram copies off), 128 new tokens after a
<bos> and 63 tokens -- on ``--prompts`` evenly spaced windows of two token streams of the target's
corpus (``training/data.py``: the stdlib split by file):

- ``heldout``: files the target never trained on (the card's source);
- ``train``: the target's training files, where its drafter's training prompts come from.

Per pair, split and block size: tokens committed per block pooled over every block (the card's count),
and a 90 % interval from resampling the prompts (2,000 bootstrap draws, seed 0); per prompt the blocks and
tokens, so any other statistic can be drawn from the file. A pair is ``NAME=DIR`` with ``DIR/target`` and
``DIR/draft``; an earlier embedded pair comes out of git, e.g. ``git archive 0ad0dc9^ services/models/demo |
tar -x -C /tmp/oldpair`` (the first demo pair: a 6-layer target, a 5-layer drafter).
Writes ``benchmarks/results/acceptance_prompts.json``.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "acceptance_prompts.json"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from draft_sources import _shown  # a checkpoint directory as results name it

from kakeya.training.drafter_eval import (  # the card's own measurement and count
    block_counts,
    bootstrap_interval,
    greedy_runs,
    heldout_prompts,
    pooled,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: record.py, the results' one writer
from record import write_result


def run_pair(name: str, target: Path, draft: Path, args) -> dict:
    from kakeya.training import data
    from kakeya.training.drafter_eval import _engine

    corpus = data.load_corpus(data.target_tokenizer(target))
    engine = _engine(target, draft, "torch")
    row = {"target": _shown(target), "draft": _shown(draft), "splits": {}}
    for split in args.splits:
        stream = corpus.heldout if split == "heldout" else corpus.train
        prompts = heldout_prompts(corpus, args.prompts, args.prompt_len, stream)
        per_size = row["splits"][split] = {}
        for b in args.block_sizes:
            print(f"{name}: {split} prompts, block {b} ...", file=sys.stderr, flush=True)
            per = block_counts(greedy_runs(engine, prompts, b, args.max_tokens))
            lo, hi = bootstrap_interval(per)
            lo32, hi32 = bootstrap_interval(per, size=32)
            per_size[str(b)] = {
                "tokens_per_block": round(pooled(per), 3),
                "interval_90": [round(lo, 3), round(hi, 3)],
                "interval_90_of_32_prompts": [round(lo32, 3), round(hi32, 3)],
                "blocks": sum(n for n, _ in per),
                "per_prompt": per,
            }
            print(f"  {per_size[str(b)]['tokens_per_block']} [{lo:.3f}, {hi:.3f}]", file=sys.stderr, flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--pair",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="another pair (DIR/target, DIR/draft), measured after the embedded one (repeatable)",
    )
    ap.add_argument("--prompts", type=int, default=128, help="prompts per split (the card uses 32 held-out ones)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--splits", nargs="+", default=["heldout", "train"], choices=["heldout", "train"])
    ap.add_argument("--no-embedded", action="store_true", help="measure the --pair pairs only")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)

    from kakeya.checkpoints.tiny import embedded_pair

    shipped = embedded_pair()
    pairs = [] if args.no_embedded else [("shipped", Path(shipped.target), Path(shipped.draft))]
    for spec in args.pair:
        name, sep, where = spec.partition("=")
        if not sep or not name:
            ap.error(f"--pair wants NAME=DIR, got {spec!r}")
        pairs.append((name, Path(where) / "target", Path(where) / "draft"))
    if not pairs:
        ap.error("--no-embedded needs at least one --pair")
    res = {
        "benchmark": "acceptance_prompts",
        "command": "python benchmarks/acceptance_prompts.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine()},
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "prompts_per_split": args.prompts,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "notes": "tokens_per_block: committed tokens per block pooled over every block (the card's count), the drafter "
        "alone (n-gram copies off), torch CPU, greedy; interval_90: bootstrap over prompts; "
        "interval_90_of_32_prompts: the same over 32 prompts drawn from these (how far a 32-prompt figure, the "
        "card's, may land); "
        "per_prompt: [blocks, tokens] per prompt",
        "pairs": {name: run_pair(name, t, d, args) for name, t, d in pairs},
    }
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_result(path, res)
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
