"""What a forward pays for the idle time before it: a verify of 8 back to back, after a gap asleep, after a gap spinning.

In a split, each server sleeps while the other works (the verifier through the draft, the drafter
through the verify); colocated, one process runs draft and verify back to back and never idles.
This times the same verify of 8 on the demo target in one process, three ways in turn: back to
back, after ``--gap-ms`` asleep (``time.sleep``, as a server waiting for its next request), and
after ``--gap-ms`` spinning (the core kept busy). If the asleep case is slower than the spinning
one, the forward pays for the idle core itself (its caches, its clock, a virtual CPU the host
descheduled), which no change to the messages can remove.

    python benchmarks/idle_forward.py                    # demo pair, torch CPU, one thread, gap 2 ms
    python benchmarks/idle_forward.py --gap-ms 1 5 --rounds 5

Writes benchmarks/results/idle_forward.json: per gap, the median ms of each way over
``--rounds`` alternations (each ``--sessions`` x ``--steps`` verifies), and asleep / back to back.
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


def verifies_ms(engine, gap_s: float, spin: bool, sessions: int = 3, steps: int = 60) -> list[float]:
    """Milliseconds of each verify of 8 (one draft block, decided and committed), each after ``gap_s``."""
    from kakeya.core.contract import Draft

    out = []
    for _ in range(sessions):
        s = engine.verifier.open_session()
        s.prefill(list(range(5, 68)))
        for _ in range(steps):
            if gap_s and spin:
                end = time.perf_counter() + gap_s
                while time.perf_counter() < end:
                    pass
            elif gap_s:
                time.sleep(gap_s)
            t0 = time.perf_counter()
            s.decide(7, Draft((9, 10, 11, 12, 13, 14, 15)))
            out.append((time.perf_counter() - t0) * 1e3)
        s.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gap-ms", type=float, nargs="+", default=[2.0], help="idle time before each verify")
    ap.add_argument("--rounds", type=int, default=4, help="alternations of the three ways")
    ap.add_argument("--sessions", type=int, default=3, help="sessions per way and round")
    ap.add_argument("--steps", type=int, default=60, help="verifies per session")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "idle_forward.json"))
    args = ap.parse_args(argv)

    from kakeya.checkpoints.tiny import demo_pair
    from kakeya.orchestrator.assembly import build_local_engine, set_torch_threads

    pair = demo_pair()
    set_torch_threads(1, "cpu", True)  # as the product runs the demo pair on a CPU
    engine = build_local_engine(str(pair.target), str(pair.draft), "torch", "cpu")
    verifies_ms(engine, 0.0, False, sessions=1, steps=20)  # warm-up
    ways = {"back_to_back": (False, False), "asleep": (True, False), "spinning": (True, True)}
    gaps = {}
    for gap_ms in args.gap_ms:
        got: dict[str, list[float]] = {w: [] for w in ways}
        for r in range(args.rounds):
            for way, (gapped, spin) in ways.items():
                got[way] += verifies_ms(engine, gap_ms / 1e3 if gapped else 0.0, spin, args.sessions, args.steps)
            print(f"gap {gap_ms:g} ms, round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
        med = {w: round(statistics.median(v), 3) for w, v in got.items()}
        gaps[f"{gap_ms:g}"] = {"verify_ms_median": med, "asleep_over_back_to_back": round(med["asleep"] / med["back_to_back"], 3),
                               "asleep_over_spinning": round(med["asleep"] / med["spinning"], 3), "verifies": len(got["asleep"])}  # fmt: skip
    out = {
        "benchmark": "idle_forward",
        "pair": "embedded demo pair",
        "backend": "torch",
        "device": "cpu",
        "torch_threads": 1,
        "block": 8,
        "gaps": gaps,
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": "python benchmarks/idle_forward.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_result(path, out)
    print(json.dumps(gaps))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
