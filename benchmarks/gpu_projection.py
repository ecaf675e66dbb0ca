"""Projected DFlash speed-up on a GPU for a gemma-4-26B-A4B-shaped target (torch backend).

Builds the torch verifier (``kakeya.verifier.torch_backend.target.TargetTorch``) with
RANDOM bf16 weights in the published gemma-4-26B-A4B shape, and a random 5-layer
DFlash drafter bound to its embedding / LM head, then measures on the real
session code paths (bounded ring cache, aux captured in the verify forward):

* ``t_ar``        -- one autoregressive step: ``verify([tok]) + commit(1)``;
* ``t_verify[L]`` -- one verify forward of L positions + its host sync, trimmed
                     back (``commit(0)``), L = 1..16;
* ``t_draft[L]``  -- one drafter call at block size L: extend the context cache
                     with the aux of the kept positions + ONE block forward + sync;

and projects ``speedup(tau, L) = tau * t_ar / (t_draft[L] + t_verify[L])`` for
an acceptance length ``tau`` (tokens committed per block, 1..8, tau <= L).
Random weights make acceptance meaningless, so tau is an input of the
projection, never measured. Published DFlash on gemma-4-26B: tau ~ 3.9.

Warm-up first (a full pass over every measured shape at the full context, so
the caching allocator is sized); CUDA is synchronised only around timed regions
(each verify/draft already ends in its one host sync, like the real loop).

    python benchmarks/gpu_projection.py --device cuda             # the real thing
    python benchmarks/gpu_projection.py --small --device cpu      # scaled down, for CI

Against the hardware: each ``t_verify[L]`` (L = 1, 2, 4, 8, 16) is reported beside
its **expert-union roofline** -- the bytes a verify of L tokens must read at least,
the dense (non-expert) parameters plus the fraction ``1 - (1 - k/E)^L`` of the
expert parameters that L uniformly routed tokens touch, over the HBM bandwidth
(H100 3.35 TB/s, H200 4.8 TB/s, picked by device name; ``--bandwidth-tbs`` for
others). And fidelity in low precision: the speculative decode's tokens vs the
engine's own AR in the same dtype (fraction identical, first divergence).

Writes JSON to ``benchmarks/results/gpu_projection.json`` (``gpu_projection_small.json`` with
``--small``; ``--out`` to choose).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
for _p in (ROOT, ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from gemma4_26b import DRAFT_26B, GEMMA4_26B_A4B, MAX_L, hbm_bandwidth, layer_types_of

from kakeya.backends.torch.ops import resolve_device, resolve_dtype
from kakeya.core.request import CachePolicy
from kakeya.drafter.backend import bind
from kakeya.drafter.local import TorchDrafter
from kakeya.drafter.torch_backend.model import DFlashConfig, DFlashDraftModel, TargetHead
from kakeya.verifier.session import LocalVerifierSession
from kakeya.verifier.torch_backend.gemma4 import Gemma4Args
from kakeya.verifier.torch_backend.target import TargetTorch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: record.py, the results' one writer
from record import write_result

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "gpu_projection.json"
SMALL_OUT = ROOT / "benchmarks" / "results" / "gpu_projection_small.json"  # never clobbers the GPU result
TAUS = range(1, 9)


SMALL = dict(
    vocab_size=2048,
    hidden_size=128,
    intermediate_size=96,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    global_head_dim=64,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    sliding_window=64,
    layer_types=layer_types_of(6),
    final_logit_softcapping=30.0,
    tie_word_embeddings=True,
    hidden_size_per_layer_input=0,
    vocab_size_per_layer_input=2048,
    num_kv_shared_layers=0,
    enable_moe_block=True,
    num_experts=8,
    top_k_experts=2,
    moe_intermediate_size=32,
    max_position_embeddings=4096,
)
DRAFT_SMALL = dict(
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=256,
    target_layer_ids=[1, 4],
    block_size=16,
)


def draft_config(d: dict, vocab: int) -> DFlashConfig:
    return DFlashConfig.from_dict(
        {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": d["hidden_size"],
            "num_hidden_layers": d["num_hidden_layers"],
            "num_attention_heads": d["num_attention_heads"],
            "num_key_value_heads": d["num_key_value_heads"],
            "head_dim": d["head_dim"],
            "intermediate_size": d["intermediate_size"],
            "vocab_size": vocab,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "max_position_embeddings": 262_144,
            "final_logit_softcapping": 30.0,
            "dflash_config": {
                "block_size": d["block_size"],
                "target_layer_ids": d["target_layer_ids"],
                "mask_token_id": 4,
            },
        }
    )


def random_drafter(
    cfg: DFlashConfig, target: TargetTorch, seed: int = 1, cuda_graphs: bool | None = None
) -> TorchDrafter:
    """Random weights; the embedding / LM head are the target's own tensors (colocated)."""
    device, dtype = target.device, target.dtype
    with torch.device("meta"):
        model = DFlashDraftModel(cfg)
    g = torch.Generator(device=device).manual_seed(seed)
    params = {}
    for name, p in model.named_parameters():
        shape = tuple(p.shape)
        if len(shape) == 1:
            params[name] = torch.ones(shape, device=device, dtype=dtype)
        else:
            params[name] = torch.empty(shape, device=device, dtype=dtype).normal_(0.0, shape[-1] ** -0.5, generator=g)
    model.load_state_dict(params, strict=True, assign=True)
    model.inv_freq = model.inv_freq.to(device).float()
    model.eval().requires_grad_(False)
    m = target.model
    bind(model, TargetHead(m.embed, m.lm_head))
    return TorchDrafter(model=model, cuda_graphs=cuda_graphs)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def timed(fn, reps: int, device: torch.device) -> float:
    """Mean seconds per call of ``fn`` over ``reps`` calls (synchronised around the region only)."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / reps


def measure(
    target: TargetTorch, drafter: TorchDrafter, ctx: int, reps: int, seed: int = 0, profile: bool = False
) -> dict:
    device = target.device
    vocab = target.args.vocab_size
    rng = np.random.default_rng(seed)
    aux_layers = drafter.target_layer_ids
    prompt = [2] + [int(t) for t in rng.integers(5, vocab, ctx - 1)]

    session = LocalVerifierSession(target, aux_layers, CachePolicy(slack=MAX_L))
    t0 = time.perf_counter()
    first, aux = session.prefill(prompt)
    sync(device)
    prefill_s = time.perf_counter() - t0
    dsession = drafter.open_session()
    dsession.draft(aux, first, 2)  # the drafter's context cache holds the prompt

    ids = [int(t) for t in rng.integers(5, vocab, MAX_L)]
    tau_aux = aux[-1:].clone()  # aux rows the drafter extends with per block (1 row per accepted token)

    def ar_step():
        session.verify(ids[:1])
        session.commit(1)

    def verify(L):
        def f():
            session.verify(ids[:L])
            session.commit(0)

        return f

    def draft(L):
        # extend by one committed position + one block forward; the context grows by 1 per call,
        # like a block that accepted one token (the cost of the extension is O(rows), tiny)
        return lambda: dsession.draft(tau_aux, ids[0], L)

    shapes = [("ar", ar_step)] + [(f"v{L}", verify(L)) for L in range(1, MAX_L + 1)]
    shapes += [(f"d{L}", draft(L)) for L in range(2, MAX_L + 1)]
    for _, fn in shapes:  # warm-up: every shape at the full context, allocator sized
        for _ in range(2):
            fn()
    sync(device)

    t = {name: timed(fn, reps, device) for name, fn in shapes}
    kernels = {name: top_kernels(fn, device) for name, fn in shapes if name in PROFILED} if profile else None
    ops = {name: top_ops(fn, device) for name, fn in shapes if name in OPS_PROFILED} if profile else None
    t_ar = t["ar"]
    t_verify = {L: t[f"v{L}"] for L in range(1, MAX_L + 1)}
    t_draft = {1: 0.0, **{L: t[f"d{L}"] for L in range(2, MAX_L + 1)}}
    projection = {
        tau: {L: tau * t_ar / (t_draft[L] + t_verify[L]) for L in range(max(tau, 1), MAX_L + 1)} for tau in TAUS
    }
    best = {}
    for tau, row in projection.items():
        L = max(row, key=row.get)
        best[tau] = {"block_size": L, "speedup": row[L]}
    return {
        "prefill_s": prefill_s,
        "t_ar_ms": t_ar * 1e3,
        "t_verify_ms": {str(L): v * 1e3 for L, v in t_verify.items()},
        "t_draft_ms": {str(L): v * 1e3 for L, v in t_draft.items()},
        "projected_speedup": {str(tau): {str(L): s for L, s in row.items()} for tau, row in projection.items()},
        "best_block_per_tau": {str(tau): b for tau, b in best.items()},
        "kv_bytes": session.stats().kv_bytes.as_dict(),
        **({"top_kernels": kernels} if kernels else {}),
        **({"top_ops": ops} if ops else {}),
    }


PROFILED = ("ar", "v1", "v2", "v4", "v8", "v16", "d4", "d8", "d16")
OPS_PROFILED = ("v1", "v8", "d8")  # also profiled op by op, with input shapes


def top_kernels(fn, device: torch.device, calls: int = 5, top: int = 12) -> list[dict]:
    """The device kernels that take the most time over ``calls`` calls (ms per call), from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with profile(activities=acts) as prof:
        for _ in range(calls):
            fn()
        sync(device)
    rows = []
    for e in prof.key_averages():
        dev_us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if device.type != "cuda":
            dev_us = e.self_cpu_time_total
        if dev_us:
            rows.append({"name": e.key[:120], "ms_per_call": dev_us / 1e3 / calls, "count_per_call": e.count / calls})
    rows.sort(key=lambda r: -r["ms_per_call"])
    total = sum(r["ms_per_call"] for r in rows)
    return [{"total_device_ms_per_call": total}] + rows[:top]


