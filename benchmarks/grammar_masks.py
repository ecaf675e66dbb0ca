"""Token-mask cost per token of the two grammar libraries, on the demo pair's tokenizer.

    python benchmarks/grammar_masks.py [--repeats 20]

For each case of the constrained tests (``tests/constrained/cases.py``: JSON schemas and regexes), a valid
output is tokenized with the demo tokenizer and replayed token by token through each library's matcher:
compute the mask of allowed tokens, then consume the token -- what the verifier does per position. Reports
the median microseconds per token (mask + consume) over ``--repeats`` replays, and each grammar's compile
time, for llguidance (what Kakeya uses, ``core/constraints.py``) and xgrammar (when it imports). Both are
held to the same JSON style (no free whitespace, ``", "`` and ``": "`` separators). Writes
``benchmarks/results/grammar_masks.json``.
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
sys.path.insert(0, str(ROOT))

# one valid output per case (what the replay consumes)
OUTPUTS = {
    "person": '{"name": "Ada", "age": 36, "tags": ["admin", "user"]}',
    "nested": '{"id": "beef", "point": {"x": 1.5, "y": -2}, "note": "hi", "ok": true}',
    "list": "[1, 22, 333]",
    "phone": "(555) 123-4567",
    "ident": "make_thing()",
    "date": "2024-07",
}


def _llguidance(tok_json: str, vocab: int, eos: int, cases: dict, repeats: int) -> dict:
    import numpy as np

    from kakeya.core.constraints import Grammar, tokenizer

    tok = tokenizer(tok_json, vocab, (eos,))
    out = {}
    for name, (c, ids) in cases.items():
        t0 = time.perf_counter()
        g = Grammar(c.grammar(), tok)
        compile_s = time.perf_counter() - t0
        row = np.zeros(g.words, np.int32)
        per = []
        for _ in range(repeats):
            g.matcher.reset()
            t0 = time.perf_counter()
            for t in ids:
                g._fill(row)
                assert g.matcher.consume_token(t), (name, t)
            per.append((time.perf_counter() - t0) / len(ids))
        out[name] = {"us_per_token": round(statistics.median(per) * 1e6, 2), "compile_ms": round(compile_s * 1e3, 2)}
    return out


def _xgrammar(target: Path, vocab: int, eos: int, cases: dict, repeats: int) -> dict:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(target / "tokenizer.json"))
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info)
    out = {}
    for name, (c, ids) in cases.items():
        t0 = time.perf_counter()
        if c.kind == "json_schema":
            compiled = compiler.compile_json_schema(json.dumps(c.spec), any_whitespace=False, separators=(", ", ": "))
        else:
            compiled = compiler.compile_regex(c.spec)
        compile_s = time.perf_counter() - t0
        bitmask = xgr.allocate_token_bitmask(1, vocab)
        per = []
        for _ in range(repeats):
            m = xgr.GrammarMatcher(compiled)
            t0 = time.perf_counter()
            for t in ids:
                m.fill_next_token_bitmask(bitmask)
                assert m.accept_token(t), (name, t)
            per.append((time.perf_counter() - t0) / len(ids))
        out[name] = {"us_per_token": round(statistics.median(per) * 1e6, 2), "compile_ms": round(compile_s * 1e3, 2)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "grammar_masks.json"))
    args = ap.parse_args(argv)

    from tokenizers import Tokenizer

    from kakeya.checkpoints.config import load_target_config
    from kakeya.checkpoints.tiny import demo_pair
    from tests.constrained.cases import constraints

    target = Path(demo_pair().target)
    cfg = load_target_config(target)
    vocab, eos = int(cfg["vocab_size"]), int(cfg["eos_token_id"][0])
    tok = Tokenizer.from_file(str(target / "tokenizer.json"))
    all_cases = constraints()
    cases = {n: (all_cases[n], tok.encode(text, add_special_tokens=False).ids) for n, text in OUTPUTS.items()}
    result = {
        "what": "grammar mask + consume per token, replaying a valid output (median of repeats)",
        "tokenizer": f"demo pair ({vocab} tokens)",
        "machine": platform.machine(),
        "tokens": {n: len(ids) for n, (_, ids) in cases.items()},
        "llguidance": _llguidance(tok.to_str(), vocab, eos, cases, args.repeats),
    }
    try:
        result["xgrammar"] = _xgrammar(target, vocab, eos, cases, args.repeats)
    except ImportError as exc:
        result["xgrammar"] = f"not measured: {exc}"
    for lib in ("llguidance", "xgrammar"):
        if isinstance(result[lib], dict):
            result[f"{lib}_median_us_per_token"] = statistics.median(v["us_per_token"] for v in result[lib].values())
    write_result(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k.endswith("per_token")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
