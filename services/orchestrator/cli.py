"""The ``kakeya`` command.

Every sub-command registers itself with ``register(subparsers)`` and sets
``func``; errors a user can fix (bad paths, bad configs, bad arguments) end as
one ``kakeya: error: ...`` line and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys



class UsageError(Exception):
    """A problem with what the user asked for; printed as one line."""


def _default_pair():
    from services.checkpoints.tiny import embedded_pair

    return embedded_pair()


def build_local_engine(target: str | None, draft: str | None, backend: str = "mlx", device: str | None = None,
                       dtype: str | None = None, policy=None):
    """Load the pair in-process (the embedded default models when no paths are given).

    ``device``/``dtype`` apply to the torch backend (MLX runs where MLX runs, in the weights' dtype).
    """
    from services.checkpoints.config import check_pair, load_draft_config, load_target_config

    from .endpoints import local_drafter, local_verifier
    from .engine import Engine
    from .text import TextCodec

    if (target is None) != (draft is None):
        raise UsageError("give both --target and --draft, or neither (for the embedded default models)")
    if target is None:
        pair = _default_pair()
        target, draft = str(pair.target), str(pair.draft)
    tcfg = load_target_config(target)
    dcfg = load_draft_config(draft)
    check_pair(tcfg, dcfg)
    aux_layers = dcfg["dflash_config"]["target_layer_ids"]
    torch_kw = {}
    if backend == "torch":
        torch_kw = {"device": device or "cpu", "dtype": dtype or "float32"}
    elif device not in (None, "cpu") or dtype is not None:
        raise UsageError("--device/--dtype apply to --backend torch")
    verifier = local_verifier(target, aux_layers, backend, **torch_kw, **({"policy": policy} if policy else {}))
    drafter = local_drafter(draft, target, backend, **torch_kw)
    return Engine(verifier, drafter, TextCodec(target), target=str(target), draft=str(draft))


def add_cache_args(p, default_kind: str | None = "native") -> None:
    """Cache-policy flags, shared by every command that opens verifier sessions.

    ``default_kind=None`` (the client): no --cache means "the server's default policy".
    """
    g = p.add_argument_group("verifier cache policy")
    g.add_argument("--cache", default=default_kind, choices=["native", "sink-window"],
                   help="native: the model's own sliding window (not bounded as a whole); "
                        "sink-window: --sink first positions + a --window of recent ones on sliding layers")
    g.add_argument("--sink", type=int, default=4, help="attention sinks kept forever (sink-window)")
    g.add_argument("--window", type=int, default=None, help="sliding window (sink-window; default: the model's)")
    g.add_argument("--full-kv-bits", type=int, default=0, choices=[0, 4, 8],
                   help="affine-quantize full-attention K/V to 4 or 8 bits (0: exact)")
    g.add_argument("--restore", default=None, metavar="ftheta:DIR",
                   help="restore evicted sliding-layer K/V with a trained f_theta (sink-window only; "
                        "see kakeya train-ftheta)")


def cache_policy_from_args(args):
    """The CachePolicy the flags ask for, or None when --cache was left to the server."""
    from services.contract import CachePolicy

    if args.cache is None:
        if args.full_kv_bits or args.window is not None or getattr(args, "restore", None):
            raise UsageError("--window/--full-kv-bits/--restore need --cache native|sink-window")
        return None
    restore = getattr(args, "restore", None)
    restore = restore.removeprefix("ftheta:") if restore else None
    if args.cache == "native":
        return CachePolicy("native", full_kv_bits=args.full_kv_bits, restore=restore)
    return CachePolicy("sink-window", sink=args.sink, window=args.window, full_kv_bits=args.full_kv_bits,
                       restore=restore)


def cmd_generate(args) -> int:
    from .engine import Request, stream_text
    from .loop import check_block_size, drive

    if args.prompt is not None and not args.prompt.strip():
        raise UsageError("--prompt is empty")
    engine = build_local_engine(args.target, args.draft, args.backend, args.device, args.dtype)
    prompt_ids = engine.codec.encode(args.prompt if args.prompt is not None else DEFAULT_PROMPT)
    req = Request(prompt_ids, max_tokens=args.max_tokens, block_size=args.block_size or 0, ignore_eos=args.ignore_eos,
                  cache_policy=cache_policy_from_args(args))
    try:
        if args.block_size is not None:
            check_block_size(args.block_size)
        req.cache_policy.resolve(engine.verifier.info.sliding_window)
        engine.validate(req)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc

    def show(item):
        if not args.json:
            sys.stdout.write(item[1])
            sys.stdout.flush()

    gen = drive(stream_text(engine.codec, engine.stream(req)), show)
    out = engine.report(req, gen)
    if args.compare_ar:
        out.update(_compare_ar(engine, req, gen))
    print_result(args, out)
    return 0


def print_result(args, out: dict) -> None:
    """The end of `generate` and `client generate`: one JSON line, or a summary line on stderr."""
    if args.json:
        print(json.dumps(out))
        return
    print()
    summary = (
        f"[{len(out['token_ids'])} tokens, {out['finish_reason']}; mean acceptance {out['mean_acceptance']:.2f} "
        f"at block {out['block_size']}; decode {out['decode_tok_s']:.1f} tok/s; prefill {out['prefill_s']*1e3:.1f} ms"
    )
    if "ar_decode_tok_s" in out:
        summary += f"; AR {out['ar_decode_tok_s']:.1f} tok/s; lossless={out['lossless']}"
    if out["drafter_fallback"]:
        summary += "; drafter failed, verifier finished alone"
    if out["quality"]["degenerate"]:
        summary += "; WARNING: runaway repetition"
    print(summary + "]", file=sys.stderr)


def _compare_ar(engine, req, gen) -> dict:
    """Greedy AR of the same target, as independent of the speculative path as the policy allows.

    For the native policy on MLX that is mlx-lm's own ``generate_step`` with its
    own caches. mlx-lm has no sink-window or quantized-full-layer cache, so for
    those (and for other backends) the reference is this engine at block size 1
    with the same policy: plain AR through the same cache semantics.
    """
    from dataclasses import replace

    stop = set(req.stop_ids) | (set() if req.ignore_eos else set(engine.verifier.info.eos_token_ids))
    policy = req.cache_policy
    target = getattr(engine.verifier, "target", None)
    native = policy is None or (policy.kind == "native" and not policy.full_kv_bits)
    if native and getattr(target, "backend", "") == "mlx":
        from services.verifier.reference_mlx import greedy_reference

        ar_ids, _, decode_s = greedy_reference(target.model, req.prompt_ids, req.max_tokens, stop)
        reference = "mlx-lm generate_step (native caches)"
    else:
        ar = engine.generate(replace(req, block_size=1))
        ar_ids, decode_s = ar.token_ids, ar.decode_s
        reference = f"kakeya block size 1, same cache policy ({policy.label if policy else 'default'})"
    ar_tok_s = (len(ar_ids) - 1) / decode_s if decode_s > 0 and len(ar_ids) > 1 else 0.0
    return {
        "ar_reference": reference,
        "ar_token_ids": ar_ids,
        "ar_decode_tok_s": round(ar_tok_s, 3),
        "lossless": ar_ids == gen.token_ids,
        "speedup": round(gen.decode_tok_s / ar_tok_s, 4) if ar_tok_s else 0.0,
    }


DEFAULT_PROMPT = "def fibonacci(n):\n    "


def add_generation_options(p) -> None:
    """Options shared by `kakeya generate` and `kakeya client generate`."""
    p.add_argument("--prompt", help=f"prompt text (default: {DEFAULT_PROMPT!r})")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--block-size", type=int, default=None, help="1..16 (default: the drafter's trained block size)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    p.add_argument("--json", action="store_true", help="print one JSON object on the last line")


def register_generate(sub) -> None:
    p = sub.add_parser("generate", help="speculative generation in-process (embedded default models if no paths)")
    p.add_argument("--target", help="Gemma-4 target checkpoint directory")
    p.add_argument("--draft", help="DFlash drafter checkpoint directory")
    add_generation_options(p)
    p.add_argument("--backend", default="mlx", choices=["mlx", "torch"], help="mlx (default) or torch")
    p.add_argument("--device", choices=["cpu", "cuda", "mps"], help="torch device (default cpu)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="torch weights dtype (default float32)")
    p.add_argument("--compare-ar", action="store_true", help="also run greedy AR and report lossless/speedup")
    add_cache_args(p)
    p.set_defaults(func=cmd_generate)


def build_parser() -> argparse.ArgumentParser:
    from services.checkpoints import tiny
    from services.verifier import memory, train_ftheta

    from . import niah, serve

    parser = argparse.ArgumentParser(prog="kakeya", description="Speculative decoding for Gemma-4 with DFlash drafters")
    sub = parser.add_subparsers(dest="command", required=True)
    register_generate(sub)
    serve.register_serve(sub)
    serve.register_client(sub)
    tiny.register(sub)
    memory.register(sub)
    from services.training import drafter as train_drafter, target as train_target

    train_target.register(sub)
    train_drafter.register(sub)
    train_ftheta.register(sub)
    niah.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (UsageError, ValueError, FileNotFoundError) as exc:  # CheckpointError is a ValueError
        print(f"kakeya: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
