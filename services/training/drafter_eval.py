"""How well a drafter drafts: held-out acceptance, replayed from teacher-forced candidates and measured with the real engine."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kakeya.checkpoints import tokenizer as tk
from kakeya.core.request import SamplingParams
from kakeya.orchestrator.assembly import build_local_engine
from kakeya.orchestrator.decode.engine import Request
from kakeya.training import common, data
from kakeya.training.block_trainer import BlockTrainer


def replay(leading: np.ndarray) -> list[int]:
    """Tokens each block commits when the loop walks a sequence whose anchor ``i`` (``i``-th position
    after the prompt) has ``leading[i]`` right candidates: a block commits ``1 + leading[i]``."""
    out, i = [], 0
    while i < len(leading):
        out.append(1 + int(leading[i]))
        i += out[-1]
    return out


def leading_right(
    trainer: BlockTrainer, seqs: np.ndarray, aux: np.ndarray, prompt_len: int, B: int, batch: int = 4
) -> tuple[np.ndarray, np.ndarray, float]:
    """Teacher-forced blocks at EVERY anchor ``prompt_len .. T-B`` of each sequence: ``leading`` [N, anchors]
    (right candidates before the first wrong one), ``right`` [N * anchors, B-1] and the mean cross-entropy.
    Labels are the target's greedy tokens and the context its aux of them, what the engine sees, so the
    candidates at anchor ``a`` are the ones the loop would draft there."""
    torch = trainer.torch
    anchors = np.arange(prompt_len, seqs.shape[1] - B + 1)
    ce_sum, n, leading, right = 0.0, 0, [], []
    was_training = trainer.model.training
    trainer.model.eval()
    with torch.no_grad():
        for i in range(0, len(seqs), batch):
            s = seqs[i : i + batch]
            anc = np.broadcast_to(anchors, (len(s), len(anchors)))
            logits, labels = trainer.block_logits(s, aux[i : i + batch].astype(np.float32), anc, B)
            ce_sum += float(
                torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum"
                )
            )
            n += labels.numel()
            ok = (logits.argmax(-1) == labels).cpu().numpy().reshape(len(s), len(anchors), B - 1)
            right.append(ok.reshape(-1, B - 1))
            leading.append(np.cumprod(ok, axis=2).sum(2))
    trainer.model.train(was_training)
    return np.concatenate(leading), np.concatenate(right), ce_sum / n


def evaluate(trainer: BlockTrainer, seqs: np.ndarray, aux: np.ndarray, prompt_len: int, B: int) -> dict:
    """Held-out figures at block size ``B``: ``acceptance`` replays the loop on each sequence
    (:func:`replay`), tokens per block as the engine counts them; ``acceptance_uniform_anchors`` (1 +
    mean right run over all anchors) overstates it, a long accepted run being one block but many anchors."""
    lead, right, ce = leading_right(trainer, seqs, aux, prompt_len, B)
    lengths = [n for row in lead for n in replay(row)]
    return {
        "block_size": B,
        "loss": round(ce, 5),
        "acc_per_position": [round(float(x), 4) for x in right.mean(0)],
        "acceptance": round(float(np.mean(lengths)), 4),
        "acceptance_uniform_anchors": round(1.0 + float(lead.mean()), 4),
        "blocks": len(lengths),
        "sequences": len(seqs),
    }


def heldout_prompts(corpus: data.Corpus, n: int, length: int, stream=None) -> list[list[int]]:
    """``n`` held-out prompts of ``length`` tokens, evenly spaced over the held-out files, each starting with <bos>
    (``stream``: over that token stream instead, e.g. ``corpus.train``)."""
    win = data.fixed_windows(corpus.heldout if stream is None else stream, n, length - 1)
    return [[tk.BOS_ID] + [int(t) for t in w] for w in win]


def _engine(target_dir: Path, draft_dir: Path, backend: str):
    """The real loop (``backend`` verifier + drafter, native cache), measuring the drafter's own acceptance:
    without n-gram copies (``orchestrator/proposers.py``)."""
    return build_local_engine(str(target_dir), str(draft_dir), backend, ngram=False)


def pooled(per_prompt: list[tuple[int, int]]) -> float:
    """Tokens per block over every block of every prompt: ``per_prompt`` holds (blocks, tokens)."""
    blocks = sum(b for b, _ in per_prompt)
    return sum(t for _, t in per_prompt) / blocks if blocks else 0.0


def bootstrap_interval(
    per_prompt: list[tuple[int, int]], draws: int = 2000, level: float = 0.9, seed: int = 0, size: int | None = None
) -> tuple[float, float]:
    """The central ``level`` interval of :func:`pooled` over ``size`` prompts (default: as many as there are)
    drawn with replacement: with ``size`` 32, how far a 32-prompt measurement like the card's may land."""
    arr = np.asarray(per_prompt, dtype=np.float64)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(arr), size=(draws, size or len(arr)))
    sums = arr[picks].sum(axis=1)  # [draws, 2]: blocks, tokens
    stats = np.sort(sums[:, 1] / sums[:, 0])
    lo, hi = (1 - level) / 2, 1 - (1 - level) / 2
    return float(stats[int(lo * (draws - 1))]), float(stats[round(hi * (draws - 1))])


