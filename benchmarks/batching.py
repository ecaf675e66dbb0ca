"""What batching concurrent sessions buys at the model level: N verifies (and drafts) alone vs one batch.

    python benchmarks/batching.py                                   # demo pair, torch CPU
    python benchmarks/batching.py --device cuda --shape 26b --dtype bfloat16   # the MoE target's shape, random weights

For N = 1, 2, 4, 8, 16 sessions, each prefilled with ``--ctx`` positions: the
time of one step for all of them -- N ``verify`` + ``commit`` calls one after
another vs one ``verify_batch`` (``services/verifier/session.py``), and N
``draft`` calls vs one ``draft_batch`` (``services/drafter/session.py``) -- and
the aggregate positions per second each gives. The batched results are checked
against the alone ones (choices and drafts identical). No gRPC: this is the
ceiling the servers' compute threads reach when N steps queue up together.

On torch a batched verify is one step over the target's pooled K/V
(``verifier/torch_backend/batch_step.py``), and so is a batched draft over the
drafter's pooled context (``drafter/torch_backend/batch_step.py``): ``device_ops``
counts the aten ops (views left out) of one session's verify or draft and of the N
sessions' batched one, which stay the same as N grows. Writes
``benchmarks/results/batching[_<device>_<shape>].json``.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from kakeya.core.request import CachePolicy
from kakeya.drafter.session import DraftItem, draft_batch
from kakeya.verifier.session import LocalVerifierSession, VerifyItem, verify_batch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: record.py, the results' one writer
from record import write_result


def build(shape: str, device: str, dtype: str):
    if shape == "demo":
        from kakeya.drafter.local import TorchDrafter
        from kakeya.orchestrator.assembly import embedded_paths
        from kakeya.verifier.torch_backend.target import TargetTorch

        target_dir, draft_dir = embedded_paths()
        target = TargetTorch.load(target_dir, device, dtype)
        return target, TorchDrafter.colocated(draft_dir, target)
    from gpu_projection import DRAFT_26B, DRAFT_SMALL, GEMMA4_26B_A4B, SMALL, draft_config, random_drafter

    from kakeya.backends.torch.ops import resolve_device, resolve_dtype
    from kakeya.verifier.torch_backend.gemma4 import Gemma4Args
    from kakeya.verifier.torch_backend.target import TargetTorch

    t, d = (GEMMA4_26B_A4B, DRAFT_26B) if shape == "26b" else (SMALL, DRAFT_SMALL)
    target = TargetTorch.random(Gemma4Args(**t), resolve_device(device), resolve_dtype(dtype), seed=0)
    return target, random_drafter(draft_config(d, t["vocab_size"]), target)


class DeviceOps(TorchDispatchMode):
    """Counts dispatched aten ops that do work (views launch nothing and are left out)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += not func.is_view
        return func(*args, **(kwargs or {}))


