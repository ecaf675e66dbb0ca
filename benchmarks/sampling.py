"""Speculative sampling by rule: acceptance and tok/s of the coupled rule beside the rejection rule.

    python benchmarks/sampling.py                         # the demo pair, T 0.7 and 1.0, block 8 and auto
    python benchmarks/sampling.py --backend mlx --temperatures 0.7 --block-sizes 8 --repeats 9

For each temperature and block size (0: auto), both rules over ``--repeats``
seeded generations of ``--max-tokens`` tokens (EOS ignored) after a warm-up,
the rules alternating seed by seed so that a loaded machine slows both alike;
and AR sampling (block size 1) under each rule as the speed reference. A
rejection-rule request for auto runs at the drafter's trained block size
(its tokens depend on the schedule), which the rows say. Acceptance is tokens
committed per block (the accepted candidates plus the bonus token).

It also measures what the documentation quotes about the coupled rule:
the cross-backend mismatch rate (how often torch's or MLX's noisy argmax picks
another token than the numpy reference on the same float32 logits, rows of
``--vocab`` tokens: the backends' float32 ``log`` differs by an ulp or so), and
the sampler's own cost per block at that vocabulary on this machine. Writes
benchmarks/results/sampling.json.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kakeya.app.options import DEFAULT_PROMPT
from kakeya.core import noise
from kakeya.core.request import SAMPLING_RULES, Request, SamplingParams
from kakeya.orchestrator.assembly import build_local_engine, set_torch_threads
from tests.sampling import reference  # the numpy reference the backends are held to

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: record.py, the results' one writer
from record import write_result


def measure(engine, prompt_ids, max_tokens, block_size, params, repeats) -> dict:
    """{rule: {acceptance, tok/s, block sizes}} over seeds 0..repeats-1, the rules alternating per seed."""

    def request(rule, seed):
        sampling = SamplingParams(params.temperature, params.top_k, params.top_p, params.min_p, seed, rule)
        return Request(prompt_ids, max_tokens=max_tokens, block_size=block_size, ignore_eos=True, sampling=sampling)

    for rule in SAMPLING_RULES:
        engine.generate(request(rule, 10_000))  # warm-up
    gens = {rule: [] for rule in SAMPLING_RULES}
    for seed in range(repeats):
        for rule in SAMPLING_RULES:
            gens[rule].append(engine.generate(request(rule, seed)))
    out = {}
    for rule, runs in gens.items():
        sizes = [b.drafted + 1 for g in runs for b in g.blocks[1:]]
        out[rule] = {
            "decode_tok_s_median": round(statistics.median(g.decode_tok_s for g in runs), 2),
            "mean_acceptance": round(statistics.mean(g.mean_acceptance for g in runs), 3) if block_size != 1 else 1.0,
            "mean_block_size": round(statistics.mean(sizes), 2) if sizes else 1.0,
            "tokens": sum(len(g.token_ids) for g in runs),
        }
    return out


def cross_backend(rows: int, vocab: int, temperatures) -> dict:
    """The noisy argmax per backend vs the numpy reference on the same float32 logits: the mismatches seen,
    and the rows whose two best noisy scores lie closer than twice the largest noise difference between
    the backends (the only rows where one could occur: an upper bound on the rate)."""
    import mlx.core as mx
    import torch

    from kakeya.backends.mlx import sampling as sampling_mlx
    from kakeya.backends.torch import sampling as sampling_torch

    g = noise.gumbel(noise.session_keys(7), 0, 4, vocab)
    diff = {
        "torch": float(np.abs(sampling_torch.gumbel(noise.session_keys(7), 0, 4, vocab, "cpu").numpy() - g).max()),
        "mlx": float(np.abs(np.array(sampling_mlx.gumbel(noise.session_keys(7), 0, 4, vocab)) - g).max()),
    }
    rng = np.random.default_rng(0)
    out = {
        "rows": 0,
        "vocab": vocab,
        "mismatches": {"torch": 0, "mlx": 0},
        "noise_max_abs_diff": diff,
        "rows_at_risk": 0,
    }
    chunk = 8
    for t in temperatures:
        params = SamplingParams(t, seed=1)
        for start in range(0, rows, chunk):
            keys = noise.session_keys(start)
            x = (rng.standard_normal((chunk, vocab)) * 4).astype(np.float32)  # LM-like spread: a few dominant tokens
            want = reference.coupled(x, params, keys, start)
            got_t = sampling_torch.coupled_rows(torch.from_numpy(x), params, keys, start)
            got_m = sampling_mlx.coupled_rows(mx.array(x), params, keys, start)
            out["mismatches"]["torch"] += sum(a != b for a, b in zip(got_t, want))
            out["mismatches"]["mlx"] += sum(a != b for a, b in zip(got_m, want))
            score = x * np.float32(reference.inverse_temperature(params)) + noise.gumbel(keys, start, chunk, vocab)
            top2 = np.sort(score, axis=-1)[:, -2:]
            out["rows_at_risk"] += int((top2[:, 1] - top2[:, 0] < 2 * max(diff.values())).sum())
            out["rows"] += chunk
    return out


def model_agreement(engines: dict, prompt_ids, max_tokens: int, temperatures, seeds: int) -> dict:
    """Seeded AR sampling (block 1) on each backend's target: how many sequences come out identical, and
    the tokens generated before the first difference where one does not (float32 logits differ by rounding)."""
    out = {"sequences": 0, "identical": 0, "tokens_compared": 0, "first_differences": []}
    for t in temperatures:
        for seed in range(seeds):
            req = Request(
                prompt_ids, max_tokens=max_tokens, block_size=1, ignore_eos=True, sampling=SamplingParams(t, seed=seed)
            )
            a, b = (e.generate(req).token_ids for e in engines.values())
            same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            out["sequences"] += 1
            out["identical"] += same is None
            out["tokens_compared"] += len(a) if same is None else same + 1
            if same is not None:
                out["first_differences"].append(same)
    return out


def sampler_cost(vocab: int, block: int = 16, repeats: int = 7) -> dict:
    """Milliseconds of one verify's sampling step on torch, CPU, for [block, vocab] logits (best of ``repeats``)."""
    import torch

    from kakeya.backends.torch import sampling as s

    x = torch.randn(block, vocab) * 4
    keys, params = noise.session_keys(1), SamplingParams(0.7, seed=1)
    ids, probs = reference.proposal_rows(
        reference.process(np.random.default_rng(0).normal(0, 4, (block - 1, 64)), params)
    )
    cands, proposal = reference.draw_from_proposal(ids, probs, np.full(block - 1, 0.5))
    u = np.full(block, 0.5)

    def best(fn):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return round(1000 * min(times), 3)

    return {
        "vocab": vocab,
        "block": block,
        "coupled_ms": best(lambda: s.coupled_rows(x, params, keys, 100)),
        "coupled_top_p_ms": best(lambda: s.coupled_rows(x, SamplingParams(0.7, top_p=0.95, seed=1), keys, 100)),
        "rejection_ms": best(lambda: s.verify_rows(x, cands, proposal, params, u[:-1], u)),
    }


