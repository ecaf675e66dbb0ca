"""What a drafter forward costs next to a target AR step, per backend: the pair's shape, measured.

    python benchmarks/pair_cost.py                                  # torch CPU and MLX CPU, the embedded pair
    python benchmarks/pair_cost.py --backends torch --device cuda --dtype bfloat16 --out benchmarks/results/pair_cost_cuda.json
    python benchmarks/pair_cost.py --target OUT/target --draft OUT/draft   # a candidate pair, before shipping it

Speculative decoding pays only when drafting is cheap next to the target: a block of ``B``
costs ``t_draft(B) + t_verify(B)`` and commits ``E(B)`` tokens, against ``E(B)`` AR steps.
For each backend this loads the pair once, opens one verifier and one drafter session on a
prompt, and times, interleaved so machine noise falls on all alike: an AR step (a verify of one
token plus its commit), a draft of ``B`` positions, and a verify of ``B`` positions plus its
commit, for each ``B`` in ``--sizes``. Every shape runs untimed first (a first call pays for
allocations and graph building). Reported: the median milliseconds and the ratios
``draft(B) / AR`` (the issue's "at most a quarter") and ``verify(B) / AR``. The model card
quotes this file.

Writes ``benchmarks/results/pair_cost.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: record.py, the results' one writer
from record import write_result

ROOT = Path(__file__).resolve().parents[1]


def measure(
    backend: str, target: str | None, draft: str | None, device: str, dtype: str | None, sizes: list[int], repeats: int
) -> dict:
    from kakeya.core.contract import Draft
    from kakeya.orchestrator.assembly import build_local_engine, set_torch_threads

    if backend == "torch" and device == "cpu":
        set_torch_threads(1, "cpu", embedded=target is None)
    torch_device = device if backend == "torch" else None
    engine = build_local_engine(target, draft, backend, torch_device, dtype if backend == "torch" else None)
    vocab = engine.verifier.info.vocab_size
    prompt = [(7 * i + 3) % vocab for i in range(64)]
    vs, ds = engine.verifier.open_session(), engine.drafter.open_session()
    clock = time.perf_counter
    times: dict[str, list[float]] = (
        {"ar_step": []} | {f"draft_{b}": [] for b in sizes} | {f"verify_{b}": [] for b in sizes}
    )
    try:
        last, aux = vs.prefill(prompt)

        def ar_step() -> float:
            nonlocal last, aux
            t0 = clock()
            verdict = vs.decide(last, Draft(()))
            t1 = clock()
            last, aux = verdict.next_token, verdict.aux
            return t1 - t0

        def draft_and_verify(b: int) -> tuple[float, float]:
            nonlocal last, aux
            t0 = clock()
            draft = ds.draft(aux, last, b)
            t1 = clock()
            verdict = vs.decide(last, draft)  # verify the block in one forward and keep its accepted prefix
            t2 = clock()
            last, aux = verdict.next_token, verdict.aux
            return t1 - t0, t2 - t1

        ar_step()
        for b in sizes:
            draft_and_verify(b)
        for r in range(repeats):
            times["ar_step"].append(ar_step())
            for b in sizes if r % 2 == 0 else sizes[::-1]:
                d, v = draft_and_verify(b)
                times[f"draft_{b}"].append(d)
                times[f"verify_{b}"].append(v)
    finally:
        vs.close()
        ds.close()
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    ar = ms["ar_step"]
    return {
        "backend": engine.verifier.info.backend,
        "device": engine.device or "cpu",
        "median_ms": {k: round(v, 4) for k, v in ms.items()},
        "draft_over_ar": {str(b): round(ms[f"draft_{b}"] / ar, 3) for b in sizes},
        "verify_over_ar": {str(b): round(ms[f"verify_{b}"] / ar, 3) for b in sizes},
        "target_layers": engine.verifier.info.num_layers,
        "repeats": repeats,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", nargs="+", default=["torch", "mlx"], choices=["torch", "mlx"])
    p.add_argument("--target", default=None, help="target checkpoint (default: the embedded demo pair)")
    p.add_argument("--draft", default=None)
    p.add_argument("--device", default="cpu", help="torch's device")
    p.add_argument("--dtype", default=None, help="torch's dtype (default float32)")
    p.add_argument("--sizes", default="8,16")
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "pair_cost.json")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    result = {
        "benchmark": "pair_cost",
        "command": " ".join(["python benchmarks/pair_cost.py", *(sys.argv[1:] if argv is None else argv)]),
        "machine": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "pair": {"target": args.target or "embedded demo", "draft": args.draft or "embedded demo"},
        "backends": {},
    }
    for backend in args.backends:
        if backend == "mlx":
            from kakeya.orchestrator.assembly import require_backend

            require_backend("mlx")
        r = measure(backend, args.target, args.draft, args.device, args.dtype, sizes, args.repeats)
        result["backends"][f"{backend}/{r['device']}"] = r
        print(
            f"{backend}/{r['device']}: AR step {r['median_ms']['ar_step']:.3f} ms, draft/AR {r['draft_over_ar']}, "
            f"verify/AR {r['verify_over_ar']}",
            file=sys.stderr,
            flush=True,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
