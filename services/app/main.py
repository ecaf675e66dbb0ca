"""The ``kakeya`` command.

Parses arguments and prints; engines are built by ``assembly.py``. Every sub-command registers itself with
``register(subparsers)`` and sets ``func``; errors a user can fix (bad paths, bad configs, bad arguments: library
code raises ValueError) end as one ``kakeya: error: ...`` line and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

from kakeya.app import options
from kakeya.core.request import REJECTION, InvalidRequest, Request
from kakeya.runtime import heap


def cmd_generate(args) -> int:
    from kakeya.orchestrator.assembly import build_local_engine, resolve_backend, set_torch_threads
    from kakeya.orchestrator.decode.checks import Limits

    policy = options.cache_policy_from_args(args)
    backend, device = resolve_backend(args.backend, args.device)
    set_torch_threads(args.torch_threads, device, args.target is None, backend)  # before the first product
    ngram, fast = args.ngram == "on", options.torch_options(args)
    engine = build_local_engine(args.target, args.draft, backend, device, args.dtype, torch_options=fast, ngram=ngram)
    constraint, constraint_flags = options.constraint_from_args(args)
    prompt = args.prompt if args.prompt is not None else options.DEFAULT_PROMPT
    req = Request(
        prompt, max_tokens=args.max_tokens, block_size=args.block_size or 0, ignore_eos=args.ignore_eos,
        cache_policy=policy, sampling=options.sampling_from_args(args), logprobs=args.logprobs,
        constraint=constraint,
    )  # fmt: skip
    try:
        req = engine.check(req, Limits(max_prompt_tokens=sys.maxsize))  # no server's cap: the model's context
    except InvalidRequest as exc:
        raise ValueError(exc.public(options.FLAG_NAMES | constraint_flags)) from None
    _warm_up(engine, req, args.compare_ar)
    shown, logprobs = 0, []
    with engine.start(req) as run:
        for block in run:
            options.show(args, block.text)
            shown += len(block.text)
            logprobs += block.logprobs or ()
    report = run.report()
    options.show(args, report.text[shown:])
    gen = run.result
    out = report.to_json()
    if args.dtype:
        out["dtype"] = args.dtype
    if req.logprobs is not None:
        out["logprobs"] = options.logprobs_json(logprobs)
    if args.compare_ar:
        out.update(_compare_ar(engine, req, gen))
        out.update(_compare_transformers(engine, req, gen, args))
    options.print_result(args, out)
    return 0


def _warm_up(engine, req, ar: bool) -> None:
    """A few blocks first, so neither timed run pays for first-call allocation and kernel set-up
    (the servers warm up the same way before they report SERVING)."""
    block = req.block_size or engine.default_block_size
    req = replace(req, constraint=None)  # a constraint's grammar ends at EOS: the warm-up runs free for its length
    engine.generate(replace(req, max_tokens=2 * block, ignore_eos=True))
    if ar:
        engine.generate(replace(req, max_tokens=4, block_size=1, ignore_eos=True))


def _compare_ar(engine, req, gen) -> dict:
    """AR decoding of the same target, as independent of the speculative path as the policy allows.

    Greedy, native policy on MLX: mlx-lm's own ``generate_step`` with its own caches. mlx-lm has no sink-window
    or quantized-full-layer cache and not our sampling noise, so elsewhere the reference is this engine at block
    size 1 with the same policy and seed: plain AR through the same cache semantics. Coupled sampling is compared
    token for token like greedy; under the rejection rule AR sampling is a speed reference only.
    """
    policy = req.cache_policy
    if not req.sampling.greedy and req.sampling.rule == REJECTION:
        ar = engine.generate(replace(req, block_size=1))
        ar_tok_s = ar.decode_tok_s
        reference = "kakeya block size 1, AR sampling with the same parameters (same distribution, other tokens)"
        speedup = round(gen.decode_tok_s / ar_tok_s, 4) if ar_tok_s else 0.0
        return {"ar_reference": reference, "ar_token_ids": ar.token_ids, "ar_decode_tok_s": round(ar_tok_s, 3),
                "speedup": speedup}  # fmt: skip
    native = _native(policy)
    mlx = engine.verifier.info.backend == "mlx"
    if req.sampling.greedy and native and mlx and req.constraint is None:  # the CLI's engine holds the target
        from kakeya.verifier.mlx_backend.reference import greedy_reference

        ar_ids, _, decode_s = greedy_reference(
            engine.verifier.target.model, req.prompt_ids, req.max_tokens, engine.stop_ids(req)
        )
        reference = "mlx-lm generate_step (native caches)"
    else:
        ar = engine.generate(replace(req, block_size=1))
        ar_ids, decode_s = ar.token_ids, ar.decode_s
        reference = f"kakeya block size 1, same cache policy ({policy.label if policy else 'default'})"
        reference += "" if req.sampling.greedy else ", AR sampling with the same seed (coupled rule: the same tokens)"
        reference += "" if req.constraint is None else ", the same constraint"
    keys = ("ar_token_ids", "ar_decode_tok_s", "lossless", "speedup")
    return {"ar_reference": reference, **_beside(gen, ar_ids, decode_s, keys)}


def _native(policy) -> bool:
    """The model's own caches: no sink-window, no quantized full layers (what the reference runs have)."""
    return policy is None or (policy.kind == "native" and not policy.full_kv_bits)