def greedy_runs(engine, prompts: list[list[int]], block_size: int, max_tokens: int) -> list:
    """One greedy generation per prompt at ``block_size`` (n-gram copies as ``engine`` has them)."""
    return [engine.generate(Request(p, max_tokens=max_tokens, block_size=block_size, ignore_eos=True)) for p in prompts]


def block_counts(gens) -> list[tuple[int, int]]:
    """(blocks, tokens committed) per generation: what :func:`pooled` and :func:`bootstrap_interval` take."""
    return [(len(g.acceptance_lengths), int(sum(g.acceptance_lengths))) for g in gens]


def measure_acceptance(engine, prompts: list[list[int]], block_sizes: Sequence[int], max_tokens: int) -> dict:
    """Mean acceptance per block size, greedy, each run checked against block size 1 (``engine``: :func:`_engine`'s)."""
    out: dict = {}
    ref = [g.token_ids for g in greedy_runs(engine, prompts, 1, max_tokens)]
    for B in block_sizes:
        t0 = time.time()
        gens = greedy_runs(engine, prompts, B, max_tokens)
        lengths = [n for g in gens for n in g.acceptance_lengths]
        lossless = all(g.token_ids == r for g, r in zip(gens, ref))
        out[str(B)] = {
            "mean_acceptance": round(float(np.mean(lengths)), 4),
            # over prompts: how precise the figure is
            "interval_90": [round(x, 3) for x in bootstrap_interval(block_counts(gens))],
            "blocks": len(lengths),
            "histogram": np.bincount(lengths, minlength=B + 1)[1:].tolist(),
            "lossless_vs_block1": bool(lossless),
            "wall_s": round(time.time() - t0, 2),
        }
    return out


def measure_sampled(
    engine, prompts: list[list[int]], temperatures: Sequence[float], block_sizes: Sequence[int], max_tokens: int
) -> dict:
    """Mean acceptance of seeded sampled requests (the coupled rule, the default; prompt ``i`` with seed ``i``)
    per temperature and block size; each run checked against AR sampling with the same seed, which the coupled
    rule must reproduce token for token (``engine``: :func:`_engine`'s)."""
    out: dict = {}
    for T in temperatures:

        def request(i, p, B, T=T):
            return Request(
                p, max_tokens=max_tokens, block_size=B, ignore_eos=True, sampling=SamplingParams(temperature=T, seed=i)
            )

        ref = [engine.generate(request(i, p, 1)).token_ids for i, p in enumerate(prompts)]
        row = out[f"{T:g}"] = {}
        for B in block_sizes:
            lengths, lossless = [], True
            for i, p in enumerate(prompts):
                g = engine.generate(request(i, p, B))
                lengths += g.acceptance_lengths
                lossless &= g.token_ids == ref[i]
            row[str(B)] = {
                "mean_acceptance": round(float(np.mean(lengths)), 4),
                "blocks": len(lengths),
                "lossless_vs_ar_sampling": bool(lossless),
            }
    return out


