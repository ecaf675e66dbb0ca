"""Would a second drafter pass draft better blocks? Iterative refinement, measured before building it.

    python benchmarks/draft_refine.py                                  # the embedded demo drafter
    python benchmarks/draft_refine.py --draft shipped=services/models/demo/draft --draft reveal=DIR

A DFlash drafter predicts a block's positions all at once, each from masks: position k does not see what
the drafter put at 1 .. k-1. Block-diffusion decoders refine instead: a second pass with the first pass's
likeliest tokens shown in place of masks. This prices that on the target's greedy continuations of held-out
files (teacher-forced, replayed as the loop walks them, the count ``drafter_eval`` and the model card use;
``tests/training/test_demo_pair.py`` checks that replay against the real engine), three ways per drafter:

- ``one_pass``: the drafter as the engine runs it;
- ``two_pass``: a second forward with the first pass's leading run of candidates whose probability is at
  least ``--confidence`` shown (at least one, at most B - 2), the rest of the block re-predicted;
- ``oracle_prefix``: the second pass shown the TARGET's tokens up to the first pass's first miss (what no
  engine knows): how much a drafter gains from seeing a block's earlier tokens at all.

A shown token is a shape the drafter meets only if it was trained with ``train-drafter --predraft-share``
(a pre-draft's block: tokens after the anchor that the context does not cover), so pass such a drafter
beside the shipped one. The second pass costs one more drafter forward a block: the file prices that with
``benchmarks/results/pair_cost.json`` (draft and verify against an AR step), so the gain it must beat is
written beside the gain it has. Writes ``benchmarks/results/draft_refine.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "draft_refine.json"
DEMO = ROOT / "services" / "models" / "demo"
sys.path.insert(0, str(ROOT / "benchmarks"))

from draft_sources import _shown  # a checkpoint directory as results name it

from kakeya.training.drafter_eval import replay

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: record.py, the results' one writer
from record import write_result


def leading(pred: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """Right candidates before the first wrong one, per row."""
    return np.cumprod(pred == truth, axis=-1).sum(-1)


def refined(
    trainer, seq: np.ndarray, aux: np.ndarray, anchors: np.ndarray, B: int, shown: np.ndarray, n_shown: np.ndarray
) -> np.ndarray:
    """The second pass's argmax [K, B-1] for one sequence: block ``i`` after ``anchors[i]`` with its first
    ``n_shown[i]`` positions holding ``shown[i]`` instead of masks (``block_logits``' reveal: the tokens are
    read from the sequence, so each block gets its own copy of it with those tokens written in)."""
    K = len(anchors)
    rows = np.repeat(seq[None], K, 0)
    for i, a in enumerate(anchors):
        rows[i, a + 1 : a + B] = shown[i]
    logits, _ = trainer.block_logits(rows, np.repeat(aux[None], K, 0), anchors[:, None], B, reveal=n_shown[:, None])
    return logits.argmax(-1).cpu().numpy()


def leading_by_way(trainer, seqs: np.ndarray, aux, prompt_len: int, B: int, confidence: float) -> dict:
    """Leading right candidates [N, anchors] for each way of drafting, at every anchor after the prompt
    (``one_pass`` is ``drafter_eval.leading_right``'s count, which the card replays)."""
    torch = trainer.torch
    anchors = np.arange(prompt_len, seqs.shape[1] - B + 1)
    ways = {w: [] for w in ("one_pass", "two_pass", "oracle_prefix")}
    trainer.model.eval()
    with torch.no_grad():
        for n in range(len(seqs)):
            seq, ax = np.asarray(seqs[n]), np.asarray(aux[n], dtype=np.float32)
            logits, labels = trainer.block_logits(seq[None], ax[None], anchors[None], B)
            prob, first = torch.softmax(logits, -1).max(-1)
            first, prob, labels = first.cpu().numpy(), prob.cpu().numpy(), labels.cpu().numpy()
            lead = leading(first, labels)
            ways["one_pass"].append(lead)
            sure = np.cumprod(prob >= confidence, axis=-1).sum(-1)
            k = np.clip(sure, 1, B - 2)
            second = refined(trainer, seq, ax, anchors, B, first, k)
            keep = np.arange(B - 1)[None] < k[:, None]
            ways["two_pass"].append(leading(np.where(keep, first, second), labels))
            k = np.minimum(lead, B - 2)  # the target's own tokens up to the first miss
            second = refined(trainer, seq, ax, anchors, B, labels, k)
            keep = np.arange(B - 1)[None] < k[:, None]
            ways["oracle_prefix"].append(leading(np.where(keep, labels, second), labels))
            print(f"  sequence {n + 1}/{len(seqs)}", file=sys.stderr, end="\r", flush=True)
    print(file=sys.stderr)
    return {w: np.stack(rows) for w, rows in ways.items()}


def measure(trainer, seqs: np.ndarray, aux, prompt_len: int, B: int, confidence: float) -> dict:
    """Tokens per block as the loop commits them, for each way of drafting."""
    out = {}
    for w, lead in leading_by_way(trainer, seqs, aux, prompt_len, B, confidence).items():
        lengths = [t for row in lead for t in replay(row)]
        out[w] = {"tokens_per_block": round(float(np.mean(lengths)), 4), "blocks": len(lengths)}
    return out


def continuations(target: Path, n: int, prompt_len: int, gen_len: int, tids, seed: int, cache: Path):
    """The target's greedy continuations of ``n`` held-out prompts and their aux, as ``train-drafter``'s
    held-out curve makes them (``<bos>`` first), cached under ``cache`` by what made them."""
    import torch

    from kakeya.training import data
    from kakeya.training.block_trainer import TorchTarget, cached_continuations, make_dataset

    corpus = data.load_corpus(data.target_tokenizer(target))
    key = {
        "target": str(target.resolve()),
        "prompt_len": prompt_len,
        "gen_len": gen_len,
        "tids": list(tids),
        "seed": seed,
        "bos": True,
        "n_seq": n,
        "split": "heldout",
    }
    made, _ = cached_continuations(
        cache, key,
        lambda out: make_dataset(TorchTarget(target, torch.device("cpu")), corpus.heldout, n, prompt_len, gen_len,
                                 tids, seed, n, False, True, out=out), quiet=False)  # fmt: skip
    return np.asarray(made.seqs), made.aux


def second_pass_price(block_size: int) -> dict | None:
    """What a second drafter forward must buy to pay, from ``pair_cost.json``: a block costs draft + verify
    (in AR steps), a second pass adds a draft, so acceptance must rise by draft / (draft + verify)."""
    f = ROOT / "benchmarks" / "results" / "pair_cost.json"
    if not f.is_file():
        return None
    out = {}
    for name, b in json.loads(f.read_text())["backends"].items():
        d, v = b["draft_over_ar"].get(str(block_size)), b["verify_over_ar"].get(str(block_size))
        if d is not None and v is not None:
            out[name] = {"draft_over_ar": d, "verify_over_ar": v, "break_even_gain": round(d / (d + v), 4)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", type=Path, default=DEMO / "target")
    p.add_argument(
        "--draft",
        action="append",
        default=None,
        metavar="NAME=DIR",
        help="a drafter of the target (repeatable; default: shipped=the embedded demo drafter)",
    )
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument(
        "--sequences", type=int, default=64, help="held-out continuations (as train-drafter's held-out curve)"
    )
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--confidence", type=float, default=0.5, help="two_pass shows the first pass's leading run at least this likely"
    )
    p.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "kakeya-draft-refine")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    if args.block_size < 3:
        p.error("--block-size must be >= 3 (a second pass shows 1 .. B-2 tokens)")
    drafts = dict(d.split("=", 1) for d in (args.draft or [f"shipped={DEMO / 'draft'}"]))

    import torch

    from kakeya.training.block_trainer import BlockTrainer

    torch.set_num_threads(1)
    tids = None
    rows = {}
    for name, d in drafts.items():
        cfg = json.loads((Path(d) / "config.json").read_text())
        if tids is None:
            tids = cfg["dflash_config"]["target_layer_ids"]
            seqs, aux = continuations(
                args.target, args.sequences, args.prompt_len, args.gen_len, tids, args.seed, args.cache
            )
        elif cfg["dflash_config"]["target_layer_ids"] != tids:
            p.error(f"--draft {name}: reads target layers {cfg['dflash_config']['target_layer_ids']}, the first {tids}")
        trainer = BlockTrainer(cfg, args.target, 0, torch.device("cpu"))
        trainer.load_weights(Path(d))
        print(f"{name}: {args.sequences} held-out continuations, block {args.block_size} ...", file=sys.stderr)
        got = measure(trainer, seqs, aux, args.prompt_len, args.block_size, args.confidence)
        base = got["one_pass"]["tokens_per_block"]
        for w in ("two_pass", "oracle_prefix"):
            got[w]["over_one_pass"] = round(got[w]["tokens_per_block"] / base, 4)
        rows[name] = {"draft": _shown(Path(d))} | got
        print(f"{name}: " + ", ".join(f"{w} {r['tokens_per_block']:.3f}" for w, r in got.items()), file=sys.stderr)
    result = {
        "benchmark": "draft_refine",
        "command": "python benchmarks/draft_refine.py " + " ".join(sys.argv[1:]),
        "target": _shown(args.target),
        "block_size": args.block_size,
        "sequences": args.sequences,
        "prompt_len": args.prompt_len,
        "gen_len": args.gen_len,
        "seed": args.seed,
        "confidence": args.confidence,
        "note": "tokens per block as the loop commits them (replayed on the target's greedy continuations of "
        "held-out files); over_one_pass: against the same drafter's one pass; second_pass_price: the "
        "acceptance gain a second drafter forward must beat, per backend",
        "drafters": rows,
        "second_pass_price": second_pass_price(args.block_size),
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, result)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
