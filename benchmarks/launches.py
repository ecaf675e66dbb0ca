"""Kernel launches per step of the torch fast path, counted on any machine (no GPU needed).

On a GPU a step costs what its kernels cost plus what the host spends launching
them: ~5-10 us of Python and dispatch per eager op. A captured CUDA graph
replays its kernels with one launch, so what matters is (a) how many kernels a
step's graph holds and (b) how many ops the host still launches around it per
call. Both are properties of the code, not of the device, so this script counts
them on a CPU: it runs the very objects CUDA captures (``GraphOptions(capture=
False, static_extent=True)``, the bucketed static steps) and counts dispatched
aten ops inside and outside the step functions (views and ops that return their
input, such as a cast to the dtype a tensor already has, are left out: they launch
nothing).

The model has the gemma-4-26B-A4B *structure* (30 layers, 25 sliding + 5 full,
K = V full layers, MoE beside the dense MLP, soft-cap) and a 5-layer drafter at a
small width: op counts depend on the structure, not the width.

    python benchmarks/launches.py            # writes benchmarks/results/launches.json
    python benchmarks/launches.py --demo     # the embedded demo pair, float32: launches_demo.json
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.gemma4_26b import DRAFT_26B, layer_types_of
from benchmarks.gpu_projection import SMALL, draft_config, random_drafter
from kakeya.backends.torch.graphs import BUCKETS, GraphedStep, GraphOptions
from kakeya.core.request import CachePolicy
from kakeya.verifier.session import LocalVerifierSession
from kakeya.verifier.torch_backend.gemma4 import Gemma4Args
from kakeya.verifier.torch_backend.target import TargetTorch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: record.py, the results' one writer
from record import write_result

OUT = ROOT / "benchmarks" / "results" / "launches.json"
OUT_DEMO = OUT.with_name("launches_demo.json")
STATIC = GraphOptions(capture=False, buckets=BUCKETS, static_extent=True)  # what CUDA captures, run eagerly
VIEWS = {
    "view",
    "_unsafe_view",
    "transpose",
    "unsqueeze",
    "squeeze",
    "expand",
    "slice",
    "select",
    "split",
    "split_with_sizes",
    "reshape",
    "t",
    "permute",
    "alias",
    "unflatten",
    "chunk",
    "detach",
    "as_strided",
    "unbind",
    "lift_fresh",
    "_local_scalar_dense",
}
STRUCTURE_26B = dict(SMALL, num_hidden_layers=30, layer_types=layer_types_of(30), num_experts=16, top_k_experts=4)
DRAFT = dict(
    DRAFT_26B,
    hidden_size=SMALL["hidden_size"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=256,
)


class Launches(TorchDispatchMode):
    """Counts dispatched non-view aten ops, split into inside / outside ``GraphedStep`` calls."""

    def __init__(self):
        super().__init__()
        self.inside, self.outside = collections.Counter(), collections.Counter()
        self.in_step = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        no_op = args and out is args[0] and not func._schema.is_mutable  # say, a cast to the dtype it has
        if name not in VIEWS and not no_op:
            (self.inside if self.in_step else self.outside)[name] += 1
        return out


def counted(fn) -> dict:
    """Run ``fn`` once (after one warm call) and count its launches inside and outside the steps."""
    fn()
    call = GraphedStep.__call__
    mode = Launches()

    def step(self):
        mode.in_step = True
        try:
            return call(self)
        finally:
            mode.in_step = False

    GraphedStep.__call__ = step
    try:
        with mode:
            fn()
    finally:
        GraphedStep.__call__ = call
    return {
        "graphed": sum(mode.inside.values()),
        "host": sum(mode.outside.values()),
        "host_ops": dict(mode.outside.most_common()),
        "graphed_top": dict(mode.inside.most_common(12)),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=None, help=f"default {OUT.name} ({OUT_DEMO.name} with --demo)")
    p.add_argument("--ctx", type=int, default=300, help="prompt length before the counted steps")
    p.add_argument(
        "--dtype", default=None, help="bfloat16 (what a GPU serves; the default) or float32 (--demo's default)"
    )
    p.add_argument("--demo", action="store_true", help="the embedded demo pair instead of the 26B structure")
    args = p.parse_args(argv)
    args.out = args.out or (OUT_DEMO if args.demo else OUT)
    torch.manual_seed(0)
    if args.demo:  # the trained pair in its lossless dtype: its GPU steps are all launches
        from kakeya.drafter.local import TorchDrafter
        from kakeya.orchestrator.assembly import embedded_paths

        args.dtype = args.dtype or "float32"
        target_dir, draft_dir = embedded_paths()
        target = TargetTorch.load(target_dir, "cpu", args.dtype, graph_options=STATIC)
        drafter = TorchDrafter.colocated(draft_dir, target, cuda_graphs=False)
    else:
        args.dtype = args.dtype or "bfloat16"
        target = TargetTorch.random(Gemma4Args(**STRUCTURE_26B), "cpu", args.dtype, seed=0, graph_options=STATIC)
        drafter = random_drafter(draft_config(DRAFT, STRUCTURE_26B["vocab_size"]), target, cuda_graphs=False)
    drafter.model.use_graphs(STATIC)
    aux_layers = drafter.target_layer_ids
    result = {}
    with torch.inference_mode():
        session = LocalVerifierSession(target, aux_layers, CachePolicy(slack=16))
        first, aux = session.prefill([2] + list(range(5, 5 + args.ctx - 1)))
        dsession = drafter.open_session()
        dsession.draft(aux, first, 2)

        def verify(L):
            def f():
                session.verify([7] * L)
                session.commit(min(L, 3))

            return f

        def draft(L):
            return lambda: dsession.draft(aux[-3:], 7, L)  # 3 new rows: a block that accepted 2

        for L in (1, 8, 16):
            result[f"verify({L}) + commit"] = counted(verify(L))
        for L in (8, 16):
            result[f"draft({L}), 3 new context rows"] = counted(draft(L))
    for name, r in result.items():
        print(f"{name:32s} graphed {r['graphed']:5d}   host {r['host']:4d}  {r['host_ops']}")
    out = {
        "benchmark": "launches",
        "what": "dispatched aten ops per call (views and no-op casts excluded), inside the static steps (what a CUDA graph "
        "replays) and outside them (what the host launches one by one)",
        "target": "embedded demo target: 6 layers (4 sliding + 2 full)"
        if args.demo
        else "gemma-4-26B-A4B structure at small width: 30 layers (25 sliding + 5 full), MoE, K = V",
        "drafter": "5 layers",
        "dtype": args.dtype,
        "torch": torch.__version__,
        "counts": result,
        # an AR step is verify(1) + commit; where every kernel costs about the same (a tiny model
        # on a GPU), a block of L costs about (verify(L) + draft(L)) / AR steps, which caps the
        # speedup at tau divided by that
        "block_cost_in_ar_steps": {
            str(L): (result[f"verify({L}) + commit"]["graphed"] + result[f"draft({L}), 3 new context rows"]["graphed"])
            / result["verify(1) + commit"]["graphed"]
            for L in (8, 16)
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
