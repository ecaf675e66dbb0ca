"""Where a block's candidates come from, and what each source commits: is the demo drafter the limit?

    python benchmarks/draft_sources.py [--prompts 32] [--block-sizes 8 16] [--corpus-min-match 4 8]

Greedy, torch CPU, the demo pair, the model card's held-out prompts (``drafter_eval.heldout_prompts``:
the same 32 prompts, 128 new tokens). Per block size it runs the real loop with the candidates taken from:

- ``drafter``: the drafter alone (n-gram copies off: the card's figure);
- ``engine``: what ships (``orchestrator/proposers.py``: a copy where the context's last 3-8 tokens occurred
  before in the prompt or output, else the drafter's block);
- ``oracle``: at every block, whichever of that copy and the drafter's block matches more of the target's
  greedy continuation (known from the block-size-1 run). No rule that picks one of the two per block
  from what the loop knows can do better block by block, so it bounds what a smarter choice could buy
  (a bound per block, not over a whole generation: a different choice moves where later blocks start);
- ``corpus_N``: the shipped engine, and where the prompt lookup finds nothing, a lookup in the target's
  *training* corpus (retrieval drafting, as REST does): the context's longest suffix of N..12 tokens that
  occurs there at least twice, continued token by token while one continuation holds at least half of the
  occurrences that are still in the running.

Every run is checked against block size 1 (the target's greedy tokens). Reports, per source and block
size, the tokens committed per block pooled over every block (as ``drafter_eval`` and the card count
them), the share of blocks whose candidates were a copy, and the median decode tok/s (a noisy shared
CPU: for the cost of a lookup, not for ratios). Writes ``benchmarks/results/draft_sources.json``.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: record.py, the results' one writer
from record import write_result

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "draft_sources.json"
MAX_SUFFIX = 12  # longest context suffix the corpus lookup hashes


class CorpusLookup:
    """Continuations of a context's suffix in a fixed token corpus: for each suffix length, the sorted
    hashes of every n-gram of the corpus beside where it ends, so a lookup is two binary searches."""

    _MUL = np.uint64(1_000_003)

    def __init__(self, tokens: np.ndarray, min_match: int, min_support: int = 2, min_share: float = 0.5):
        self.tokens = np.asarray(tokens, dtype=np.int64)
        self.min_match, self.min_support, self.min_share = min_match, min_support, min_share
        self._by_len: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        n_tok = self.tokens.size
        for n in range(min_match, MAX_SUFFIX + 1):
            if n_tok <= n:
                break
            h = np.zeros(n_tok - n + 1, dtype=np.uint64)
            for j in range(n):  # h[i] hashes tokens[i : i + n] (wrapping uint64 arithmetic)
                h = h * self._MUL + (self.tokens[j : n_tok - n + 1 + j].astype(np.uint64) + np.uint64(1))
            order = np.argsort(h, kind="stable")
            self._by_len[n] = (h[order], order + n)  # the hash, and the index just past that n-gram

    def _hash(self, gram) -> np.uint64:
        h = np.uint64(0)
        with np.errstate(over="ignore"):
            for t in gram:
                h = h * self._MUL + np.uint64(t + 1)
        return h

    def propose(self, context, k: int) -> tuple[int, ...]:
        """Up to ``k`` tokens to follow ``context``, from its longest suffix found ``min_support`` times or more."""
        for n in sorted(self._by_len, reverse=True):
            if len(context) < n:
                continue
            hashes, ends = self._by_len[n]
            h = self._hash(context[-n:])
            lo, hi = np.searchsorted(hashes, h, "left"), np.searchsorted(hashes, h, "right")
            if hi - lo < self.min_support:
                continue
            ends = ends[lo:hi]
            ends = ends[ends + k <= self.tokens.size]
            out: list[int] = []
            for j in range(k):
                nxt = self.tokens[ends + j]
                values, counts = np.unique(nxt, return_counts=True)
                best = int(counts.argmax())
                if counts[best] < max(self.min_support, self.min_share * ends.size):
                    break
                out.append(int(values[best]))
                ends = ends[nxt == values[best]]
            return tuple(out)
        return ()


def _sourced_decode(base, source: str, reference: dict, corpus: CorpusLookup | None):
    """A subclass of the loop's ``Decode`` (``base``) whose candidates come from ``source``: a corpus lookup
    is one more proposer after the n-gram copy; the oracle swaps the drafter's block for the context's copy
    where the reference says the copy matches more."""
    from kakeya.core.contract import Draft
    from kakeya.core.request import MAX_BLOCK_SIZE
    from kakeya.orchestrator.proposers import NGRAM, NgramIndex, Proposal

    class CorpusProposer:
        def propose(self, state):
            copy = corpus.propose([*state.prompt_ids, *state.committed], MAX_BLOCK_SIZE - 1)
            size = min(state.size(True), state.room)
            if not copy or size < 2:
                return None
            return Proposal(tuple(copy[: size - 1]), NGRAM, "the corpus continues the context's last tokens")

    class Sourced(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.lookup = NgramIndex()  # the oracle's copy, beside the drafter's block (copies are off then)
            if corpus is not None:  # after the context's own copy, before the drafter
                self.proposers.insert(len(self.proposers) - 1, CorpusProposer())

        def drafted(self, result):
            super().drafted(result)
            draft = self._draft
            if source != "oracle" or isinstance(result, BaseException) or not draft.tokens:
                return
            gen = self.generation  # the drafter's block (copies are off) against a copy, by the reference
            copy = self.lookup.propose([*gen.prompt_ids, *gen.token_ids], len(draft.tokens))
            target = reference["tokens"][len(gen.token_ids) :]

            def matched(cands) -> int:
                n = 0
                while n < len(cands) and n < len(target) and cands[n] == target[n]:
                    n += 1
                return n

            if copy and matched(copy) > matched(draft.tokens):
                self._draft = Draft(tuple(copy))
                self.proposal = Proposal(tuple(copy), NGRAM, "the oracle: the copy matches the reference further")

    return Sourced


def measure(
    prompts: list[list[int]],
    block_sizes,
    max_tokens: int,
    corpus_tokens: np.ndarray,
    corpus_min_match=(4, 8),
    pair=None,
) -> dict:
    from kakeya.core.request import Request
    from kakeya.orchestrator.assembly import build_local_engine, set_torch_threads
    from kakeya.orchestrator.decode import engine as engine_mod
    from kakeya.orchestrator.decode.engine import RunOptions

    set_torch_threads(1, "cpu", embedded=True)
    target, draft = (None, None) if pair is None else (str(pair.target), str(pair.draft))
    engine = build_local_engine(target, draft, "torch", "cpu")
    engine.generate(Request(prompts[0], max_tokens=16, block_size=0, ignore_eos=True))  # warm-up
    refs = [
        engine.generate(Request(p, max_tokens=max_tokens, block_size=1, ignore_eos=True)).token_ids for p in prompts
    ]
    lookups = {}
    for n in corpus_min_match:
        t0 = time.perf_counter()
        lookups[f"corpus_{n}"] = CorpusLookup(corpus_tokens, n)
        print(
            f"corpus lookup from {n} tokens: indexed in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True
        )
    sources = ["drafter", "engine", "oracle", *lookups]
    base = engine_mod.Decode
    out: dict = {}
    try:
        for B in block_sizes:
            row = {}
            for source in sources:
                reference: dict = {}
                engine_mod.Decode = _sourced_decode(base, source, reference, lookups.get(source))
                lengths, copied, tok_s, lossless = [], [], [], True
                for p, ref in zip(prompts, refs):
                    reference["tokens"] = ref
                    g = engine.generate(
                        Request(p, max_tokens=max_tokens, block_size=B, ignore_eos=True),
                        RunOptions(ngram=source not in ("drafter", "oracle")),
                    )
                    lossless &= g.token_ids == ref
                    lengths += g.acceptance_lengths
                    copied += [b.copied for b in g.blocks[1:]]
                    tok_s.append(g.decode_tok_s)
                row[source] = {
                    "tokens_per_block": round(float(np.mean(lengths)), 4),
                    "blocks": len(lengths),
                    "copied_share": round(float(np.mean(copied)), 4),
                    "median_decode_tok_s": round(statistics.median(tok_s), 1),
                    "lossless_vs_block1": bool(lossless),
                }
                print(f"block {B} {source}: {row[source]}", file=sys.stderr, flush=True)
            out[str(B)] = row
    finally:
        engine_mod.Decode = base
    return out


def _shown(path) -> str:
    """A checkpoint directory as a result names it: relative to the repository when inside it."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def card_setup(name: str, argv, args) -> tuple:
    """The pair (``--target``/``--draft`` when the script has them and they are given, else the embedded one), its
    corpus, the model card's held-out prompts (``--prompts``, ``--prompt-len``) and a result's header: what ran
    (``--max-tokens`` too), on which pair and machine, when."""
    from kakeya.checkpoints.tiny import TinyPair, embedded_pair
    from kakeya.training import data
    from kakeya.training.drafter_eval import heldout_prompts

    given = getattr(args, "target", None)
    pair = TinyPair(Path(given), Path(args.draft)) if given else embedded_pair()
    corpus = data.load_corpus(data.target_tokenizer(Path(pair.target)))
    prompts = heldout_prompts(corpus, args.prompts, args.prompt_len)
    header = {
        "benchmark": name,
        "command": f"python benchmarks/{name}.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "pair": {"target": _shown(pair.target), "draft": _shown(pair.draft)},
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine()},
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "prompts": {"held_out": len(prompts), "prompt_len": args.prompt_len, "max_tokens": args.max_tokens},
    }
    return pair, corpus, prompts, header


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32, help="held-out prompts (the card's: 32)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[8, 16])
    ap.add_argument(
        "--corpus-min-match",
        type=int,
        nargs="*",
        default=[4, 8],
        help="a corpus_N source for each: the shortest suffix the training-corpus lookup trusts",
    )
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)

    _, corpus, prompts, header = card_setup("draft_sources", argv, args)
    res = header | {
        "corpus": {"train_tokens": int(corpus.train.size), "source": corpus.summary()["source"]},
        "notes": "tokens_per_block: committed tokens per block, pooled over the prompts (the card's count); "
        "oracle: per block, the better of the prompt copy and the drafter's block against the target's "
        "greedy continuation; corpus_N: the engine, plus a training-corpus lookup from N..12 tokens where "
        "the prompt lookup finds nothing",
        "per_block_size": measure(prompts, args.block_sizes, args.max_tokens, corpus.train, args.corpus_min_match),
    }
    write_result(args.out, res)
    for B, row in res["per_block_size"].items():
        print(
            f"block {B}: "
            + ", ".join(f"{s} {v['tokens_per_block']:.2f}" for s, v in row.items())
            + f"; lossless {all(v['lossless_vs_block1'] for v in row.values())}"
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
