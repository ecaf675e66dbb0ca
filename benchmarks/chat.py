"""A multi-turn chat with and without the prefix cache: cached tokens, time to first token, acceptance, output.

    python benchmarks/chat.py                                   # the embedded demo pair, torch on the CPU
    python benchmarks/chat.py --backend mlx --rounds 5
    python benchmarks/chat.py --target T --draft D --device cuda --out benchmarks/results/chat_cuda.json

A conversation of a system message and ``--turns`` user messages runs as a chat client runs it: each
turn's prompt is the checkpoint's chat template over every message so far (the
earlier answers as the assistant's messages, decoded to text and re-rendered),
through ``Engine.start`` -- the one request path of the gRPC and HTTP fronts.
Two engines load the same pair: one with a prefix cache (``--prefix-cache-bytes``),
one without. Each turn's prompt runs on both, alternating, ``--rounds`` times;
reported per turn: the prompt's length, the tokens the cached engine resumed
instead of prefilling (and their share of the prompt, and of the prompt's prefix
that is the previous turn's prompt + answer, the most any prefix cache could
reuse: the new user message is text no cache has seen), the median time to the
first token of each (start of the request to its first committed token: session
open, prefill and first sample) and their ratio, the mean acceptance of each,
and whether their outputs are identical. Greedy (temperature 0). The goal this
measures (issue "Chat the way clients already speak"): on turns 2.. the cached
share >= 0.9, identical output and acceptance, TTFT <= 0.3x cold.

Then ``--concurrent`` conversations at once (16 by default; each its own
system message and order of user messages, ``--turns`` turns of
``--concurrent-max-tokens``) through a third engine whose prefix cache has a
small budget (``--concurrent-budget-bytes``; default: four snapshots of the
sequential chat's mean size), so chats evict each other's snapshots. Reported:
the cache's high-water mark against its budget (the goal: never above it), its
evictions and hits, and whether every turn's output and acceptance equal a
cold engine's on the same prompt.

Writes ``benchmarks/results/chat.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: record.py, the results' one writer
from record import write_result

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "chat.json"
SYSTEM = (  # what chat UIs and editor plugins send first: a standing instruction every turn repeats
    "You are a careful Python programmer. Answer with code first, then at most two short sentences. Use the"
    " standard library only, type hints on every function, pathlib for paths, and f-strings for formatting."
    " Prefer small functions with docstrings that say why, not what. Raise precise exceptions with messages"
    " that name the offending value. Never print from library code; use the logging module. Keep lines under"
    " 100 characters. When you change code from an earlier answer, show the whole function again."
)
USER = [
    "Write a Python function that reads a JSON file and returns its contents.",
    "Now make it return an empty dict when the file does not exist.",
    "Add a docstring and type hints.",
    "Write a test for it with pytest.",
    "Make the path argument accept str or pathlib.Path.",
    "Log a warning when the file is empty.",
]


def timed(engine, req) -> tuple[float, object]:
    """Seconds from the request's start to its first committed token, and the finished Generation."""
    t0 = time.perf_counter()
    with engine.start(req) as run:
        next(run)
        ttft = time.perf_counter() - t0
        for _ in run:
            pass
    return ttft, run.result


