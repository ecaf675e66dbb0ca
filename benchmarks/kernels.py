"""The Triton kernels (``kakeya.backends.torch.kernels``) at gemma-4-26B-A4B's shapes on a GPU, each
beside its eager torch counterpart: median time, the bytes the work must move at least, the
achieved bandwidth (bytes / median time) and its share of the device's HBM peak (H100 3.35 TB/s,
H200 4.8 TB/s), so the next bottleneck is named by a number.

Each case is one layer's call at L = 1, 8, 16 rows (a verify's block; the drafter's are the same
kernels): the residual add + next norm; q/k norm + RoPE (+ V's norm) of a sliding and a full layer;
split-K attention over the sliding ring and over a full layer's 4096-slot buffer at context 1238;
the router's top-k; the routed experts (uniform routing: 6 % of the experts at one row, 64 % at
16); the LM head's soft-cap + argmax over 262,144 logits. Both sides run as a captured CUDA graph
(as the models replay them), L2 flushed before every replay (the weights come from HBM, as in a
step), CUDA events around it; the smallest kernels' times are mostly the graph launch's ~2-3 us.

    python benchmarks/kernels.py                        # CUDA only: writes results/kernels_<device>.json
    python benchmarks/gpu_projection.py --kernels ...   # the same figures inside the projection's JSON

On a CPU it refuses: the kernels' correctness is checked there by tests/kernels, under Triton's
interpreter, which says nothing about speed.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gemma4_26b import GEMMA4_26B_A4B, MAX_L, hbm_bandwidth

from kakeya.backends.torch import ops
from kakeya.core.contract import FULL, SLIDING
from kakeya.verifier.layout import RingLayout
from kakeya.verifier.torch_backend.gemma4 import Gemma4Args, MoE, rope_inv_freq
from tests.kernels import reference  # the eager math each kernel equals

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: record.py, the results' one writer
from record import write_result

ROWS = (1, 8, 16)
FULL_CAPACITY = 4096  # a full layer's preallocated buffer when graphs are on (the static step attends over all of it)
FLUSH_BYTES = 256 << 20  # more than any GPU's L2


@dataclass
class Case:
    name: str
    rows: int
    bytes: int  # what the work must read and write at least
    kernel: Callable[[], object]
    eager: Callable[[], object]


def cases(shape: dict, rows: int, ctx: int, device: torch.device, dtype: torch.dtype, seed: int = 0) -> list[Case]:
    """Every kernel at ``shape`` for ``rows`` query rows at context ``ctx``, with its eager counterpart."""
    from kakeya.backends.torch.kernels import attention, head, moe, norm, rope

    a = Gemma4Args(**shape)
    g = torch.Generator(device=device).manual_seed(seed)
    es = torch.tensor([], dtype=dtype).element_size()

    def rand(*size, scale=1.0, shift=0.0):
        return (torch.randn(size, generator=g, device=device) * scale + shift).to(dtype)

    T, H, Hq, eps = rows, a.hidden_size, a.num_attention_heads, a.rms_norm_eps
    out = []
    x, branch, w, bw, one = rand(T, H), rand(T, H), rand(H, shift=1), rand(H, shift=1), rand(1, scale=0, shift=1)
    out.append(
        Case(
            "norm.add_rms_norm",
            T,
            (4 * T * H + 2 * H) * es,
            lambda: norm.add_rms_norm(x, branch, w, eps, branch_weight=bw, scale=one),
            lambda: reference.add_rms_norm_reference(x, branch, w, eps, branch_weight=bw, scale=one),
        )
    )
    pos = torch.arange(ctx, ctx + T, device=device)
    layers = {
        "sliding": (SLIDING, a.num_key_value_heads, a.head_dim, False),
        "full": (FULL, a.num_global_key_value_heads, a.global_head_dim, a.attention_k_eq_v),
    }
    for kind, (layer_type, n_kv, D, k_eq_v) in layers.items():
        qkv = rand(T, (Hq + n_kv * (1 if k_eq_v else 2)) * D)
        cos, sin = ops.rope_from_positions(rope_inv_freq(a.rope_parameters[layer_type], D).to(device), pos, dtype)
        qw, kw = rand(D, shift=1), rand(D, shift=1)
        args = (qkv, Hq, n_kv, D, qw, kw, cos, sin, eps)
        moved = (qkv.numel() + (Hq + 2 * n_kv) * D * T + 2 * T * D + 2 * D) * es
        out.append(
            Case(
                f"rope.qkv_norm_rope.{kind}",
                T,
                moved,
                lambda args=args, k=k_eq_v: rope.qkv_norm_rope(*args, k_eq_v=k),
                lambda args=args, k=k_eq_v: reference.qkv_norm_rope_reference(*args, k_eq_v=k),
            )
        )
        out.append(_attention_case(kind, a, T, ctx, n_kv, D, rand, device, es, attention))
    E, k = a.num_experts, a.top_k_experts
    logits = rand(T, E)
    scale = rand(E, shift=1)
    out.append(
        Case(
            "moe.route",
            T,
            T * E * es + E * es + T * k * 12,
            lambda: moe.route(logits, k, scale),
            lambda: reference.route_reference(logits, k, scale),
        )
    )
    out.append(_experts_case(a, T, rand, device, dtype, es, moe))
    V = a.vocab_size
    lm = rand(T, V, scale=4)
    cap = a.final_logit_softcapping
    out.append(
        Case(
            "head.softcap_argmax",
            T,
            T * V * (es + 4),
            lambda: head.softcap_argmax(lm, cap),
            lambda: reference.softcap_argmax_reference(lm, cap),
        )
    )
    return out


def _attention_case(kind, a, T, ctx, n_kv, D, rand, device, es, attention) -> Case:
    """One layer's attention as the static step runs it: the ring (or the whole full buffer), a mask
    from positions; eagerly the mask is built and ``ops.sdpa`` called, as ``verify_step`` does."""
    Hq = a.num_attention_heads
    query_pos = torch.arange(ctx, ctx + T, device=device)[None]
    window = a.sliding_window if kind == "sliding" else 0
    if kind == "sliding":
        layout = RingLayout(0, window, MAX_L)
        while layout.offset < ctx + T:
            layout.plan(min(MAX_L, ctx + T - layout.offset))
            layout.applied()
        key_pos = torch.from_numpy(layout.positions).to(device)[None]
    else:
        key_pos = torch.arange(max(FULL_CAPACITY, ctx + MAX_L), device=device)[None]
    S = key_pos.shape[1]
    table = torch.arange(S, device=device)[None]
    k, v = rand(n_kv, S, D), rand(n_kv, S, D)
    q = rand(1, T, Hq, D)
    mask = attention.visible(key_pos[0], query_pos[0], window)
    read = int(mask.any(0).sum()) * n_kv * D * es * 2  # every K/V row some query sees, once per KV head
    moved = read + 2 * q.numel() * es + S * 16

    def eager():
        with ops.sdpa_backends():
            m = attention.visible(key_pos[0], query_pos[0], window)
            return ops.sdpa(q.transpose(1, 2), k[None], v[None], m, 1.0)

    return Case(
        f"attention.{kind}",
        T,
        moved,
        lambda: attention.decode_attention(q, k, v, table, key_pos, query_pos, window=window),
        eager,
    )


def _experts_case(a, T, rand, device, dtype, es, moe) -> Case:
    """The routed experts of ``T`` rows under uniform routing; eagerly the model's own ``MoE.experts``."""
    with torch.device("meta"):
        m = MoE(a)
    E, k, mi, H = a.num_experts, a.top_k_experts, a.moe_intermediate_size, a.hidden_size
    m.gate_up, m.down = rand(E, 2 * mi, H, scale=H**-0.5), rand(E, H, mi, scale=mi**-0.5)
    x = rand(T, H)
    idx, w = moe.route(rand(T, E), k, rand(E, shift=1))
    routed = int(idx.unique().numel())
    moved = routed * 3 * mi * H * es + 2 * T * H * es + 2 * T * k * mi * es
    return Case(
        "moe.experts", T, moved, lambda: moe.experts(x, idx, w, m.gate_up, m.down), lambda: m.experts(x, idx, w)
    )