def _beside(gen, ids, decode_s: float, keys: tuple[str, ...]) -> dict:
    """A reference run beside ours, under ``keys``: its tokens, its decode rate, whether ours are the same, our
    speedup over it."""
    tok_s = (len(ids) - 1) / decode_s if decode_s > 0 and len(ids) > 1 else 0.0
    speedup = round(gen.decode_tok_s / tok_s, 4) if tok_s else 0.0
    return dict(zip(keys, (ids, round(tok_s, 3), ids == gen.token_ids, speedup), strict=True))


def _compare_transformers(engine, req, gen, args) -> dict:
    """Torch on a CPU in float32, greedy, native cache, no constraint: transformers' own ``generate`` on the
    same target directory, a baseline that shares none of our code (the block-1 path above shares the forward
    and the cache). Elsewhere it is not what the run measures (another device or dtype, a bounded cache,
    a sampler or a grammar transformers does not run), so nothing is reported."""
    comparable = engine.verifier.info.backend == "torch" and engine.device in (None, "cpu") and req.sampling.greedy
    if not (comparable and _native(req.cache_policy) and req.constraint is None and args.dtype in (None, "float32")):
        return {}
    import importlib.util

    if importlib.util.find_spec("transformers") is None:  # a dev dependency: a bare torch install compares with block 1
        return {"hf_reference": "not run: transformers is not installed"}
    from kakeya.orchestrator.assembly import pair_paths
    from kakeya.verifier.torch_backend.reference import NAME, greedy_reference, load_reference

    model = load_reference(pair_paths(args.target, args.draft)[0])
    if model is None:  # its verdict would be on random weights
        return {"hf_reference": "not run: transformers cannot read this checkpoint's weights (mlx_lm.convert's names?)"}
    stop = engine.stop_ids(req)
    greedy_reference(model, req.prompt_ids, 4, stop)  # its warm-up, as ours had one
    ids, _, decode_s = greedy_reference(model, req.prompt_ids, req.max_tokens, stop)
    keys = ("hf_token_ids", "hf_decode_tok_s", "hf_identical", "speedup_over_hf")
    return {"hf_reference": NAME, **_beside(gen, ids, decode_s, keys)}


def register_generate(sub) -> None:
    p = sub.add_parser("generate", help="speculative generation in-process (embedded default models if no paths)")
    p.add_argument("--target", help="Gemma-4 target checkpoint directory")
    p.add_argument("--draft", help="DFlash drafter checkpoint directory")
    options.add_generation_options(p)
    options.add_backend_args(p)
    p.add_argument("--compare-ar", action="store_true",
                   help="also run AR and report the speedup; greedy and coupled sampling: and whether the"
                        " tokens are identical (lossless); the rejection rule: AR sampling, speed only;"
                        " torch on a CPU, greedy: also transformers' own generate on the same weights"
                        " (speed-up and whether its tokens are ours)")  # fmt: skip
    options.add_ngram(p)
    options.add_cache_args(p)
    p.set_defaults(func=cmd_generate)


def build_parser() -> argparse.ArgumentParser:
    """Every sub-command; imports neither MLX nor torch (each command imports its backend when it runs)."""
    from kakeya.app import client, inspect_ckpt, serve, tools

    class WholeFlags(argparse.ArgumentParser):  # sub-parsers too: `serve all --backend 5` is not --backend-timeout
        def __init__(self, *args, **kwargs):  # a flag of another command is refused, never read as one it starts
            super().__init__(*args, **kwargs, allow_abbrev=False)

    parser = WholeFlags(prog="kakeya", description="Speculative decoding for Gemma-4 with DFlash drafters")
    sub = parser.add_subparsers(dest="command", required=True)
    register_generate(sub)
    serve.register(sub)
    client.register(sub)
    tools.register(sub)
    inspect_ckpt.register(sub)
    tools.register_train(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse, run, and turn what a user can fix (ValueError, a path it cannot read or write) into one line and exit 2."""
    try:  # building the parser imports every sub-command (half a second): a Ctrl-C there exits as one later does
        args = build_parser().parse_args(argv)
        for name in {"target", "draft", "dir", "tokenizer", "config", "out"} & vars(args).keys():  # --x=~/y: unexpanded
            setattr(args, name, getattr(args, name) and os.path.expanduser(getattr(args, name)))
        heap.keep_freed_memory()  # before any model work: a step's temporaries reuse pages (runtime/heap.py)
        return int(args.func(args) or 0)
    except (ValueError, OSError) as exc:  # CheckpointError is a ValueError; OSError: a missing file, a file for a dir
        print(f"kakeya: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