def concurrent_chats(make_engine, cold, codec, args) -> dict:
    """``args.concurrent`` conversations at once through the engine ``make_engine()`` builds, on one compute
    thread as a server runs them (MLX arrays stay on the thread that made them), then every turn again on
    ``cold``; the prefix cache's budget, high-water mark and counters."""
    import threading

    from kakeya.core.request import Request
    from kakeya.orchestrator.decode.engine import RunOptions
    from kakeya.runtime.compute import ComputeThread

    compute = ComputeThread("chat-benchmark")
    engine = compute.run(make_engine)
    options = RunOptions(step=compute.run)
    results, errors = {}, []

    def chat(k: int) -> None:
        messages, turns = ([] if args.no_system else [{"role": "system", "content": SYSTEM}]), []
        try:
            for t in range(args.turns):
                text = USER[(k + t) % len(USER)]
                messages.append({"role": "user", "content": f"Session {k}. {text}" if t == 0 else text})
                prompt = codec.encode_chat(messages)
                gen = engine.generate(Request(list(prompt), args.concurrent_max_tokens, args.block_size), options)
                turns.append(gen)
                messages.append({"role": "assistant", "content": codec.decode(gen.token_ids)})
        except Exception as exc:  # noqa: BLE001 -- reported in the results
            errors.append(f"chat {k}: {exc}")
        results[k] = turns

    t0 = time.perf_counter()
    threads = [threading.Thread(target=chat, args=(k,)) for k in range(args.concurrent)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    compute.shutdown()
    identical = True
    for turns in results.values():
        for gen in turns:
            again = cold.generate(Request(list(gen.prompt_ids), args.concurrent_max_tokens, args.block_size))
            identical &= gen.token_ids == again.token_ids and gen.acceptance_lengths == again.acceptance_lengths
    gens = [g for turns in results.values() for g in turns]
    stats = engine.verifier.prefixes.stats()
    return {
        "chats": args.concurrent, "turns": args.turns, "max_tokens": args.concurrent_max_tokens,
        "wall_s": round(wall, 2), "errors": errors[:3],
        "prompt_tokens": sum(len(g.prompt_ids) for g in gens), "cached_tokens": sum(g.cached_tokens for g in gens),
        "identical_to_cold": identical, "prefix_cache": stats,
        "within_budget": stats["peak_bytes"] <= stats["budget_bytes"],
    }  # fmt: skip


def main(argv=None) -> int:
    from kakeya.core.prefix import PrefixCache, common_prefix
    from kakeya.core.request import Request
    from kakeya.orchestrator.assembly import build_local_engine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None, help="target checkpoint (default: the embedded demo pair's)")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--backend", default="torch", choices=["torch", "mlx"])
    ap.add_argument("--device", default=None, help="torch: cpu (default where no GPU), cuda, mps")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=192, help="per answer")
    ap.add_argument("--no-system", action="store_true", help="no system message (its share of every prompt is cached)")
    ap.add_argument("--block-size", type=int, default=8, help="0: auto (adaptive, which learns across requests)")
    ap.add_argument("--rounds", type=int, default=3, help="timed runs per turn and engine (medians reported)")
    ap.add_argument("--prefix-cache-bytes", type=int, default=1 << 30)
    ap.add_argument("--concurrent", type=int, default=16, help="conversations at once in the budget phase (0: none)")
    ap.add_argument("--concurrent-max-tokens", type=int, default=64, help="per answer, in the budget phase")
    ap.add_argument(
        "--concurrent-budget-bytes",
        type=int,
        default=0,
        help="the budget phase's prefix cache (0: four snapshots of the sequential chat's mean size)",
    )
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    if not 1 <= args.turns <= len(USER):
        ap.error(f"--turns must be in 1..{len(USER)}")

    kw = {"device": args.device} if args.backend == "torch" and args.device else {}
    pair = (args.target, args.draft, args.backend)
    prefixes = PrefixCache(args.prefix_cache_bytes)
    cached = build_local_engine(*pair, prefixes=prefixes, **kw)
    cold = build_local_engine(*pair, **kw)
    codec = cached.codec
    if codec is None or codec.chat is None:
        raise SystemExit("chat.py: the target checkpoint ships no tokenizer or no chat template")
    for engine in (cached, cold):  # warm-up, outside the figures (and outside the conversation's prefixes)
        engine.generate(Request(codec.encode("warm up"), 4, args.block_size, ignore_eos=True))

    messages, turns = ([] if args.no_system else [{"role": "system", "content": SYSTEM}]), []
    seen: list[int] = []  # the previous turn's prompt + answer: what any prefix cache could at most reuse
    for t in range(args.turns):
        messages.append({"role": "user", "content": USER[t]})
        prompt = codec.encode_chat(messages)
        history = common_prefix(prompt, seen)
        runs = {"cached": [], "cold": []}
        for r in range(args.rounds):
            for name in ("cached", "cold") if r % 2 == 0 else ("cold", "cached"):
                req = Request(list(prompt), args.max_tokens, args.block_size)
                runs[name].append(timed(cached if name == "cached" else cold, req))
        hit, miss = runs["cached"][0][1], runs["cold"][0][1]
        ttft = {name: statistics.median(s for s, _ in rs) for name, rs in runs.items()}
        same = all(g.token_ids == miss.token_ids for _, g in runs["cached"] + runs["cold"])
        turns.append({
            "turn": t + 1, "prompt_tokens": len(prompt), "completion_tokens": len(hit.token_ids),
            "cached_tokens": [g.cached_tokens for _, g in runs["cached"]],
            "cached_share": round(hit.cached_tokens / len(prompt), 4),
            "history_tokens": history,  # the prompt's prefix that is the last turn's prompt + answer
            "cached_of_history": round(hit.cached_tokens / history, 4) if history else None,
            "ttft_cached_s": round(ttft["cached"], 5), "ttft_cold_s": round(ttft["cold"], 5),
            "ttft_ratio": round(ttft["cached"] / ttft["cold"], 4),
            "acceptance_cached": round(hit.mean_acceptance, 4), "acceptance_cold": round(miss.mean_acceptance, 4),
            "acceptance_lengths_equal": hit.acceptance_lengths == miss.acceptance_lengths,
            "identical_output": same,
        })  # fmt: skip
        print(json.dumps(turns[-1]), flush=True)
        messages.append({"role": "assistant", "content": codec.decode(hit.token_ids)})
        seen = list(prompt) + list(hit.token_ids)

    crowd = None
    if args.concurrent:
        held = prefixes.stats()
        budget = args.concurrent_budget_bytes or 4 * held["bytes"] // max(1, held["entries"])
        print(
            f"{args.concurrent} conversations at once, prefix cache budget {budget} bytes ...",
            file=sys.stderr,
            flush=True,
        )
        crowd = concurrent_chats(
            lambda: build_local_engine(*pair, prefixes=PrefixCache(budget), **kw), cold, codec, args
        )
        print(json.dumps(crowd), flush=True)

    later = turns[1:]
    result = {
        "benchmark": "chat", "target": cached.target, "draft": cached.draft, "backend": cached.verifier.info.backend,
        "device": cached.device, "machine": platform.machine(),
        "turns": turns, "max_tokens": args.max_tokens, "block_size": args.block_size, "rounds": args.rounds,
        "prefix_cache": prefixes.stats(),
        "concurrent": crowd,
        "goals": {
            "cached_share_min": min((x["cached_share"] for x in later), default=None),
            "cached_of_history_min": min((x["cached_of_history"] for x in later), default=None),
            "ttft_ratio_max": max((x["ttft_ratio"] for x in later), default=None),
            "identical_output": all(x["identical_output"] for x in turns),
            "acceptance_equal": all(x["acceptance_lengths_equal"] for x in turns),
            "concurrent_within_budget": None if crowd is None else crowd["within_budget"],
            "concurrent_identical": None if crowd is None else crowd["identical_to_cold"] and not crowd["errors"],
        },
        "command": "python benchmarks/chat.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, result)
    print(json.dumps(result["goals"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
