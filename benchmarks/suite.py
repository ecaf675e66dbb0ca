"""The benchmark suite: AR vs speculative decoding on one pair, side by side in one process.

    python benchmarks/suite.py                       # embedded default pair (the demo pair when shipped)
    python benchmarks/suite.py --target T --draft D --block-sizes 1 2 4 8 16 --repeats 3 --torch

Measures, on held-out code prompts (stdlib files the demo pair never trained on):

* decode tok/s -- kakeya colocated MLX at block sizes 1 (plain AR through the
  same verifier) .. 16; mlx-lm's own greedy AR (``generate_step``, native caches);
  the ``dflash`` package's MLX speculative loop (``dflash.model_mlx.stream_generate``
  on our draft directory; a FRESH target, since it wraps the layers with hooks),
  with its own embedding convention (sqrt(hidden) x input_embedding_scale) and
  with ours (raw lookup x input_embedding_scale, "Gap-B"); optionally kakeya's
  colocated torch backend;
* acceptance-length histogram per block size;
* per-block time split (draft, verify, accept/trim + hand-off);
* efficiency against the limit: speedup / (tau * t_AR / (t_draft + t_verify(B))).

Medians over ``--repeats`` runs after one warm-up run per configuration.
Writes benchmarks/results/suite.json and suite_*.png.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np

from kakeya.orchestrator.assembly import build_local_engine
from kakeya.orchestrator.decode.engine import Request

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: record.py, the results' one writer
from record import write_result

RESULTS = ROOT / "benchmarks" / "results"


def held_out_prompts(n: int, length: int) -> list[list[int]]:
    from kakeya.checkpoints import tokenizer as tk
    from kakeya.training import data
    from kakeya.training.drafter_eval import heldout_prompts

    tok = tk.train_tokenizer()
    corpus = data.load_corpus(tok, heldout_pct=5, max_bytes=1)  # held-out files only matter here
    return heldout_prompts(corpus, n, length)


def kakeya_runs(generate, prompts, max_tokens, block_size, repeats):
    """Decode rate, acceptance and per-block time split of ``generate(prompt, max_tokens, block_size)``.

    ``generate`` returns ``(Generation, calls)``: ``calls`` is None in-process, or the split run's
    per-call log (client time vs the server's own time, benchmarks/wire.py), from which the
    network's share of each block is separated out of draft/verify/commit.
    """
    tok_s, lengths, split = [], [], {"draft": [], "verify": [], "rest": [], "wire": [], "total": []}
    outputs = []
    for p in prompts:
        generate(p, max_tokens, block_size)  # warm-up
        per = []
        for _ in range(repeats):
            g, calls = generate(p, max_tokens, block_size)
            per.append(g.decode_tok_s)
            blocks = g.blocks[1:]  # blocks[0] is the prefill token
            hops = [_hops(c) for c in calls] if calls is not None else [{} for _ in blocks]
            for b, h in zip(blocks, hops):
                wire = sum(h.values())
                draft = b.draft_s - h.get("draft", 0.0)
                verify = b.verify_s - h.get("verify", 0.0)
                split["draft"].append(draft)
                split["verify"].append(verify)
                split["wire"].append(wire)
                split["rest"].append(b.total_s - draft - verify - wire)
                split["total"].append(b.total_s)
        tok_s.append(statistics.median(per))
        lengths += g.acceptance_lengths  # greedy: every repeat commits the same blocks
        outputs.append(g.token_ids)
    return {
        "decode_tok_s": round(statistics.median(tok_s), 2),
        "decode_tok_s_per_prompt": [round(x, 2) for x in tok_s],
        "mean_acceptance": round(float(np.mean(lengths)), 4),
        "acceptance_histogram": np.bincount(lengths, minlength=block_size + 1)[1:].tolist(),
        "block_ms_median": {k: round(statistics.median(v) * 1e3, 4) for k, v in split.items()},
        "block_ms_mean": {k: round(statistics.mean(v) * 1e3, 4) for k, v in split.items()},
        "blocks_timed": len(split["total"]),
    }, outputs


def _hops(calls) -> dict[str, float]:
    """Seconds each call of one block spent outside the server (serialization, loopback, gRPC)."""
    out: dict[str, float] = {}
    for c in calls:
        out[c["step"]] = out.get(c["step"], 0.0) + c["client_s"] - c["server_s"]
    return out


def colocated(engine):
    def generate(p, max_tokens, block_size):
        return engine.generate(Request(p, max_tokens=max_tokens, block_size=block_size, ignore_eos=True)), None

    return generate


def split_over_loopback(verifier, drafter):
    from benchmarks.wire import per_block, run_split

    def generate(p, max_tokens, block_size):
        g, log = run_split(verifier, drafter, p, max_tokens, block_size)
        return g, per_block(log)[1]

    return generate


def mlx_lm_ar(target_dir, prompts, max_tokens, repeats):
    from mlx_lm import load

    from kakeya.verifier.mlx_backend.reference import greedy_reference

    model, _ = load(str(target_dir))
    tok_s, outs = [], []
    for p in prompts:
        greedy_reference(model, p, max_tokens)
        per = []
        for _ in range(repeats):
            ids, _, dec = greedy_reference(model, p, max_tokens)
            per.append((len(ids) - 1) / dec)
        tok_s.append(statistics.median(per))
        outs.append(ids)
    return {"decode_tok_s": round(statistics.median(tok_s), 2)}, outs


def dflash_loop(target_dir, draft_dir, prompts, max_tokens, block_size, repeats, gap_b: bool):
    """The dflash package's own MLX loop. gap_b=True: our embedding convention (raw lookup x scale)."""
    import dflash.model_mlx as dm
    from mlx_lm import load

    dm.snapshot_download = lambda repo_id, **kw: repo_id  # a local directory, no hub
    model, tokenizer = load(str(target_dir))  # fresh: stream_generate wraps its layers
    draft = dm.load_draft(str(draft_dir))
    if gap_b:
        # its bind() sets embed_scale = target embed_scale x input_embedding_scale on every call
        orig_bind = draft.bind

        def bind(target_model):
            orig_bind(target_model)
            draft.embed_scale = draft.config.input_embedding_scale
            return draft

        draft.bind = bind
    tok_s, accepted, outs = [], [], []
    for p in prompts:

        def once(p=p):
            toks, acc, t_first, t_end = [], [], None, None
            for r in dm.stream_generate(
                model, draft, tokenizer, mx_prompt(p), block_size=block_size, max_tokens=max_tokens
            ):
                if t_first is None:
                    t_first = time.perf_counter()
                toks += r.tokens
                if r.accepted is not None:
                    acc.append(len(r.tokens))
            t_end = time.perf_counter()
            return toks, acc, (len(toks) - 1) / (t_end - t_first)

        once()
        per = []
        for _ in range(repeats):
            toks, acc, ts = once()
            per.append(ts)
        tok_s.append(statistics.median(per))
        accepted += acc
        outs.append(toks[:max_tokens])
    return {
        "decode_tok_s": round(statistics.median(tok_s), 2),
        "mean_acceptance": round(float(np.mean(accepted)), 4) if accepted else None,
    }, outs


def mx_prompt(p):
    import mlx.core as mx

    return mx.array(p)


def efficiency(res: dict) -> dict:
    """Measured speedup vs its limit tau * t_AR / (t_draft + t_verify(B)), per block size.

    ``speedup``: end-to-end decode tok/s at B over block size 1 (medians over repeats);
    ``limit``: mean acceptance x the median AR step over the median draft + verify forwards of a
    block at B -- what the loop would reach with zero bookkeeping and these forward costs.
    Medians on both sides: this CPU is shared, and a few slow blocks would skew means.
    (``*_mean`` fields: the same from mean block times over all repeats.)
    """
    out = {}
    ar = res["kakeya_mlx"].get("1")
    if not ar:
        return out
    for b, s in res["kakeya_mlx"].items():
        if b == "1":
            continue
        med, mean = s["block_ms_median"], s["block_ms_mean"]
        speedup = s["decode_tok_s"] / ar["decode_tok_s"]
        limit = s["mean_acceptance"] * ar["block_ms_median"]["total"] / (med["draft"] + med["verify"])
        sp_mean = s["mean_acceptance"] * ar["block_ms_mean"]["total"] / mean["total"]
        lim_mean = s["mean_acceptance"] * ar["block_ms_mean"]["total"] / (mean["draft"] + mean["verify"])
        out[b] = {
            "speedup": round(speedup, 4),
            "limit": round(limit, 4),
            "efficiency": round(speedup / limit, 4),
            "speedup_mean": round(sp_mean, 4),
            "limit_mean": round(lim_mean, 4),
        }
    return out


def plots(res: dict, out_prefix: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    bss = [int(b) for b in res["kakeya_mlx"]]
    spec = [res["kakeya_mlx"][str(b)] for b in bss]

    # 1. decode tok/s
    fig, ax = plt.subplots(figsize=(9, 4.2))
    x = np.arange(len(bss))
    series = [("kakeya MLX colocated (block 1 = AR)", lambda b: spec[bss.index(b)]["decode_tok_s"])]
    if res.get("kakeya_split"):
        series.append(
            (
                "kakeya MLX split over loopback gRPC",
                lambda b: res["kakeya_split"].get(str(b), {}).get("decode_tok_s", 0),
            )
        )
    if res.get("dflash"):
        series.append(
            (
                "dflash package MLX loop (Gap-B embedding)",
                lambda b: res["dflash"].get(str(b), {}).get("gap_b", {}).get("decode_tok_s", 0),
            )
        )
    if res.get("kakeya_torch"):
        series.append(
            ("kakeya torch CPU colocated", lambda b: res["kakeya_torch"].get(str(b), {}).get("decode_tok_s", 0))
        )
    w = 0.8 / len(series)
    for i, (label, val) in enumerate(series):
        ax.bar(x + (i - (len(series) - 1) / 2) * w, [val(b) for b in bss], w, label=label)
    ax.axhline(res["mlx_lm_ar"]["decode_tok_s"], color="k", ls="--", lw=1, label="mlx-lm greedy AR")
    ax.set_xticks(x, [str(b) for b in bss])
    ax.set_xlabel("block size")
    ax.set_ylabel("decode tokens / s (median)")
    ax.set_title("Decode throughput, demo pair, 2-core CPU")
    ax.legend(fontsize=8)
    fig.tight_layout()
    f = out_prefix.with_name(out_prefix.name + "_throughput.png")
    fig.savefig(f, dpi=110)
    files.append(f.name)
    plt.close(fig)

    # 2. acceptance histograms
    sb = [b for b in bss if b > 1]
    fig, axes = plt.subplots(1, len(sb), figsize=(3.2 * len(sb), 3.2), squeeze=False)
    for ax, b in zip(axes[0], sb):
        h = res["kakeya_mlx"][str(b)]["acceptance_histogram"]
        ax.bar(np.arange(1, b + 1), np.array(h) / max(1, sum(h)))
        ax.set_title(f"block {b}: mean {res['kakeya_mlx'][str(b)]['mean_acceptance']:.2f}")
        ax.set_xlabel("tokens committed per block")
    axes[0][0].set_ylabel("fraction of blocks")
    fig.tight_layout()
    f = out_prefix.with_name(out_prefix.name + "_acceptance.png")
    fig.savefig(f, dpi=110)
    files.append(f.name)
    plt.close(fig)

    # 3. time split + efficiency
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    stacks = [("colocated", spec)]
    if res.get("kakeya_split"):
        stacks.append(("split", [res["kakeya_split"][str(b)] for b in bss]))
    bw = 0.8 / len(stacks)
    colors = {"draft": "C0", "verify": "C1", "wire": "C3", "rest": "C2"}
    for i, (name, rows) in enumerate(stacks):
        bottom = np.zeros(len(bss))
        for part in ("draft", "verify", "wire", "rest"):
            h = np.array([r["block_ms_median"].get(part, 0.0) for r in rows])
            a1.bar(
                x + (i - (len(stacks) - 1) / 2) * bw,
                h,
                bw,
                bottom=bottom,
                color=colors[part],
                label=(part if part != "rest" else "accept/trim + hand-off") if i == 0 else None,
                hatch="//" if name == "split" else None,
                edgecolor="white" if name == "split" else None,
            )
            bottom += h
    a1.set_xticks(x, [str(b) for b in bss])
    a1.set_xlabel("block size")
    a1.set_ylabel("ms per block (median)")
    a1.set_title(
        "Per-block time, kakeya MLX" + (" (left: colocated; hatched: split)" if len(stacks) > 1 else ""), fontsize=10
    )
    a1.legend(fontsize=8)
    eff = res["efficiency"]
    a2.plot(sb, [eff[str(b)]["speedup"] for b in sb], "o-", label="measured speedup vs AR")
    a2.plot(sb, [eff[str(b)]["limit"] for b in sb], "s--", label="limit tau*t_AR/(t_draft+t_verify)")
    a2.axhline(1.0, color="k", lw=0.8)
    a2.set_xscale("log", base=2)
    a2.set_xticks(sb, [str(b) for b in sb])
    a2.set_xlabel("block size")
    a2.set_title("Speedup vs its limit")
    a2.legend(fontsize=8)
    fig.tight_layout()
    f = out_prefix.with_name(out_prefix.name + "_split_efficiency.png")
    fig.savefig(f, dpi=110)
    files.append(f.name)
    plt.close(fig)
    return files


def split_rows(target_dir, draft_dir, prompts, args, ref) -> dict:
    """The same loop in this process, verifier and drafter in their own ``kakeya serve`` processes."""
    import tempfile

    from benchmarks.wire import start, stop
    from kakeya.orchestrator.remote.drafter import GrpcDrafter
    from kakeya.orchestrator.remote.verifier import GrpcVerifier

    # MLX, as the colocated rows it is compared with (serve's auto would pick torch on Linux, and with a
    # --target given, torch's default thread team: three processes fighting over the cores).
    pair = ["--target", str(target_dir), "--draft", str(draft_dir), "--backend", "mlx"]
    rows, procs = {}, []
    with tempfile.TemporaryDirectory(prefix="kakeya-suite-") as tmp:
        try:
            vp, vaddr = start("verifier", pair, Path(tmp))
            procs.append(vp)
            dp, daddr = start("drafter", pair, Path(tmp))
            procs.append(dp)
            drafter = GrpcDrafter(daddr)
            gen = split_over_loopback(GrpcVerifier(vaddr, aux_layers=drafter.target_layer_ids), drafter)
            for b in args.block_sizes:
                print(f"kakeya split (loopback gRPC) block {b} ...", file=sys.stderr, flush=True)
                r, outs = kakeya_runs(gen, prompts, args.max_tokens, b, args.repeats)
                r["identical_to_colocated"] = outs == ref
                rows[str(b)] = r
        finally:
            stop(procs)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--torch", action="store_true", help="also kakeya's colocated torch backend")
    ap.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads (1: on a small shared CPU a 2-thread team waits for a descheduled thread)",
    )
    ap.add_argument(
        "--split",
        action="store_true",
        help="also split over loopback: `kakeya serve verifier` + `kakeya serve drafter` processes (MLX)",
    )
    ap.add_argument("--no-dflash", action="store_true", help="skip the dflash package loop")
    ap.add_argument("--out", default=str(RESULTS / "suite.json"))
    ap.add_argument("--replot", action="store_true", help="recompute efficiency and plots from --out, no runs")
    args = ap.parse_args(argv)
    if args.replot:
        out = Path(args.out)
        res = json.loads(out.read_text())
        res["efficiency"] = efficiency(res)
        res["plots"] = plots(res, out.with_suffix(""))
        if "record" in res:  # the run's own record: redrawing measures nothing
            write_result(out, res, record=res["record"])
        else:  # measured before records: this commit did not measure it, so it gains none
            out.write_text(json.dumps(res, indent=2) + "\n")
        print(json.dumps(res["efficiency"]))
        return 0

    engine = build_local_engine(args.target, args.draft, "mlx")
    target_dir, draft_dir = Path(engine.target), Path(engine.draft)
    prompts = held_out_prompts(args.prompts, args.prompt_len)
    res: dict = {
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "python": platform.python_version(),
            "note": "shared 2-core CPU, no GPU",
        },
        "pair": {
            "target": str(target_dir.relative_to(ROOT) if target_dir.is_relative_to(ROOT) else target_dir),
            "draft": str(draft_dir.relative_to(ROOT) if draft_dir.is_relative_to(ROOT) else draft_dir),
        },
        "prompts": {"n": len(prompts), "tokens": args.prompt_len, "source": "held-out stdlib files"},
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "kakeya_mlx": {},
    }
    t0 = time.time()
    ref = None
    for b in args.block_sizes:
        print(f"kakeya mlx block {b} ...", file=sys.stderr, flush=True)
        r, outs = kakeya_runs(colocated(engine), prompts, args.max_tokens, b, args.repeats)
        if ref is None:
            ref = outs
        r["identical_to_block1"] = outs == ref
        res["kakeya_mlx"][str(b)] = r
    print("mlx-lm AR ...", file=sys.stderr, flush=True)
    res["mlx_lm_ar"], ar_outs = mlx_lm_ar(target_dir, prompts, args.max_tokens, args.repeats)
    res["mlx_lm_ar"]["identical_to_kakeya"] = ar_outs == ref
    if not args.no_dflash:
        res["dflash"] = {}
        for b in [b for b in args.block_sizes if b > 1]:
            print(f"dflash package loop block {b} ...", file=sys.stderr, flush=True)
            entry = {}
            for gap_b in (True, False):
                r, outs = dflash_loop(target_dir, draft_dir, prompts, args.max_tokens, b, args.repeats, gap_b)
                r["identical_to_ar"] = outs == ref
                entry["gap_b" if gap_b else "sqrt_hidden_scale"] = r
            res["dflash"][str(b)] = entry
    if args.torch:
        import torch

        torch.set_num_threads(args.torch_threads)
        res["torch_threads"] = torch.get_num_threads()
        res["kakeya_torch"] = {}
        tengine = build_local_engine(str(target_dir), str(draft_dir), "torch")
        for b in args.block_sizes:
            print(f"kakeya torch block {b} ...", file=sys.stderr, flush=True)
            r, outs = kakeya_runs(colocated(tengine), prompts, args.max_tokens, b, args.repeats)
            r["identical_to_mlx"] = outs == ref
            res["kakeya_torch"][str(b)] = r
    if args.split:
        res["kakeya_split"] = split_rows(target_dir, draft_dir, prompts, args, ref)
    res["efficiency"] = efficiency(res)
    res["wall_s"] = round(time.time() - t0, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        res["plots"] = plots(res, out.with_suffix(""))
    except ImportError:
        res["plots"] = []
        print("matplotlib missing: no plots (pip install matplotlib)", file=sys.stderr)
    write_result(out, res)
    print(json.dumps({b: {k: v[k] for k in ("decode_tok_s", "mean_acceptance")} for b, v in res["kakeya_mlx"].items()}))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
