"""``kakeya make-tiny``, ``kakeya memory`` and ``kakeya niah``: the model tools' options and output;
each library is imported only when its command runs."""

from __future__ import annotations

import argparse
import json
import sys

from kakeya.checkpoints import tokenizer as tk


def register(sub) -> None:
    _register_tiny(sub)
    _register_memory(sub)
    _register_niah(sub)


def _make_tiny(args: argparse.Namespace) -> int:
    from kakeya.checkpoints.tiny import make_tiny

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
    from kakeya.checkpoints.config import load_target_config
    from kakeya.verifier.memory import PRESETS, KVShape, policy_table

    if (args.preset is None) == (args.config is None):
        raise ValueError("give exactly one of --preset or --config")
    if args.context < 1:
        raise ValueError(f"--context must be >= 1, got {args.context}")
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
    from kakeya.verifier.memory import DTYPE_BYTES, PRESETS

    p = sub.add_parser("memory", help="KV bytes per session and cache policy, from a config")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=sorted(PRESETS))
    src.add_argument("--config", help="a checkpoint directory (its config.json)")
    p.add_argument("--context", type=int, required=True, help="positions in the session (prompt + generated)")
    p.add_argument("--sink", type=int, default=4, help="sinks for the sink-window rows (default 4)")
    p.add_argument("--window", type=int, default=64, help="window for the sink-window rows (default 64)")
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), help="K/V dtype (default: the config's)")
    p.add_argument("--restore-rank", type=int, default=0,
                   help="also show sink-window+restore rows for an f_theta of this rank (its latent ring)")  # fmt: skip
    p.add_argument("--json", action="store_true")
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
