"""What the `kakeya` sub-commands share: option groups, their parsing, the result line.

Imported by ``app/main.py``, ``serve.py`` and ``client.py`` (never the reverse), and imports nothing
heavy: building the parser needs neither MLX nor torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import suppress
from pathlib import Path

from kakeya.core.constraints import Constraint
from kakeya.core.request import CachePolicy, InvalidRequest, SamplingParams

# The first held-out prompt of the drafter's evaluation (the start of a stdlib file the demo pair never
# trained on, ``training.drafter_eval.heldout_prompts``): a rule, not a pick.
DEFAULT_PROMPT = '"""Record of phased-in incompatible language changes.\n\nEach line is of the form:\n\n    FeatureName = "_Feature(" OptionalRelease "'


def add_ngram(p) -> None:
    """--ngram: `kakeya generate` and `serve orchestrator` (``orchestrator/proposers.py``)."""
    p.add_argument("--ngram", choices=["on", "off"], default="on",
                   help="draft a block by copying what followed the context's last 3-8 tokens where they occurred"
                        " before (prompt lookup), the drafter's block otherwise (default on; greedy and coupled"
                        " sampling; off: every block is the drafter's, e.g. to measure the drafter alone)")  # fmt: skip


def add_backend_args(p, *, help_suffix: str = "") -> None:
    """--backend/--device/--dtype, the torch fast paths and --torch-threads, for commands that load models
    in-process."""
    auto = "auto (default): MLX on Apple silicon, torch elsewhere"
    p.add_argument("--backend", default="auto", choices=["auto", "mlx", "torch"], help=auto + help_suffix)
    p.add_argument("--device", help="torch: cuda, cuda:1, cpu, mps (default: cuda when available, else cpu)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="torch weights dtype (default float32)")
    p.add_argument("--cuda-graphs", default="auto", choices=["auto", "on", "off"],
                   help="torch: capture the verify step and the drafter's block forward in CUDA graphs per block-size"
                        " bucket (auto: on for cuda)")  # fmt: skip
    p.add_argument("--graphed-min-batch", type=int,
                   help="torch with CUDA graphs: the fewest queued drafts run as one eager batched forward rather than"
                        " graph replays one after another (default 4, docs/cuda.md; 0: never batch)")  # fmt: skip
    p.add_argument("--compile", action="store_true",
                   help="torch: torch.compile each layer's norms, projections, RoPE and MLP into fused kernels; "
                        "slow start-up, off by default")  # fmt: skip
    add_torch_threads(p)


def add_torch_threads(p) -> None:
    """--torch-threads: with the backend flags, and alone for ``serve all`` (whose children it configures)."""
    p.add_argument("--torch-threads", type=int,
                   help="torch CPU threads, and on Linux the BLAS threads of MLX's products (default: 1 for the"
                        " embedded pair on CPU, where a tiny model gains nothing from more and a thread team stalls"
                        " on a shared CPU; the library's own otherwise; 0: the library's)")  # fmt: skip


def torch_options(args, drafter: bool = True) -> dict:
    """The torch fast-path options from --cuda-graphs/--graphed-min-batch/--compile (only what differs from
    the defaults). ``drafter``: whether a drafter loads here (--graphed-min-batch is the drafter's)."""
    graphs = getattr(args, "cuda_graphs", "auto")
    out = {} if graphs == "auto" else {"cuda_graphs": graphs == "on"}
    min_batch = getattr(args, "graphed_min_batch", None)
    if min_batch is not None:
        if not drafter:
            raise ValueError("--graphed-min-batch applies where a drafter runs (serve drafter, orchestrator, all)")
        if min_batch < 0 or min_batch == 1:
            raise ValueError(f"--graphed-min-batch must be 0 (never) or an integer >= 2, got {min_batch}")
        out["graphed_min_batch"] = min_batch
    if getattr(args, "compile", False):
        out["compile"] = True
    return out


def add_cache_args(p, default_kind: str | None = "native", *, restore_sources: bool = False) -> None:
    """Cache-policy flags, shared by every command that opens verifier sessions.

    ``default_kind=None`` (the client): no --cache means "the server's default policy".
    ``restore_sources`` (the servers that hold sessions): --restore names the f_theta sources requests
    choose from by name, a server-wide flag, not the one policy's directory.
    """
    g = p.add_argument_group("verifier cache policy")
    g.add_argument("--cache", default=default_kind, choices=["native", "sink-window"],
                   help="native: the model's own sliding window (not bounded as a whole); "
                        "sink-window: --sink first positions + a --window of recent ones on sliding"
                        " layers")  # fmt: skip
    g.add_argument("--sink", type=int, default=4, help="attention sinks kept forever (sink-window; default 4)")
    g.add_argument("--window", type=int, help="sliding window (sink-window; default: the model's)")
    g.add_argument("--full-kv-bits", type=int, default=0, choices=[0, 4, 8],
                   help="affine-quantize full-attention K/V to 4 or 8 bits (0: exact)")  # fmt: skip
    if restore_sources:
        p.add_argument("--restore", action="append", metavar="NAME=DIR",
                       help="an f_theta restoration source (repeatable); a bare DIR is the source 'default' and the"
                            " default policy's; requests choose sources by NAME (CachePolicy.restore_path)")  # fmt: skip
    elif default_kind is None:  # the wire carries a source's name; the server holds its directory
        g.add_argument("--restore", metavar="NAME",
                       help="restore evicted sliding-layer K/V with the server's f_theta source NAME (one of its"
                            " --restore NAME=DIR; a bare DIR there is 'default'; sink-window only)")  # fmt: skip
    else:
        g.add_argument("--restore", metavar="ftheta:DIR",
                       help="restore evicted sliding-layer K/V with a trained f_theta (sink-window only; see kakeya"
                            " train-ftheta)")  # fmt: skip


def cache_policy_from_args(args):
    """The CachePolicy the flags ask for, or None when --cache was left to the server; a ValueError names a flag
    that is off or that the policy has no use for (--sink's default 4 passes: deployments hand it to any policy)."""
    restore, windowed = getattr(args, "restore", None), {"--sink": args.sink != 4, "--window": args.window is not None}
    if args.cache is None and (args.full_kv_bits or restore or any(windowed.values())):
        raise ValueError("--sink/--window/--full-kv-bits/--restore need --cache native|sink-window")
    if args.cache == "native" and (given := [flag for flag, value in windowed.items() if value]):
        raise ValueError(f"{given[0]}: for --cache sink-window (native keeps the model's own sliding window)")
    if args.window is not None and args.window < 1:  # a client's 0 would go out as the wire's "the model's own"
        raise ValueError(f"--window: must be an integer >= 1, got {args.window}")
    restore = restore.removeprefix("ftheta:") if restore else None
    sink = args.sink if args.cache == "sink-window" else 0  # native: no --window, a --sink at its default (above)
    return args.cache and CachePolicy(args.cache, sink, args.window, full_kv_bits=args.full_kv_bits, restore=restore)


def prompt_text(text: str) -> str:
    """--prompt: the text, or ``-``: standard input's; UTF-8 only (argv keeps other bytes as lone surrogates, which
    the tokenizer cannot take)."""
    raw = sys.stdin.buffer.read() if text == "-" else text.encode("utf-8", "surrogateescape")
    with suppress(UnicodeDecodeError):
        return raw.decode("utf-8")
    raise argparse.ArgumentTypeError("not UTF-8 text")


def add_generation_options(p) -> None:
    """Options shared by `kakeya generate` and `kakeya client generate`."""
    p.add_argument("--prompt", type=prompt_text, help="prompt text, UTF-8; - reads it from standard input (default:"
                   " the start of a standard-library file the demo pair never trained on)")  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default 128)")
    p.add_argument("--block-size", type=int,
                   help="1..16, or 0 (the default): auto, each block sized for the most tokens per second; see"
                        " docs/design.md)")  # fmt: skip
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    p.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    p.add_argument("--logprobs", type=int, metavar="K",
                   help="each token's log-probability (the target's raw distribution) and the K most probable tokens "
                        "there (0..20), in the JSON's 'logprobs' (with --json)")  # fmt: skip
    add_constraint_options(p)
    g = p.add_argument_group("sampling (lossless: distributed exactly as AR sampling from the processed p)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0 (default): greedy, token-identical to greedy AR; else at least 1e-5")  # fmt: skip
    g.add_argument("--top-k", type=int, default=0, help="keep the k most probable tokens (0: off)")
    g.add_argument("--top-p", type=float, default=1.0, help="keep the smallest set reaching this mass (1: off)")
    g.add_argument("--min-p", type=float, default=0.0, help="keep tokens with p >= min_p * max p (0: off)")
    g.add_argument("--seed", type=int, help="seed of the sampling (default: drawn, and reported)")
    g.add_argument("--sampling-rule", default="coupled", choices=["coupled", "rejection"],
                   help="coupled (default): the tokens of AR sampling with the seed, whatever the block sizes; "
                        "rejection: min(1, p/q) acceptance, its tokens depend on the block sizes (auto then runs "
                        "at the drafter's trained size); see README, Sampling")  # fmt: skip


