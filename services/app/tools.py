"""The model tools' options and output: ``kakeya make-tiny``, ``memory``, ``niah`` and the trainers'
``train-target``, ``train-drafter`` and ``train-ftheta``; each library is imported only when its command runs
(building the parser imports neither MLX nor torch)."""

from __future__ import annotations

import argparse
import json
import sys

from kakeya.checkpoints import tokenizer as tk
from kakeya.checkpoints.config import load_target_config
from kakeya.checkpoints.tiny import make_tiny
from kakeya.verifier.memory import DTYPE_BYTES, PRESETS, KVShape, policy_table


def register(sub) -> None:
    _register_tiny(sub)
    _register_memory(sub)
    _register_niah(sub)


def register_train(sub) -> None:
    p = sub.add_parser("train-target", help="train a small Gemma-4 target on the Python stdlib (MLX or torch)")
    target_arguments(p)
    p.set_defaults(func=_train_target)
    p = sub.add_parser("train-drafter", help="train a DFlash drafter for a target (on the target's own continuations)")
    drafter_arguments(p)
    p.set_defaults(func=_train_drafter)
    p = sub.add_parser(
        "train-ftheta", help="train f_theta (drafter K/V -> evicted sliding-layer K/V) on offline text (MLX)"
    )
    ftheta_arguments(p)
    p.set_defaults(func=_train_ftheta)


def _make_tiny(args: argparse.Namespace) -> int:
    progress = lambda msg: print(msg, file=sys.stderr, flush=True)
    pair = make_tiny(args.out, seed=args.seed, sliding_window=args.sliding_window, moe=args.moe,
                     vocab_size=args.vocab_size, progress=progress)  # fmt: skip
    print(f"target: {pair.target}")
    print(f"draft: {pair.draft}")
    return 0


def _register_tiny(subparsers) -> None:
    p = subparsers.add_parser("make-tiny", help="write a tiny random Gemma-4 target + DFlash drafter checkpoint pair",
                              description="Write OUT/target (Gemma-4, HF format) and OUT/draft (DFlash drafter)"
                                          " with random weights, deterministic per seed.")  # fmt: skip
    p.add_argument("--out", required=True, help="output directory (gets target/ and draft/)")
    p.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    p.add_argument("--sliding-window", type=int, default=32, help="target sliding window (default 32)")
    p.add_argument("--moe", action="store_true", help="give the target an MoE block")
    vocab = tk.DEFAULT_VOCAB_SIZE
    p.add_argument("--vocab-size", type=int, default=vocab, help=f"tokenizer / model vocabulary (default {vocab})")
    p.set_defaults(func=_make_tiny)


def cmd_memory(args) -> int:
    if (args.preset is None) == (args.config is None):
        raise ValueError("give exactly one of --preset or --config")
    if args.context < 1:
        raise ValueError(f"--context must be >= 1, got {args.context}")
    if args.window < 1 or args.sink < 0:  # the policy's own refusal names its gRPC fields
        raise ValueError(f"--window must be >= 1 and --sink >= 0, got {args.window} and {args.sink}")
    cfg = PRESETS[args.preset] if args.preset else load_target_config(args.config)
    shape = KVShape.from_config(cfg, args.dtype)
    table = policy_table(shape, args.context, args.sink, args.window, args.restore_rank)
    if args.json:
        print(json.dumps(table))
        return 0
    full = table["full"]["total_bytes"]
    print(
        f"KV bytes for one session at context {args.context} ({args.preset or args.config}; "
        f"sink-window = {args.sink} sinks + window {args.window})"
    )
    print(f"{'policy':<24}{'total MiB':>12}{'sliding MiB':>13}{'full MiB':>11}{'vs full':>10}")
    for name, row in table.items():
        mib = [row[k] / 2**20 for k in ("total_bytes", "sliding_bytes", "full_bytes")]
        print(f"{name:<24}{mib[0]:>12.2f}{mib[1]:>13.2f}{mib[2]:>11.2f}{full / row['total_bytes']:>9.1f}x")
    return 0