def top_ops(fn, device: torch.device, calls: int = 3, top: int = 15) -> list[dict]:
    """The ops whose kernels take the most device time, grouped by op and input shapes (ms per call).

    A replayed CUDA graph shows its kernels but not the ops that launched them, so this runs
    the very same static steps eagerly (``GraphedStep.fn`` on its static inputs: the same
    shapes, hence the same kernels) under a profiler that records shapes. It answers which
    product a slow kernel computes (say, which 8-row GEMM takes 43 us)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from kakeya.backends.torch.graphs import GraphedStep

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    replay = GraphedStep.__call__
    GraphedStep.__call__ = lambda self: self.fn(*self.inputs)
    try:
        fn()  # the eager step's own warm-up (lazy inits) stays out of the profile
        sync(device)
        with profile(activities=acts, record_shapes=True) as prof:
            for _ in range(calls):
                fn()
            sync(device)
    finally:
        GraphedStep.__call__ = replay
    rows = []
    for e in prof.key_averages(group_by_input_shape=True):
        if e.device_type != DeviceType.CPU:
            continue  # a kernel's own row: its time is also its launching op's self device time
        us = e.self_device_time_total if device.type == "cuda" else e.self_cpu_time_total
        if us:
            rows.append(
                {
                    "op": e.key[:80],
                    "input_shapes": str(e.input_shapes)[:200],
                    "ms_per_call": us / 1e3 / calls,
                    "count_per_call": e.count / calls,
                }
            )
    rows.sort(key=lambda r: -r["ms_per_call"])
    return rows[:top]


ROOFLINE_L = (1, 2, 4, 8, 16)


def weight_bytes(target: TargetTorch) -> dict:
    """Bytes of the target's dense (non-expert) weights and of its routed experts."""
    m = target.model
    experts = sum(l.moe.gate_up.nbytes + l.moe.down.nbytes for l in m.layers if l.moe is not None)
    total = sum(b.nbytes for b in m.buffers()) + (m.lm_head.nbytes if m.lm_head is not None else 0)
    return {"dense": total - experts, "experts": experts}