# ``--json-schema`` & co. (one at a time) -> the Request fields a refusal of the constraint names them by
CONSTRAINT_FLAGS = {"json_schema": "--json-schema", "json_object": "--json-object", "regex": "--regex",
                    "choice": "--choice", "grammar": "--grammar"}  # fmt: skip


def add_constraint_options(p) -> None:
    """The constrained-output flags of `kakeya generate` and `kakeya client generate`, read into one
    :class:`~kakeya.core.constraints.Constraint` by :func:`constraint_from_args`."""
    g = p.add_argument_group("constrained output (every token is one the grammar allows; see docs/structured.md)")
    x = g.add_mutually_exclusive_group()
    x.add_argument("--json-schema", metavar="FILE|JSON", help="the output is JSON valid under this schema")
    x.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    x.add_argument("--regex", metavar="RE", help="the output matches this regular expression (whole)")
    x.add_argument("--choice", action="append", metavar="TEXT", help="the output is one of these (repeat the flag)")
    x.add_argument("--grammar", metavar="FILE|LARK", help="the output follows this Lark grammar")


def text_or_file(value: str) -> str:
    """A flag's value, or the contents of the file it names (a value that is a path to an existing file)."""
    with suppress(OSError):
        if len(value) < 4096 and "\n" not in value and Path(value).is_file():
            return Path(value).read_text(encoding="utf-8")
    return value


