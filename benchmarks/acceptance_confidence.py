"""Tokens per block against how sure the target is of its own next tokens: what bounds the demo drafter?

    python benchmarks/acceptance_confidence.py [--prompts 32] [--block-size 8]

Greedy, torch CPU, the demo pair, the model card's held-out prompts (``drafter_eval.heldout_prompts``, 128
new tokens), the drafter alone (n-gram copies off: the card's figure). Each generation is then read back
through transformers' ``Gemma4ForCausalLM`` (an independent implementation of the same checkpoint), which
gives the target's probability of each token it chose: its confidence there. Every block is binned by the
target's mean confidence over the ``B - 1`` positions the block's candidates stand in, and by its
confidence at the first of them; per bin: the share of blocks and the tokens they committed. A check: the
transformers argmax equals the engine's token at every position.

Greedy acceptance does not change if the target's logits are scaled (the argmax stays), so confidence
is not a knob: it shows where the target's continuation is predictable enough for a drafter to follow.
Writes ``benchmarks/results/acceptance_confidence.json``.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: record.py, the results' one writer
from record import write_result

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "acceptance_confidence.json"
MEAN_BINS = (0.0, 0.5, 0.7, 0.85, 0.95, 1.0)
FIRST_BINS = (0.0, 0.5, 0.7, 0.9, 1.0)


def _bins(values: np.ndarray, lengths: np.ndarray, edges) -> list[dict]:
    out = []
    for k, (lo, hi) in enumerate(itertools.pairwise(edges)):
        inside = (values >= lo) & ((values < hi) if k < len(edges) - 2 else (values <= hi))
        out.append(
            {
                "confidence": [lo, hi],
                "share_of_blocks": round(float(inside.mean()), 4) if values.size else 0.0,
                "blocks": int(inside.sum()),
                "tokens_per_block": round(float(lengths[inside].mean()), 3) if inside.any() else None,
            }
        )
    return out


def measure(pair, prompts: list[list[int]], block_size: int, max_tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from kakeya.core.request import Request
    from kakeya.orchestrator.assembly import build_local_engine, set_torch_threads

    set_torch_threads(1, "cpu", embedded=True)
    engine = build_local_engine(str(pair.target), str(pair.draft), "torch", "cpu", ngram=False)
    reference = AutoModelForCausalLM.from_pretrained(str(pair.target), dtype=torch.float32).eval()
    mean_conf, first_conf, lengths = [], [], []
    agree = total = 0
    for prompt in prompts:
        gen = engine.generate(Request(prompt, max_tokens=max_tokens, block_size=block_size, ignore_eos=True))
        seq = list(prompt) + gen.token_ids
        with torch.no_grad():
            probs = torch.softmax(reference(torch.tensor([seq])).logits[0].float(), -1)
        chosen = probs.argmax(-1)[len(prompt) - 1 : -1].tolist()  # what the target picks for each generated token
        agree += sum(a == b for a, b in zip(chosen, gen.token_ids))
        total += len(gen.token_ids)
        confidence = probs.max(-1).values.numpy()  # [t]: how sure the target is of the token at t + 1
        opening = len(prompt)  # where the block's opening token (the last committed one) stands
        for block in gen.blocks[1:]:
            span = confidence[opening : opening + block_size - 1]  # the candidates' positions
            if span.size == block_size - 1:  # blocks cut by max_tokens have no full span: left out
                mean_conf.append(float(span.mean()))
                first_conf.append(float(span[0]))
                lengths.append(len(block.tokens))
            opening += len(block.tokens)
    mean_conf, first_conf, lengths = np.array(mean_conf), np.array(first_conf), np.array(lengths)
    return {
        "block_size": block_size,
        "blocks": int(lengths.size),
        "tokens_per_block": round(float(lengths.mean()), 4),
        "reference_argmax_agrees": round(agree / max(1, total), 4),
        "median_mean_confidence": round(float(np.median(mean_conf)), 4),
        "by_mean_confidence": _bins(mean_conf, lengths, MEAN_BINS),
        "by_first_confidence": _bins(first_conf, lengths, FIRST_BINS),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32, help="held-out prompts (the card's: 32)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--target", help="another pair's target directory (default: the embedded demo pair)")
    ap.add_argument("--draft", help="... and its drafter directory")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    if bool(args.target) != bool(args.draft):
        ap.error("--target and --draft go together")

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from draft_sources import card_setup  # the card's held-out prompts and a result's header

    pair, _, prompts, header = card_setup("acceptance_confidence", argv, args)
    res = header | {
        "notes": "confidence: the target's probability of the token it chose (transformers' forward over the "
        "generation); a block's mean confidence is over the B - 1 positions its candidates stand in; "
        "tokens_per_block: tokens the block committed (the drafter alone, greedy)",
        "result": measure(pair, prompts, args.block_size, args.max_tokens),
    }
    write_result(args.out, res)
    r = res["result"]
    print(
        f"block {r['block_size']}: {r['tokens_per_block']:.2f} tokens per block over {r['blocks']} blocks; "
        + ", ".join(
            f"mean confidence {b['confidence'][0]}-{b['confidence'][1]}: {b['share_of_blocks']:.0%} of blocks, "
            f"{b['tokens_per_block']}"
            for b in r["by_mean_confidence"]
        )
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