def expert_fraction(L: int, k: int, E: int) -> float:
    """Expected fraction of the experts that L tokens with uniform top-k routing touch."""
    return 1.0 - (1.0 - k / E) ** L


def roofline(target: TargetTorch, t_verify_ms: dict, bandwidth: float | None) -> dict:
    """Per L: bytes read (dense + touched experts), the roofline time and t_verify over it."""
    a = target.args
    wb = weight_bytes(target)
    rows = {}
    for L in ROOFLINE_L:
        frac = expert_fraction(L, a.top_k_experts, a.num_experts) if a.enable_moe_block else 0.0
        nbytes = wb["dense"] + frac * wb["experts"]
        row = {"experts_touched": frac, "bytes": nbytes, "t_verify_ms": t_verify_ms[str(L)]}
        if bandwidth:
            row["roofline_ms"] = nbytes / bandwidth * 1e3
            row["over_roofline"] = row["t_verify_ms"] / row["roofline_ms"]
        rows[str(L)] = row
    return {
        "bandwidth_bytes_s": bandwidth,
        "weight_bytes": wb,
        "per_L": rows,
        "model": "t_verify(L) >= (dense + (1 - (1 - k/E)^L) * experts) bytes / HBM bandwidth",
    }


def agreement(target: TargetTorch, drafter: TorchDrafter, n: int, block_size: int, seed: int = 2) -> dict:
    """Speculative vs the engine's own AR in the model's dtype: fraction identical, first divergence."""
    from kakeya.orchestrator.decode.loop import run

    rng = np.random.default_rng(seed)
    prompt = [2] + [int(t) for t in rng.integers(5, target.args.vocab_size, 31)]
    aux = drafter.target_layer_ids

    def decode(L):
        vs = LocalVerifierSession(target, aux, CachePolicy(slack=MAX_L))
        return run(vs, drafter.open_session(), prompt, n, L).token_ids

    ar, spec = decode(1), decode(block_size)
    same = [a == b for a, b in zip(ar, spec)]
    first = next((i for i, s in enumerate(same) if not s), None)
    return {
        "tokens": n,
        "block_size": block_size,
        "fraction_identical": sum(same) / max(1, len(same)),
        "first_divergence": first,
        "note": "near-tie flips are expected in bf16; silent drift is not",
    }