def constraint_from_args(args):
    """The Constraint the flags ask for (None: none); the field names for a refusal of it."""
    kind = next((k for k in CONSTRAINT_FLAGS if getattr(args, k, None) not in (None, False, [])), None)
    if kind is None:
        return None, {}
    value = getattr(args, kind)
    if kind == "choice":
        value = tuple(value)
    elif kind in ("json_schema", "grammar"):
        value = text_or_file(value)
    flag = CONSTRAINT_FLAGS[kind]
    c = Constraint(kind, None if kind == "json_object" else value)
    return c, {"constraint": flag, "constraint.spec": flag, "constraint.kind": flag}


def logprobs_json(logprobs) -> list[dict]:
    """``TokenLogprobs`` as the CLI's JSON lists them: ``{token, logprob, top: [[token, logprob], ...]}``."""
    return [{"token": lp.token, "logprob": lp.logprob, "top": [list(t) for t in lp.top]} for lp in logprobs]


# The request's fields -> the flags that set them (a refusal names the flag): ``--`` and the field's last
# part, dashed, but for two.
FLAG_NAMES = {
    f: "--" + f.rsplit(".", 1)[-1].replace("_", "-")
    for f in ("prompt", "max_tokens", "block_size", "logprobs", "sampling.temperature", "sampling.top_k")
    + ("sampling.top_p", "sampling.min_p", "sampling.seed", "cache_policy.window", "cache_policy.sink")
    + ("cache_policy.full_kv_bits", "cache_policy.restore")
} | {"sampling.rule": "--sampling-rule", "cache_policy": "--cache"}


