"""``kakeya niah``: needle-in-a-haystack recall per verifier cache policy, vs ``native``.

    kakeya niah --target DIR --draft DIR --contexts 1024 2048 --depths 0.1 0.5 0.9 \\
        --policies native sink-window sink-window+kv8 [--restore DIR] [--json]

Each case is about ``context`` tokens of haystack (the standard library's docstrings: prose, offline) with ``The secret
code is NNNN.`` inserted at ``depth``, then a question whose answer starts the generation; it is recalled when the
digits appear within ``--max-tokens``. Policies: ``native``, ``sink-window``, each optionally ``+kv8`` / ``+kv4`` and
``+restore`` (f_theta, sink-window only). On random models recall is ~0: this only proves the machinery.
"""

from __future__ import annotations

import ast
import sysconfig
from pathlib import Path

NEEDLE = "The secret code is {code}."
QUESTION = "\n\nQuestion: What is the secret code mentioned in the text above?\nAnswer: The secret code is"
TINY_NOTE = (
    "recall only means something on a trained checkpoint; on tiny random models it is ~0 under every "
    "policy (native included) and this run only proves the machinery"
)


def haystack_lines(min_chars: int) -> list[str]:
    """Prose lines from standard-library module docstrings, in a fixed order, at least ``min_chars`` long in all."""
    root = Path(sysconfig.get_paths()["stdlib"])
    lines, total = [], 0
    for f in sorted(root.glob("*.py")):
        try:
            doc = ast.get_docstring(ast.parse(f.read_text(encoding="utf-8", errors="replace")))
        except (SyntaxError, ValueError):
            continue
        for line in (doc or "").splitlines():
            line = line.strip()
            if len(line) > 20 and not any(ch.isdigit() for ch in line):  # no stray codes in the hay
                lines.append(line)
                total += len(line) + 1
        if total >= min_chars:
            return lines
    if not lines:
        raise FileNotFoundError(f"no docstrings found under {root} for the haystack")
    while total < min_chars:  # a short standard library: repeat it
        lines, total = lines + lines, total * 2
    return lines


def needle_code(context: int, depth: float, seed: int = 0) -> str:
    return str(1000 + (context * 7919 + round(depth * 1000) * 104729 + seed * 15485863) % 9000)


def needle_distance(codec, ids: list[int], code: str) -> int | None:
    """Tokens from the needle's code to the prompt's end: past the verifier's window, only a full
    layer (or a restored band) can still see it. None if the code's tokens are not found as such."""
    bos = 1 if codec.add_bos and codec.bos_id is not None else 0
    want = codec.encode(f" {code}.")[bos:]
    for at in range(len(ids) - len(want), -1, -1):
        if ids[at : at + len(want)] == want:
            return len(ids) - at
    return None