def _register_memory(sub) -> None:
    p = sub.add_parser("memory", help="KV bytes per session and cache policy, from a config")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=sorted(PRESETS), help="a published model's shape, no checkpoint needed")
    src.add_argument("--config", help="a checkpoint directory (its config.json)")
    p.add_argument("--context", type=int, required=True, help="positions in the session (prompt + generated)")
    p.add_argument("--sink", type=int, default=4, help="sinks for the sink-window rows (default 4)")
    p.add_argument("--window", type=int, default=64, help="window for the sink-window rows (default 64)")
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), help="K/V dtype (default: the config's)")
    p.add_argument("--restore-rank", type=int, default=0,
                   help="also show sink-window+restore rows for an f_theta of this rank (its latent ring)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.set_defaults(func=cmd_memory)


def cmd_niah(args) -> int:
    from kakeya.orchestrator.assembly import build_local_engine
    from kakeya.orchestrator.niah import TINY_NOTE, parse_policy, run_niah

    if not args.contexts or min(args.contexts) < 16:
        raise ValueError("--contexts: give context lengths of at least 16 tokens")
    if not args.depths or not all(0.0 <= d <= 1.0 for d in args.depths):
        raise ValueError("--depths must lie in [0, 1]")
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    restore = args.restore.removeprefix("ftheta:") if args.restore else None
    names = list(dict.fromkeys(args.policies))
    if restore and not any("restore" in n.split("+") for n in names):
        names.append("sink-window+restore")
    engine = build_local_engine(args.target, args.draft)
    model_window = engine.verifier.info.sliding_window
    window = args.window or max(1, model_window // 2)
    policies = {n: parse_policy(n, args.sink, window, restore) for n in names}
    log = None if args.quiet else (lambda m: print(f"niah: {m}", file=sys.stderr, flush=True))
    table = run_niah(
        engine, args.contexts, args.depths, policies, args.max_tokens, args.block_size or 0, args.seed, log
    )
    result = {"target": engine.target, "draft": engine.draft, "contexts": args.contexts, "depths": args.depths,
              "max_tokens": args.max_tokens, "block_size": args.block_size or engine.default_block_size,
              "model_window": model_window, "sink": args.sink, "window": window, "note": TINY_NOTE,
              "policies": table}  # fmt: skip
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"needle recall ({engine.target}; {len(args.contexts)} contexts x {len(args.depths)} depths; {TINY_NOTE})")
    print(f"{'policy':<28}{'recall':>8}{'vs native':>11}  by context")
    for row in table.values():
        vs = "" if row["recall_vs_native"] is None else f"{row['recall_vs_native']:+.2f}"
        by = " ".join(f"{c}:{v:.2f}" for c, v in row["by_context"].items())
        print(f"{row['label']:<28}{row['recall']:>8.2f}{vs:>11}  {by}")
    return 0


def _register_niah(sub) -> None:
    p = sub.add_parser("niah", help="needle-in-a-haystack recall per cache policy, vs native")
    p.add_argument("--target", help="Gemma-4 target checkpoint directory")
    p.add_argument("--draft", help="DFlash drafter checkpoint directory")
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 512], help="prompt lengths in tokens")
    p.add_argument(
        "--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9], help="needle depth, 0 (start) .. 1 (end)"
    )
    p.add_argument("--policies", nargs="+", default=["native", "sink-window", "sink-window+kv8"],
                   help="native | sink-window, each optionally +kv8/+kv4 and +restore")  # fmt: skip
    p.add_argument("--restore",
                   help="f_theta directory (ftheta:DIR or DIR) for +restore policies; adds"
                        " sink-window+restore when no listed policy restores")  # fmt: skip
    p.add_argument("--sink", type=int, default=4, help="sinks of the sink-window policies")
    p.add_argument("--window", type=int, help="window of the sink-window policies (default: half the model's)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per case")
    p.add_argument("--block-size", type=int, help="speculative block size (default: the drafter's)")
    p.add_argument("--seed", type=int, default=0, help="varies the needle codes")
    p.add_argument("--quiet", action="store_true", help="no per-case progress on stderr")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.set_defaults(func=cmd_niah)


def _run_arguments(p: argparse.ArgumentParser, steps: int, lr: float, warmup: int, eval_every: int) -> None:
    """What every trainer takes: seed, schedule and optimizer, held-out split, device, checkpoints."""
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--time-budget", type=float, default=0,
                   help="stop after this many training seconds (0: none); the learning rate decays by"
                        " steps or by this budget, whichever runs out first")  # fmt: skip
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--warmup", type=int, default=warmup)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--heldout-pct", type=int, default=5)
    p.add_argument("--eval-every", type=int, default=eval_every, help="steps between held-out evaluations")
    p.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--resume", action="store_true", help="continue from OUT/ckpt if present")
    p.add_argument("--quiet", action="store_true")