def param_count(target: TargetTorch, drafter: TorchDrafter) -> dict:
    tgt = sum(b.numel() for b in target.model.buffers())
    if target.model.lm_head is not None:
        tgt += target.model.lm_head.numel()
    drf = sum(p.numel() for p in drafter.model.parameters())
    return {"target": tgt, "drafter": drf}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--small", action="store_true", help="scaled-down shapes (runs on a CPU in seconds)")
    p.add_argument(
        "--demo", action="store_true", help="the embedded demo pair's real weights instead of a random shape"
    )
    p.add_argument("--ctx", type=int, default=None, help="context length (default 1238, --small 160)")
    p.add_argument("--reps", type=int, default=None, help="timed calls per shape (default 20, --small 3)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op CPU threads")
    p.add_argument(
        "--bandwidth-tbs",
        type=float,
        default=None,
        help="HBM bandwidth in TB/s for the roofline (default: by device name, H100 3.35, H200 4.8)",
    )
    p.add_argument(
        "--agree-tokens", type=int, default=None, help="tokens for the AR-vs-speculative check (default 64, --small 12)"
    )
    p.add_argument("--cuda-graphs", default="auto", choices=["auto", "on", "off"], help="the verifier's CUDA graphs")
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile each layer's row-wise halves in both models, as --compile does",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="also record the top device kernels of AR, verify(1/2/4/8/16), draft(4/8/16), "
        "and the ops (with input shapes) behind verify(1/8) and draft(8)",
    )
    p.add_argument(
        "--kernels",
        action="store_true",
        help="also time each Triton kernel at this shape against its eager "
        "counterpart (benchmarks/kernels.py): achieved bandwidth, in a `kernels` section",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"default {DEFAULT_OUT.relative_to(ROOT)} ({SMALL_OUT.name} with --small)",
    )
    args = p.parse_args(argv)
    if args.kernels and args.demo:
        p.error("--kernels times the kernels at a random shape (the 26B one, or --small), not the demo pair")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.out is None:
        args.out = SMALL_OUT if args.small else DEFAULT_OUT

    device, dtype = resolve_device(args.device), resolve_dtype(args.dtype)
    shape, dshape = (SMALL, DRAFT_SMALL) if args.small else (GEMMA4_26B_A4B, DRAFT_26B)
    ctx = args.ctx or (160 if args.small else 1238)
    reps = args.reps or (3 if args.small else 20)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    graphs = None if args.cuda_graphs == "auto" else args.cuda_graphs == "on"
    if args.demo:  # the embedded trained pair: where a tiny model's step is all overhead
        from kakeya.orchestrator.assembly import embedded_paths

        target_dir, draft_dir = embedded_paths()
        target = TargetTorch.load(target_dir, device, dtype, cuda_graphs=graphs)
        drafter = TorchDrafter.colocated(draft_dir, target, cuda_graphs=graphs)
        shape = {k: getattr(target.args, k) for k in ("vocab_size", "hidden_size", "num_hidden_layers", "layer_types")}
        dshape = {"draft": str(draft_dir)}
    else:
        target = TargetTorch.random(Gemma4Args(**shape), device, dtype, seed=0, cuda_graphs=graphs)
        drafter = random_drafter(draft_config(dshape, shape["vocab_size"]), target, cuda_graphs=graphs)
    if args.compile:  # each layer's row-wise halves, both models (compiled lazily, during the warm-up)
        target.model.compile_layers()
        drafter.model.compile_layers()
    sync(device)
    build_s = time.perf_counter() - t0

    with torch.inference_mode():
        result = measure(target, drafter, ctx, reps, profile=args.profile)
        agree = agreement(target, drafter, args.agree_tokens or (12 if args.small else 64), 8)
    device_name = (
        torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    )
    bandwidth = args.bandwidth_tbs * 1e12 if args.bandwidth_tbs else hbm_bandwidth(device_name)

    out = {
        "benchmark": "gpu_projection",
        "small": bool(args.small),
        "device": str(device),
        "device_name": device_name,
        "cuda_graphs": target.graph_options.capture,
        "compiled": "layers" if args.compile else False,
        "dtype": str(dtype).replace("torch.", ""),
        "torch": torch.__version__,
        "ctx": ctx,
        "reps": reps,
        "target_shape": {k: v for k, v in shape.items() if k != "layer_types"}
        | {
            "layer_types": f"{list(shape['layer_types']).count('sliding_attention')} sliding + {list(shape['layer_types']).count('full_attention')} full"
        },
        "drafter_shape": dshape,
        "params": param_count(target, drafter),
        "build_s": build_s,
        "weights": "embedded demo pair"
        if args.demo
        else "random (projection only: acceptance tau is an input, not measured)",
        "formula": "speedup(tau, L) = tau * t_ar / (t_draft[L] + t_verify[L]), tau <= L",
        **result,
        "roofline": roofline(target, result["t_verify_ms"], bandwidth),
        "agreement_with_own_ar": agree,
    }
    if device.type == "cuda":
        out["max_memory_allocated_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
    if args.kernels:  # each kernel's achieved bandwidth beside the step figures
        from benchmarks.kernels import measure_kernels

        out["kernels"] = measure_kernels(device, dtype, shape=shape, ctx=ctx, bandwidth=bandwidth)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, out)
    b = out["best_block_per_tau"]
    print(
        f"{out['device_name']} {out['dtype']} ctx {ctx}: AR {out['t_ar_ms']:.2f} ms, "
        f"verify(1/8/16) {out['t_verify_ms']['1']:.2f}/{out['t_verify_ms']['8']:.2f}/{out['t_verify_ms']['16']:.2f} ms, "
        f"draft(8/16) {out['t_draft_ms']['8']:.2f}/{out['t_draft_ms']['16']:.2f} ms"
    )
    print(
        "best projected speedup per tau: "
        + ", ".join(f"tau {t}: {v['speedup']:.2f}x @L={v['block_size']}" for t, v in b.items())
    )
    for L, row in out["roofline"]["per_L"].items():
        if "roofline_ms" in row:
            print(
                f"verify({L}): {row['t_verify_ms']:.2f} ms = {row['over_roofline']:.1f}x its expert-union roofline "
                f"{row['roofline_ms']:.2f} ms ({row['experts_touched']:.0%} of experts)"
            )
    g = out["agreement_with_own_ar"]
    print(
        f"{out['dtype']} speculative vs own AR: {g['fraction_identical']:.1%} identical, first divergence {g['first_divergence']}"
    )
    for name, rows in (out.get("top_kernels") or {}).items():
        print(
            f"{name}: {rows[0]['total_device_ms_per_call']:.2f} ms of kernels per call; top: "
            + "; ".join(f"{r['name'][:60]} {r['ms_per_call']:.2f} ms x{r['count_per_call']:.0f}" for r in rows[1:6])
        )
    for name, rows in (out.get("top_ops") or {}).items():
        print(
            f"{name} ops: "
            + "; ".join(f"{r['op']} {r['input_shapes'][:48]} {r['ms_per_call']:.3f} ms" for r in rows[:3])
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