def build_prompt(codec, lines: list[str], context: int, depth: float, code: str) -> list[int]:
    """Token ids of at most ``context`` (and close to it) tokens: haystack, needle at ``depth``, question."""
    needle = NEEDLE.format(code=code)
    bos = 1 if codec.add_bos and codec.bos_id is not None else 0
    sizes = [len(ids) - bos + 1 for ids in (codec.encode(l) for l in lines[: 4 * context])]  # +1: newline

    def assemble(budget: int) -> list[int]:
        used, n = 0, 0
        while n < len(sizes) and used + sizes[n] <= budget:
            used, n = used + sizes[n], n + 1
        at = min(n, max(0, round(depth * n)))
        return codec.encode("\n".join(lines[:at] + [needle] + lines[at:n]) + QUESTION), n

    fixed = len(codec.encode(needle + QUESTION))
    budget = context - fixed
    ids, n = assemble(budget)
    for _ in range(4):  # per-line counts only estimate the joined text's: rescale towards the target
        if n == 0 or abs(len(ids) - context) <= max(2, context // 100) and len(ids) <= context:
            break
        budget = int(budget * (context - fixed) / max(1, len(ids) - fixed))
        ids, n = assemble(budget)
    while len(ids) > context and n > 0:
        budget -= max(1, (len(ids) - context))
        ids, n = assemble(budget)
    if n == 0:
        raise ValueError(f"context {context} is too small for a needle and a question ({fixed} tokens)")
    return ids


def parse_policy(name: str, sink: int, window: int, restore: str | None):
    from kakeya.core.request import CachePolicy

    base, *mods = name.split("+")
    if base not in ("native", "sink-window"):
        raise ValueError(f"policy {name!r}: must start with 'native' or 'sink-window'")
    bits, use_restore = 0, False
    for m in mods:
        if m in ("kv8", "kv4"):
            bits = int(m[2:])
        elif m == "restore":
            use_restore = True
        else:
            raise ValueError(f"policy {name!r}: unknown modifier {m!r} (kv8, kv4, restore)")
    if use_restore and not restore:
        raise ValueError(f"policy {name!r} needs --restore DIR (an f_theta directory)")
    restore = restore if use_restore else None
    if base == "native":
        return CachePolicy("native", full_kv_bits=bits, restore=restore)
    return CachePolicy("sink-window", sink=sink, window=window, full_kv_bits=bits, restore=restore)


def run_niah(
    engine, contexts, depths, policies: dict, max_tokens: int = 16, block_size: int = 0, seed: int = 0, log=None
) -> dict:
    """Recall per policy and per (context, depth). ``policies``: name -> CachePolicy."""
    from kakeya.orchestrator.decode.engine import Request

    codec = engine.codec
    lines = haystack_lines(max(contexts) * 8)
    window = engine.verifier.info.sliding_window
    for name, policy in policies.items():
        try:
            policy.resolve(window)
        except ValueError as exc:
            raise ValueError(f"policy {name}: {exc}") from exc
    coded = [(c, d, needle_code(c, d, seed)) for c in contexts for d in depths]
    cases = [(c, d, code, build_prompt(codec, lines, c, d, code)) for c, d, code in coded]
    out = {}
    for name, policy in policies.items():
        rows, grid = [], {}
        for context, depth, code, ids in cases:
            req = Request(ids, max_tokens=max_tokens, block_size=block_size, ignore_eos=False, cache_policy=policy)
            gen = engine.generate(req)
            text = codec.decode(gen.token_ids)
            hit = code in text
            kv_bytes = gen.verifier_stats.kv_bytes
            kv = {"sliding": kv_bytes.sliding, "full": kv_bytes.full, "restored": kv_bytes.restored}
            rows.append(
                {
                    "context": context,
                    "depth": depth,
                    "prompt_tokens": len(ids),
                    "needle": code,
                    "needle_distance": needle_distance(codec, ids, code),
                    "recalled": hit,
                    "output": text,
                    "mean_acceptance": round(gen.mean_acceptance, 3),
                    "kv_bytes": kv,
                }
            )
            grid.setdefault(str(context), {})[str(depth)] = 1.0 if hit else 0.0
            if log:
                log(f"{name} context {context} depth {depth}: {'recalled' if hit else 'missed'} ({text[:40]!r})")
        out[name] = {
            "label": policy.resolve(window).label,
            "bounded": policy.kind != "native",
            "recall": round(sum(r["recalled"] for r in rows) / len(rows), 4),
            "by_context": {c: round(sum(v.values()) / len(v), 4) for c, v in grid.items()},
            "by_depth": {str(d): round(sum(grid[str(c)][str(d)] for c in contexts) / len(contexts), 4) for d in depths},
            "grid": grid,
            "max_kv_bytes": {k: max(r["kv_bytes"].get(k, 0) for r in rows) for k in ("sliding", "full", "restored")},
            "cases": rows,
        }
    native = out.get("native")
    for name, row in out.items():
        row["recall_vs_native"] = None if native is None else round(row["recall"] - native["recall"], 4)
        if native is not None:
            row["grid_vs_native"] = {
                c: {d: v - native["grid"][c][d] for d, v in ds.items()} for c, ds in row["grid"].items()
            }
    return out