def _layer_arguments(p: argparse.ArgumentParser, layers: int, intermediate: int) -> None:
    """The model's depth and layer shape (hidden size: the target's; the drafter shares it)."""
    p.add_argument("--layers", type=int, default=layers)
    p.add_argument("--intermediate", type=int, default=intermediate, help="MLP width")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)


def target_arguments(p: argparse.ArgumentParser) -> None:
    """``kakeya train-target``'s options (the namespace ``training.target.train`` takes)."""
    p.add_argument("--out", required=True, help="output checkpoint directory")
    p.add_argument("--backend", default="mlx", choices=["mlx", "torch"],
                   help="mlx (default) or torch (same model/data/output; much faster on Linux CPUs)")  # fmt: skip
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--hidden", type=int, default=128)
    _layer_arguments(p, layers=6, intermediate=384)
    p.add_argument("--pattern", default="s,s,f", help="layer-type pattern, repeated (s sliding, f full)")
    p.add_argument("--global-head-dim", type=int, default=64)
    p.add_argument("--sliding-window", type=int, default=64)
    p.add_argument("--vocab-size", type=int, default=tk.DEFAULT_VOCAB_SIZE)
    p.add_argument("--max-bytes", type=int, help="cap on train-file bytes (default: all)")
    p.add_argument("--eval-windows", type=int, default=64)
    p.add_argument("--retrieval-frac", type=float, default=0.0,
                   help="fraction of each batch that is synthetic recall text (needle, question, answer;"
                        " training/retrieval.py)")  # fmt: skip
    p.add_argument("--answer-weight", type=float, default=1.0,
                   help="loss weight of the recall text's answer tokens against 1 for every other token"
                        " (default 1: a plain mean)")  # fmt: skip
    p.add_argument("--retrieval-max-example", type=int, default=None,
                   help="cap on a recall example's tokens (default: --seq-len); an all-sliding target learns"
                        " only within its window")  # fmt: skip
    _run_arguments(p, steps=2000, lr=3e-3, warmup=100, eval_every=250)


def _train_target(args) -> int:
    from kakeya.training.target import train

    rep = train(args)
    print(json.dumps({"out": args.out, "steps": rep["steps"], **rep["final"]}))
    return 0


def drafter_arguments(p: argparse.ArgumentParser) -> None:
    """``kakeya train-drafter``'s options (the namespace ``training.drafter.train`` takes)."""
    p.add_argument("--target", required=True, help="target checkpoint directory (from train-target)")
    p.add_argument("--out", required=True, help="output drafter directory")
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--anchors", type=int, default=8, help="blocks (anchor positions) per sequence per step")
    p.add_argument("--block-size", type=int, default=8, help="block size written to dflash_config")
    p.add_argument("--train-block-sizes", default="", help="comma list sampled per step (default: --block-size)")
    p.add_argument("--gamma", type=float, default=0, help="position-weight decay exp(-(k-1)/gamma) (0: B/2)")
    _layer_arguments(p, layers=2, intermediate=256)
    p.add_argument("--target-layer-ids", default="1,3,5", help="target layers whose outputs are the aux context")
    p.add_argument("--sequences", type=int, default=512, help="target continuations to generate")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--gen-batch", type=int, default=64)
    p.add_argument("--temperatures", default="0",
                   help="comma list: generation batch i continues its prompts at temperatures[i %% n] (0:"
                        " greedy)")  # fmt: skip
    p.add_argument("--data-on-device", choices=["auto", "on", "off"], default="auto",
                   help="copy the whole training set (aux, final) to the training device once, so that a"
                        " step gathers its batch there instead of from the memory-mapped files on the"
                        " host; auto: on CUDA when it takes under half the free GPU memory")  # fmt: skip
    p.add_argument("--soft-weight", type=float, default=0.0,
                   help="weight of KL(target distribution || drafter) per block position (0: hard labels"
                        " only; then sampled continuations' tokens are the only labels)")  # fmt: skip
    p.add_argument("--bos-prompts", action="store_true", help="prompts start with <bos>, as real requests do")
    p.add_argument("--init-from",
                   help="start from this drafter checkpoint of the same config, e.g. to fine-tune it")  # fmt: skip
    p.add_argument("--val-sequences", type=int, default=64,
                   help="target continuations of held-out prompts for a teacher-forced held-out curve (0:"
                        " none)")  # fmt: skip
    p.add_argument("--eval-prompts", type=int, default=32, help="held-out prompts for the engine's acceptance")
    p.add_argument("--eval-max-tokens", type=int, default=128)
    p.add_argument("--eval-block-sizes", default="2,4,8,16")
    p.add_argument("--eval-temperatures", default="0.7,1.0",
                   help="sampled acceptance too, at these temperatures (coupled rule, one seed per"
                        " prompt; '': greedy only)")  # fmt: skip
    p.add_argument("--eval-sampled-block-sizes", default="8,16", help="block sizes of the sampled acceptance")
    p.add_argument("--no-eval", action="store_true", help="skip the acceptance measurement")
    p.add_argument("--eval-backend", default="mlx", choices=["auto", "mlx", "torch"],
                   help="engine that measures acceptance (default mlx, as the shipped cards; auto: the"
                        " fastest here)")  # fmt: skip
    _run_arguments(p, steps=1000, lr=2e-3, warmup=50, eval_every=500)