def gpu_us(fn: Callable[[], object], reps: int, flush: torch.Tensor) -> tuple[float, bool]:
    """Median microseconds of ``fn`` replayed as a CUDA graph, L2 flushed before each replay; falls
    back to plain calls (False) where ``fn`` cannot be captured."""
    fn()  # compiles / warms up
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            fn()
        call, graphed = graph.replay, True
    except RuntimeError:
        call, graphed = fn, False
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        flush.zero_()
        start.record()
        call()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events) * 1e3, graphed


def measure_kernels(
    device: torch.device,
    dtype: torch.dtype = torch.bfloat16,
    *,
    shape: dict | None = None,
    rows=ROWS,
    ctx: int = 1238,
    reps: int = 50,
    bandwidth: float | None = None,
) -> dict:
    """Every case timed, kernel and eager: the ``kernels`` section of a results JSON."""
    if device.type != "cuda":
        raise SystemExit(
            "benchmarks/kernels.py times Triton kernels on a GPU; this machine's device is "
            f"{device} (tests/kernels checks the kernels on a CPU under TRITON_INTERPRET=1)"
        )
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)
    bandwidth = bandwidth or hbm_bandwidth(torch.cuda.get_device_name(device))
    out = []
    with torch.inference_mode():
        for L in rows:
            for c in cases(shape or GEMMA4_26B_A4B, L, ctx, device, dtype):
                try:
                    k_us, k_graphed = gpu_us(c.kernel, reps, flush)
                    e_us, e_graphed = gpu_us(c.eager, reps, flush)
                except Exception as e:  # noqa: BLE001  (a kernel failing on this GPU is reported, the rest timed)
                    out.append({"kernel": c.name, "rows": L, "error": repr(e)[:500]})
                    print(f"{c.name:30s} L={L:<2d} FAILED: {e!r}"[:300], flush=True)
                    continue
                row = {
                    "kernel": c.name,
                    "rows": L,
                    "bytes": c.bytes,
                    "kernel_us": k_us,
                    "eager_us": e_us,
                    "kernel_gb_s": c.bytes / k_us / 1e3,
                    "eager_gb_s": c.bytes / e_us / 1e3,
                    "speedup": e_us / k_us,
                    "graphed": k_graphed and e_graphed,
                }
                if bandwidth:
                    row["kernel_of_peak"] = row["kernel_gb_s"] * 1e9 / bandwidth
                    row["eager_of_peak"] = row["eager_gb_s"] * 1e9 / bandwidth
                out.append(row)
                print(
                    f"{c.name:30s} L={L:<2d} {c.bytes / 1e6:9.2f} MB  kernel {k_us:8.1f} us "
                    f"{row['kernel_gb_s']:7.0f} GB/s  eager {e_us:8.1f} us {row['eager_gb_s']:7.0f} GB/s  "
                    f"x{row['speedup']:.2f}",
                    flush=True,
                )
    return {
        "peak_bandwidth_bytes_s": bandwidth,
        "ctx": ctx,
        "dtype": str(dtype).replace("torch.", ""),
        "timing": "median of CUDA-graph replays, L2 flushed before each",
        "results": out,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--rows", type=int, nargs="+", default=list(ROWS), help="query rows per call (a verify's L)")
    p.add_argument("--ctx", type=int, default=1238)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--bandwidth-tbs", type=float, default=None, help="HBM peak in TB/s (default: by device name)")
    p.add_argument("--out", type=Path, default=None, help="default benchmarks/results/kernels_<device>.json")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type != "cuda" or not torch.cuda.is_available():
        print(
            "benchmarks/kernels.py is a GPU benchmark: it needs a CUDA device (tests/kernels checks the kernels "
            "on a CPU, under Triton's interpreter)",
            file=sys.stderr,
        )
        return 2
    import triton

    name = torch.cuda.get_device_name(device)
    section = measure_kernels(
        device,
        ops.resolve_dtype(args.dtype),
        rows=args.rows,
        ctx=args.ctx,
        reps=args.reps,
        bandwidth=args.bandwidth_tbs * 1e12 if args.bandwidth_tbs else None,
    )
    result = {
        "benchmark": "kernels",
        "device_name": name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "shape": "gemma-4-26B-A4B",
        **section,
    }
    slug = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    path = args.out or ROOT / "benchmarks" / "results" / f"kernels_{slug}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_result(path, result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
