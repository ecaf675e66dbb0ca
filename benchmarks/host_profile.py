"""Where the host's time goes in one speculative decode of the embedded demo pair (cProfile).

    python benchmarks/host_profile.py [--device cuda] [--block-size 8] [--max-tokens 256]

On a GPU a tiny pair is bound by Python and launches, not by the device: this
prints the functions with the most own time (and cumulative time) over one
warmed-up decode, so the host overhead per block can be read off.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args()

    from kakeya.core.request import Request
    from kakeya.orchestrator.assembly import build_local_engine

    engine = build_local_engine(None, None, "torch", args.device, args.dtype)
    prompt = engine.codec.encode("def load(path):\n    ") if hasattr(engine, "codec") else [2, 500, 441]
    req = Request(prompt, max_tokens=args.max_tokens, block_size=args.block_size, ignore_eos=True)
    for _ in range(2):
        engine.generate(req)  # warm-up: graphs captured, caches sized
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    g = engine.generate(req)
    prof.disable()
    wall = time.perf_counter() - t0
    print(
        f"{len(g.token_ids)} tokens in {len(g.blocks)} blocks, {wall * 1e3:.1f} ms "
        f"({wall / max(1, len(g.blocks)) * 1e3:.3f} ms per block, {g.decode_tok_s:.0f} tok/s)"
    )
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(args.top)
        print(s.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