def _rel(path: str) -> str:
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", help="default: the embedded demo pair")
    ap.add_argument("--draft")
    ap.add_argument("--backend", default="auto", choices=["auto", "mlx", "torch"])
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[8, 0], help="0: auto")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0])
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--mismatch-rows", type=int, default=256, help="rows per temperature for the cross-backend rate (0: skip)"
    )
    ap.add_argument(
        "--agreement-seeds",
        type=int,
        default=10,
        help="seeds per temperature of AR sampling on both backends' targets (0: skip)",
    )
    ap.add_argument("--vocab", type=int, default=262_144, help="vocabulary of those rows and of the sampler timing")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/sampling.json"))
    args = ap.parse_args(argv)

    engine = build_local_engine(args.target, args.draft, args.backend)
    if engine.verifier.info.backend == "torch":
        set_torch_threads(None, engine.device, embedded=args.target is None)
    prompt_ids = engine.codec.encode(args.prompt)
    rows = []
    for t in args.temperatures:
        params = SamplingParams(t, top_p=args.top_p).check()
        ar = measure(engine, prompt_ids, args.max_tokens, 1, params, args.repeats)
        for block_size in args.block_sizes:
            spec = measure(engine, prompt_ids, args.max_tokens, block_size, params, args.repeats)
            row = {"temperature": t, "top_p": args.top_p, "block_size": block_size, "ar": ar, **spec}
            c, r = spec["coupled"], spec["rejection"]
            row["coupled_vs_rejection"] = {
                "acceptance": round(c["mean_acceptance"] / r["mean_acceptance"], 3),
                "accepted_candidates": round((c["mean_acceptance"] - 1) / (r["mean_acceptance"] - 1), 3)
                if r["mean_acceptance"] > 1
                else None,
                "tok_s": round(c["decode_tok_s_median"] / r["decode_tok_s_median"], 3),
            }
            rows.append(row)
            print(
                f"T {t:g}, block {block_size or 'auto'}: coupled {c['mean_acceptance']:.2f} tokens/block "
                f"{c['decode_tok_s_median']:.0f} tok/s; rejection {r['mean_acceptance']:.2f} tokens/block "
                f"(blocks of {r['mean_block_size']:.1f}) {r['decode_tok_s_median']:.0f} tok/s; AR sampling "
                f"{ar['coupled']['decode_tok_s_median']:.0f} tok/s",
                file=sys.stderr,
                flush=True,
            )
    result = {
        "benchmark": "sampling",
        "target": _rel(engine.target),
        "draft": _rel(engine.draft),
        "backend": engine.verifier.info.backend,
        "device": engine.device,
        "prompt_tokens": len(prompt_ids),
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "note": "mean_acceptance: tokens committed per block (accepted candidates + the bonus); block_size 0: auto "
        "(a rejection-rule request for auto runs at the drafter's trained block size); ar: block size 1. "
        "The coupled rule's tokens equal AR sampling's with the same seed; the rejection rule's are "
        "distributed alike but depend on the drafter and the schedule",
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "python": platform.python_version(),
        },
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rows": rows,
    }
    if args.mismatch_rows:
        result["cross_backend"] = cross_backend(args.mismatch_rows, args.vocab, args.temperatures)
        result["sampler_cost"] = sampler_cost(args.vocab)
        print(f"cross-backend: {result['cross_backend']}; sampler cost {result['sampler_cost']}", file=sys.stderr)
    if args.agreement_seeds:
        engines = {be: build_local_engine(args.target, args.draft, be) for be in ("torch", "mlx")}
        result["model_agreement"] = model_agreement(
            engines, prompt_ids, args.max_tokens, args.temperatures, args.agreement_seeds
        )
        print(f"torch vs MLX targets: {result['model_agreement']}", file=sys.stderr)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, result)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
