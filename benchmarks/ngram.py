"""N-gram copies on and off, side by side: what drafting repeats by copy (``orchestrator/proposers.py``) is worth.

    python benchmarks/ngram.py [--backends torch mlx] [--prompts 12] [--max-tokens 128] [--rounds 2]

For each backend, loads the embedded demo pair once and decodes README command 1's prompt and
``--prompts`` held-out code prompts (the suite's) at block sizes 4, 8, 16 and auto, with the
n-gram copies on and off, interleaved (on/off alternate, the order flips every round) so machine
noise falls on both alike; AR (block 1) runs in the same rounds. Reports per setting the median
decode tok/s over the held-out prompts, the mean tokens committed per block, the share of blocks
drafted by copy, README command 1's prompt on its own, the ratios on/off, and that every run
committed AR's tokens. Writes ``benchmarks/results/ngram.json``.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: record.py, the results' one writer
from record import write_result

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIZES = (4, 8, 16, 0)


def run_backend(backend: str, prompts: list[list[int]], max_tokens: int, rounds: int) -> dict:
    from kakeya.core.request import Request
    from kakeya.orchestrator.assembly import build_local_engine, set_torch_threads
    from kakeya.orchestrator.decode.engine import RunOptions

    if backend == "torch":
        set_torch_threads(1, "cpu", embedded=True)
    engine = build_local_engine(None, None, backend, "cpu" if backend == "torch" else None)
    engine.generate(Request(prompts[0], max_tokens=16, block_size=0, ignore_eos=True))  # warm-up + calibration
    settings = [(1, False)] + [(b, on) for b in SIZES for on in (True, False)]
    runs: dict = {s: [[] for _ in prompts] for s in settings}
    reference: dict[int, list[int]] = {}
    identical = True
    for r in range(rounds):
        for i, prompt in enumerate(prompts):
            order = settings if (r + i) % 2 == 0 else settings[::-1]
            for b, on in order:
                g = engine.generate(
                    Request(prompt, max_tokens=max_tokens, block_size=b, ignore_eos=True), RunOptions(ngram=on)
                )
                identical &= reference.setdefault(i, g.token_ids) == g.token_ids
                blocks = g.blocks[1:]
                runs[(b, on)][i].append(
                    (g.decode_tok_s, g.mean_acceptance, sum(x.copied for x in blocks) / max(1, len(blocks)))
                )
        print(f"{backend}: round {r + 1}/{rounds} done", file=sys.stderr, flush=True)

    def summary(rows) -> dict:
        per_prompt = [statistics.median(x[0] for x in row) for row in rows]
        return {
            "median_tok_s": round(statistics.median(per_prompt), 1),
            "mean_acceptance": round(statistics.mean(x[1] for row in rows for x in row), 3),
            "copied_share": round(statistics.mean(x[2] for row in rows for x in row), 3),
        }

    out: dict = {"held_out": {}, "readme_prompt": {}}
    for (b, on), rows in runs.items():
        name = "ar" if b == 1 else f"{'auto' if b == 0 else b}_{'on' if on else 'off'}"
        out["held_out"][name] = summary(rows[1:])
        out["readme_prompt"][name] = summary(rows[:1])
    for part in ("held_out", "readme_prompt"):
        res = out[part]
        ar = res["ar"]["median_tok_s"]
        for b in SIZES:
            key = "auto" if b == 0 else str(b)
            on, off = res[f"{key}_on"], res[f"{key}_off"]
            on["vs_off"] = round(on["median_tok_s"] / off["median_tok_s"], 3)
            on["vs_ar"], off["vs_ar"] = round(on["median_tok_s"] / ar, 3), round(off["median_tok_s"] / ar, 3)
    out["all_outputs_identical_to_ar"] = identical
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", nargs="+", default=["torch", "mlx"], choices=["torch", "mlx"])
    p.add_argument("--prompts", type=int, default=12, help="held-out code prompts (besides README command 1's)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "ngram.json"))
    args = p.parse_args()

    from kakeya.app.options import DEFAULT_PROMPT
    from kakeya.checkpoints.tiny import embedded_pair
    from kakeya.orchestrator.text import TextCodec

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from suite import held_out_prompts  # the suite's held-out code prompts (stdlib files the pair never saw)

    pair = embedded_pair()
    prompts = [TextCodec(pair.target).encode(DEFAULT_PROMPT), *held_out_prompts(args.prompts, 64)]
    res = {
        "benchmark": "ngram",
        "command": "python benchmarks/ngram.py " + " ".join(sys.argv[1:]),
        "pair": {"target": str(Path(pair.target).relative_to(ROOT)), "draft": str(Path(pair.draft).relative_to(ROOT))},
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine()},
        "prompts": {"readme_prompt": 1, "held_out": args.prompts, "max_tokens": args.max_tokens, "rounds": args.rounds},
        "backends": {b: run_backend(b, prompts, args.max_tokens, args.rounds) for b in args.backends},
    }
    write_result(args.out, res)
    for b, r in res["backends"].items():
        h = r["held_out"]
        print(
            f"{b}: held-out "
            + ", ".join(
                f"{k} {h[f'{k}_on']['vs_off']:.2f}x off ({h[f'{k}_on']['vs_ar']:.2f}x AR)"
                for k in ("4", "8", "16", "auto")
            )
            + f"; identical {r['all_outputs_identical_to_ar']}"
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