def _train_drafter(args) -> int:
    from kakeya.training.drafter import train

    rep = train(args)
    final_loss = rep["loss_curve"][-1][2] if rep["loss_curve"] else None
    summary = {"out": args.out, "steps": rep["steps"], "final_loss": final_loss}
    if "acceptance" in rep:
        summary["mean_acceptance"] = {b: v["mean_acceptance"] for b, v in rep["acceptance"]["per_block_size"].items()}
    print(json.dumps(summary))
    return 0


def _train_ftheta(args) -> int:
    from kakeya.orchestrator.assembly import require_backend

    require_backend("mlx")
    from kakeya.training.ftheta import cmd_train

    return cmd_train(args)


def ftheta_arguments(p: argparse.ArgumentParser) -> None:
    """``kakeya train-ftheta``'s options (``training.ftheta.cmd_train`` reads them)."""
    p.add_argument("--target", help="Gemma-4 target checkpoint directory")
    p.add_argument("--draft", help="DFlash drafter checkpoint directory (its context projections feed f_theta)")
    p.add_argument("--out", required=True, help="output f_theta directory (also holds train_state/ and report.json)")
    # Defaults (None) are ftheta.TrainArgs's own, applied when the command runs.
    p.add_argument("--steps", type=int, help="optimizer steps (default 2000)")
    p.add_argument("--rank", type=int, help="latent rank per path (a position stores 2 x rank floats; default 128)")
    p.add_argument("--encoder-hidden", type=int, help="encoder MLP width (default 2 x rank; 0: linear)")
    p.add_argument("--lr", type=float, help="peak learning rate (default 1e-3)")
    p.add_argument("--warmup", type=int, help="linear warm-up steps before the cosine decay (default 100)")
    p.add_argument("--batch", type=int, help="sequences per step (default 8)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: 2 x the model's window, at most 2048)")
    p.add_argument("--data-tokens", type=int, help="tokens of standard-library text to sample from (default 400000)")
    p.add_argument("--eval-seqs", type=int, help="held-out sequences for the report (default 8)")
    p.add_argument("--seed", type=int, help="default 0")
    p.add_argument(
        "--no-probe-full", action="store_true", help="skip the full-layer probe decoders (report: sliding only)"
    )
    p.add_argument("--retrieval-frac", type=float,
                   help="fraction of each batch that is recall text (needle, question, answer; training/retrieval.py)"
                        " instead of standard-library text (default 0)")  # fmt: skip
    p.add_argument("--retrieval-max-example", type=int,
                   help="cap on a recall example's tokens (default: --seq-len); keep needles within the window")  # fmt: skip
    p.add_argument("--answer-weight", type=float,
                   help="weight of the attention-output error at the recall text's queries that predict an answer"
                        " token, against 1 for every other query (default 1)")  # fmt: skip
    p.add_argument("--save-every", type=int, help="checkpoint train_state/ every N steps (default 200)")
    p.add_argument("--log-every", type=int, help="default 10")
    p.add_argument("--resume", action="store_true", help="continue the run in --out")
    p.add_argument("--json", action="store_true", help="print a JSON summary line (the full report is OUT/report.json)")
