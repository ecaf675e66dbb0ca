"""Constrained decoding's speed: grammar-aware vs grammar-blind drafting vs unconstrained, demo pair, block 8.

    python benchmarks/structured.py [--rounds 2] [--max-tokens 96] [--backend torch]

For a few JSON schemas and regexes (``tests/constrained/cases.py``) and two prompts, decodes each with the
constraint and grammar-aware drafting (the grammar's forced tokens drafted without the drafter, the
drafter's candidates chosen among its likeliest ids the grammar allows, ``orchestrator/proposers.py``), with the constraint and grammar-blind drafting (``RunOptions(guided=False)``:
the drafter guesses every candidate, the verifier's masks still decide), and without a constraint for the
same number of tokens (``ignore_eos``); settings interleaved, the order flipping every round. Reports per
case the mean tokens committed per block (the prefill's token excluded), the median decode tok/s, the share
of blocks the grammar forced, the host time spent on grammar masks per generated token, and that guided and
blind committed the same tokens; and how many grammar compiles the compiled-grammar cache saved. Goals (issue 43): guided >= 1.5x blind tokens/block; constrained >= 0.8x
the unconstrained tok/s. Writes ``benchmarks/results/structured.json``.
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

CASES = ("person", "nested", "list", "object", "phone", "date")


class MaskClock:
    """Host seconds spent in ``Grammar.bitmask`` (the verifier's per-block masks, packed: the backends expand them
    on the device), wrapped around the method."""

    def __init__(self):
        from kakeya.core import constraints

        self.seconds = 0.0
        exact = constraints.Grammar.bitmask

        def timed(grammar, candidates):
            t0 = time.perf_counter()
            try:
                return exact(grammar, candidates)
            finally:
                self.seconds += time.perf_counter() - t0

        constraints.Grammar.bitmask = timed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "structured.json"))
    args = ap.parse_args(argv)

    from kakeya.core.constraints import COMPILED
    from kakeya.core.request import Request
    from kakeya.orchestrator.assembly import build_local_engine, set_torch_threads
    from kakeya.orchestrator.decode.engine import RunOptions
    from tests.constrained.cases import PROMPTS, constraints

    device = "cpu" if args.backend == "torch" else None
    if args.backend == "torch":
        set_torch_threads(1, "cpu", embedded=True)
    engine = build_local_engine(None, None, args.backend, device)
    clock = MaskClock()
    cs = constraints()
    prompts = [engine.codec.encode(p) for p in PROMPTS]
    engine.generate(Request(prompts[0], max_tokens=16, block_size=8, ignore_eos=True))  # warm-up
    rows: dict = {n: {"guided": [], "blind": [], "free": []} for n in CASES}
    identical = True
    for r in range(args.rounds):
        for i, prompt in enumerate(prompts):
            for name in CASES if (r + i) % 2 == 0 else CASES[::-1]:
                req = Request(prompt, max_tokens=args.max_tokens, block_size=8, constraint=cs[name])
                got = {}
                for setting in ("guided", "blind") if (r + i) % 2 == 0 else ("blind", "guided"):
                    before = clock.seconds
                    g = engine.generate(req, RunOptions(guided=setting == "guided"))
                    got[setting] = g
                    blocks = g.blocks[1:]
                    rows[name][setting].append(
                        {
                            "tokens": len(g.token_ids),
                            "blocks": len(blocks),
                            "tokens_per_block": (len(g.token_ids) - 1) / max(1, len(blocks)),
                            "tok_s": g.decode_tok_s,
                            "decode_s": g.decode_s,
                            "forced_share": sum(b.forced for b in blocks) / max(1, len(blocks)),
                            "mask_us_per_token": (clock.seconds - before) / max(1, len(g.token_ids)) * 1e6,
                        }
                    )
                identical &= got["guided"].token_ids == got["blind"].token_ids
                n = len(got["guided"].token_ids)
                f = engine.generate(Request(prompt, max_tokens=n, block_size=8, ignore_eos=True))
                blocks = f.blocks[1:]
                rows[name]["free"].append(
                    {
                        "tokens": n,
                        "tokens_per_block": (n - 1) / max(1, len(blocks)),
                        "tok_s": f.decode_tok_s,
                        "decode_s": f.decode_s,
                    }
                )
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)

    def summary(runs: list[dict]) -> dict:
        out = {"tokens_per_block": round(statistics.mean(x["tokens_per_block"] for x in runs), 3)}
        out["median_tok_s"] = round(statistics.median(x["tok_s"] for x in runs), 1)
        out["mean_tokens"] = round(statistics.mean(x["tokens"] for x in runs), 1)
        for key in ("forced_share", "mask_us_per_token"):
            if key in runs[0]:
                out[key] = round(statistics.mean(x[key] for x in runs), 3)
        return out

    def pooled(rows: dict, setting: str) -> float:
        """Tokens per block over all cases' runs together (the prefill's token and block excluded)."""
        runs = [x for name in CASES for x in rows[name][setting]]
        return sum(x["tokens"] - 1 for x in runs) / max(1, sum(x["blocks"] for x in runs))

    def pooled_tok_s(rows: dict, setting: str) -> float:
        """Decode tok/s over all cases' runs together: every decoded token over every second of decoding."""
        runs = [x for name in CASES for x in rows[name][setting]]
        return sum(x["tokens"] - 1 for x in runs) / max(1e-9, sum(x["decode_s"] for x in runs))

    cases = {}
    for name in CASES:
        s = {k: summary(v) for k, v in rows[name].items()}
        s["guided_over_blind_tokens_per_block"] = round(
            s["guided"]["tokens_per_block"] / s["blind"]["tokens_per_block"], 3
        )
        s["guided_over_free_tok_s"] = round(s["guided"]["median_tok_s"] / s["free"]["median_tok_s"], 3)
        cases[name] = s
    result = {
        "what": "demo pair, block 8: constrained with grammar-aware drafting (guided), grammar-blind, unconstrained",
        "backend": args.backend,
        "device": engine.device or "",
        "machine": platform.machine(),
        "rounds": args.rounds,
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "guided_and_blind_identical": identical,
        # every constrained generation's grammar compiles (check, verifier, guide): compiled vs taken from the cache
        "grammar_compiles": {"compiled": COMPILED.misses, "cached": COMPILED.hits},
        "cases": cases,
        "median_guided_over_blind_tokens_per_block": statistics.median(
            c["guided_over_blind_tokens_per_block"] for c in cases.values()
        ),
        "median_guided_over_free_tok_s": statistics.median(c["guided_over_free_tok_s"] for c in cases.values()),
        # every case's tokens over every case's blocks: a 3-token answer weighs what it holds, not a sixth
        "all_cases_guided_over_blind_tokens_per_block": round(pooled(rows, "guided") / pooled(rows, "blind"), 3),
        "all_cases_guided_over_free_tok_s": round(pooled_tok_s(rows, "guided") / pooled_tok_s(rows, "free"), 3),
        "by_kind": {
            kind: {
                "cases": names,
                "median_guided_over_blind_tokens_per_block": statistics.median(
                    cases[n]["guided_over_blind_tokens_per_block"] for n in names
                ),
                "median_guided_over_free_tok_s": statistics.median(cases[n]["guided_over_free_tok_s"] for n in names),
            }
            for kind in ("json_schema", "json_object", "regex")
            if (names := [n for n in CASES if cs[n].kind == kind])
        },
        "goals": {"guided_over_blind_tokens_per_block": 1.5, "guided_over_free_tok_s": 0.8},
    }
    write_result(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k.startswith(("median", "all_cases", "guided_and"))}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