def acceptance_record(
    target_dir: Path,
    draft_dir: Path,
    prompts: list[list[int]],
    prompt_len: int,
    block_sizes: Sequence[int],
    max_tokens: int,
    backend: str,
    temperatures: Sequence[float] = (),
    sampled_block_sizes: Sequence[int] = (8, 16),
) -> dict:
    """The ``acceptance`` block of a drafter's ``report.json`` (what its model card's tables show):
    :func:`measure_acceptance` with the prompts' provenance, and :func:`measure_sampled` at ``temperatures``."""
    engine = _engine(target_dir, draft_dir, backend)  # one load for both measurements
    rec = {
        "prompts": len(prompts),
        "prompt_len": prompt_len,
        "max_tokens": max_tokens,
        "source": "held-out stdlib files (split by file), evenly spaced windows, <bos> prepended",
        "engine": f"kakeya.orchestrator.decode.loop, {backend} verifier (native cache) + drafter, greedy",
        "per_block_size": measure_acceptance(engine, prompts, block_sizes, max_tokens),
    }
    if temperatures:
        rec["sampled"] = {
            "rule": "coupled (the default), prompt i with seed i",
            "per_temperature": measure_sampled(engine, prompts, temperatures, sampled_block_sizes, max_tokens),
        }
    return rec


def floats(text: str) -> tuple[float, ...]:
    """``"0.7,1.0"`` -> (0.7, 1.0); ``""`` -> ()."""
    return tuple(float(x) for x in text.split(",") if x.strip())


def ints(text: str) -> tuple[int, ...]:
    """``"8,16"`` -> (8, 16)."""
    return tuple(int(x) for x in text.split(",") if x.strip())


def main(argv=None) -> int:
    """Measure a drafter directory's acceptance the way ``train-drafter``'s report does, on this machine's
    held-out prompts: to compare a drafter trained elsewhere (another Python's standard library draws
    other prompts) with the shipped one, side by side."""
    ap = argparse.ArgumentParser(prog="python -m kakeya.training.drafter_eval", description=main.__doc__)
    ap.add_argument("target", help="target checkpoint directory")
    ap.add_argument("drafts", nargs="+", help="drafter checkpoint directories, measured one after the other")
    ap.add_argument("--prompts", type=int, default=32, help="held-out prompts (the card's: 32)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--block-sizes", default="2,4,8,16")
    ap.add_argument("--backend", default="torch", choices=["auto", "mlx", "torch"])
    ap.add_argument(
        "--temperatures",
        default="0.7,1.0",
        help="sampled acceptance too, at these temperatures (coupled rule, prompt i with seed i; '': greedy only)",
    )
    ap.add_argument("--sampled-block-sizes", default="8,16")
    ap.add_argument(
        "--record",
        action="store_true",
        help="also write each measurement into that drafter's report.json as its `acceptance` (the model"
        " card's table), as train-drafter does when it measures: for a drafter trained elsewhere",
    )
    args = ap.parse_args(argv)
    corpus = data.load_corpus(data.target_tokenizer(Path(args.target)))
    prompts = heldout_prompts(corpus, args.prompts, args.prompt_len)
    measure = (prompts, args.prompt_len, ints(args.block_sizes), args.max_tokens, args.backend)
    measure += (floats(args.temperatures), ints(args.sampled_block_sizes))
    for draft in args.drafts:
        print(f"measuring {draft} on {len(prompts)} held-out prompts ...", file=sys.stderr, flush=True)
        rec = acceptance_record(Path(args.target), Path(draft), *measure)
        per, per_t = rec["per_block_size"], rec.get("sampled", {}).get("per_temperature", {})
        if args.record:
            report = Path(draft) / "report.json"
            if not report.is_file():
                raise SystemExit(f"--record: {report} does not exist (the trainer writes it)")
            common.write_json(report, json.loads(report.read_text()) | {"acceptance": rec})
        lossless = all(v["lossless_vs_block1"] for v in per.values()) and all(
            v["lossless_vs_ar_sampling"] for row in per_t.values() for v in row.values()
        )
        means = {b: v["mean_acceptance"] for b, v in per.items()}
        sampled = {T: {b: v["mean_acceptance"] for b, v in row.items()} for T, row in per_t.items()}
        line = {"draft": draft, "mean_acceptance": means, "sampled_mean_acceptance": sampled, "lossless": lossless}
        print(json.dumps(line))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