def device_ops(fn) -> int:
    mode = DeviceOps()
    with mode:
        fn()
    return mode.n


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def median_time(fn, reps: int, device: str) -> float:
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(target, drafter, n: int, block: int, ctx: int, reps: int, device: str, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed + n)
    vocab = target.args.vocab_size
    aux_layers = drafter.target_layer_ids
    vs = [LocalVerifierSession(target, aux_layers, CachePolicy(slack=16)) for _ in range(n)]
    ds = [drafter.open_session() for _ in range(n)]
    blocks = []
    for v, d in zip(vs, ds):
        prompt = [2] + [int(t) for t in rng.integers(5, vocab, ctx - 1)]
        first, aux = v.prefill(prompt)
        d.draft(aux, first, 2)
        blocks.append([first] + [int(t) for t in rng.integers(5, vocab, block - 1)])
    one_aux = [aux[-1:].clone() for _ in range(n)]

    def verify_alone():
        out = [v.verify(b) for v, b in zip(vs, blocks)]
        for v in vs:
            v.commit(0)
        return out

    def verify_together():
        out = verify_batch([VerifyItem(v, b) for v, b in zip(vs, blocks)])
        for v in vs:
            v.commit(0)
        return out

    def draft_alone():
        return [d.draft(a, b[0], block) for d, a, b in zip(ds, one_aux, blocks)]

    def draft_together():
        return draft_batch([DraftItem(d, a, b[0], block) for d, a, b in zip(ds, one_aux, blocks)])

    for fn in (verify_alone, verify_together, draft_alone, draft_together):  # warm-up (graphs, allocator)
        fn()
    same_verify = verify_alone() == verify_together()
    # the drafts of one call each way, from twin caches (a draft extends its session's context)
    twins = [drafter.open_session() for _ in range(n)]
    for d, t in zip(twins, ds):
        d.cache.restore(t.cache.snapshot())
    same_draft = [d.draft(a, b[0], block) for d, a, b in zip(twins, one_aux, blocks)] == draft_together()
    for d in twins:
        d.close()
    t = {
        name: median_time(fn, reps, device)
        for name, fn in (
            ("verify_alone", verify_alone),
            ("verify_batch", verify_together),
            ("draft_alone", draft_alone),
            ("draft_batch", draft_together),
        )
    }

    def verify_one():
        vs[0].verify(blocks[0])
        vs[0].commit(0)

    ops = {
        "verify_one_session": device_ops(verify_one),
        "verify_batch": device_ops(verify_together),
        "draft_one_session": device_ops(lambda: ds[0].draft(one_aux[0], blocks[0][0], block)),
        "draft_batch": device_ops(draft_together),
    }
    for s in vs + ds:
        s.close()
    return {
        "ms": {k: round(v * 1e3, 3) for k, v in t.items()},
        "device_ops": ops,
        "verify_positions_per_s": {
            "alone": round(n * block / t["verify_alone"]),
            "batch": round(n * block / t["verify_batch"]),
        },
        "verify_speedup": round(t["verify_alone"] / t["verify_batch"], 2),
        "draft_speedup": round(t["draft_alone"] / t["draft_batch"], 2),
        "verify_choices_identical": same_verify,
        "draft_positions_per_s": {
            "alone": round(n * (block - 1) / t["draft_alone"]),
            "batch": round(n * (block - 1) / t["draft_batch"]),
        },
        "drafts_identical": same_draft,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--shape", default="demo", choices=["demo", "26b", "small"])
    p.add_argument("--sessions", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--block", type=int, default=8)
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)
    target, drafter = build(args.shape, args.device, args.dtype)
    rows = {}
    with torch.inference_mode():
        for n in args.sessions:
            rows[str(n)] = measure(target, drafter, n, args.block, args.ctx, args.reps, args.device)
            r = rows[str(n)]
            print(
                f"N={n:>2}: verify {r['ms']['verify_alone']:.2f} -> {r['ms']['verify_batch']:.2f} ms "
                f"({r['verify_speedup']:.2f}x), draft {r['ms']['draft_alone']:.2f} -> {r['ms']['draft_batch']:.2f} ms "
                f"({r['draft_speedup']:.2f}x), identical {r['verify_choices_identical']}/{r['drafts_identical']}, "
                f"device ops verify {r['device_ops']['verify_one_session']} (one) / {r['device_ops']['verify_batch']} "
                f"(batch), draft {r['device_ops']['draft_one_session']} / {r['device_ops']['draft_batch']}",
                flush=True,
            )
    name = (
        torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or platform.machine()
    )
    out = {
        "benchmark": "batching",
        "device": args.device,
        "device_name": name,
        "dtype": args.dtype,
        "shape": args.shape,
        "block": args.block,
        "ctx": args.ctx,
        "reps": args.reps,
        "torch": torch.__version__,
        "sessions": rows,
    }
    suffix = "" if (args.device, args.shape) == ("cpu", "demo") else f"_{args.device.split(':')[0]}_{args.shape}"
    path = Path(args.out or ROOT / "benchmarks" / "results" / f"batching{suffix}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_result(path, out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