def sampling_from_args(args):
    """The SamplingParams the flags ask for (a ValueError naming the flag when one is off)."""
    if args.logprobs is not None and not args.json:  # the summary line has no room for them: refused, not dropped
        raise ValueError("--logprobs: they are listed in the JSON only, give --json too")
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.min_p, args.seed, args.sampling_rule)
    try:
        return sampling.check()
    except InvalidRequest as exc:
        raise ValueError(exc.public(FLAG_NAMES)) from None


def summary_line(out: dict) -> str:
    """One line that says what ran and, with an AR reference, what was compared and how it came out."""
    where = "/".join(filter(None, (out.get("backend") or "?", out.get("device"))))
    sizes = out.get("block_sizes") or [0]
    block = f"block {out['block_size']}" if out["block_size"] else f"auto blocks, mean {sum(sizes) / len(sizes):.1f}"
    head = f"speculative (DFlash, {block}, {where}): {out['decode_tok_s']:.0f} tok/s"
    if sampled := out.get("sampling", {}).get("temperature", 0) > 0:
        head = head.replace("): ", f", sampling seed {out['seed']}, {out['sampling'].get('rule')} rule): ", 1)
    if "ar_decode_tok_s" in out:
        speedup = f"{out['speedup']:.1f}x" if out.get("speedup") else "n/a"
        head += f" vs autoregressive{' sampling' * sampled} {out['ar_decode_tok_s']:.0f} tok/s -> {speedup}"
    if "ar_decode_tok_s" in out and "lossless" not in out:  # the rejection rule: a speed reference only
        head += " (same distribution, not the same tokens: no token-identity claim under the rejection rule)"
    elif "ar_decode_tok_s" in out:
        ids, ar = out["token_ids"], out["ar_token_ids"]
        same = next((i for i, (a, b) in enumerate(zip(ids, ar)) if a != b), min(len(ids), len(ar)))
        if out["lossless"]:
            head += f", lossless ({same}/{len(ar)} tokens identical)"
        else:
            head += f", NOT lossless (first {same} of {len(ar)} tokens identical)"
        if not out["lossless"] and out.get("dtype") in ("bfloat16", "float16"):
            # A verify of several rows and an AR step of one round differently in 16 bits, so where the
            # target's top two logits nearly tie they can pick apart (docs/cuda.md); float32 is exact.
            head += f": {out['dtype']} rounds near-ties apart between a verify and an AR step, float32 does not"
    if out.get("hf_decode_tok_s"):  # the independent baseline (torch CPU, greedy): transformers' own generate
        same = "the same tokens" if out["hf_identical"] else "OTHER tokens than ours"
        head += (
            f"; vs transformers' generate {out['hf_decode_tok_s']:.0f} tok/s -> {out['speedup_over_hf']:.1f}x, {same}"
        )
    tail = f"{len(out['token_ids'])} tokens ({out['finish_reason']}), mean acceptance {out['mean_acceptance']:.2f} "
    tail += f"tokens/block, prefill {out['prefill_s'] * 1e3:.1f} ms"
    for key, how in (("copied_blocks", "drafted by n-gram copy"), ("forced_blocks", "forced by the grammar")):
        tail += f"; {out[key]} of {len(out['block_sizes'])} blocks {how}" if out.get(key) else ""
    if out["drafter_fallback"]:
        tail += "; drafter failed, verifier finished alone"
    if out["quality"]["degenerate"]:
        tail += "; WARNING: runaway repetition"
    return f"{head}; {tail}"


def show(args, text: str) -> None:
    """The text as it streams, from `generate` and `client generate` (not with --json: stdout is the JSON line then)."""
    if not args.json:
        sys.stdout.write(text)
        sys.stdout.flush()


def print_result(args, out: dict) -> None:
    """The end of `generate` and `client generate`: one JSON line, or the summary line on stderr."""
    if args.json:
        print(json.dumps(out))
        return
    print()
    print(summary_line(out), file=sys.stderr)
