"""Is f_theta or the restore path what keeps ``+restore`` from recalling on the all-sliding recall target?

    python benchmarks/ftheta_oracle.py --pair services/models/recall/slide [--ftheta DIR ...]
        [--contexts 128 160 192 224 256] [--depths 0 0.25 0.5 0.6 0.75 0.9 1.0] [--out JSON]

For each ``kakeya niah`` case whose needle lies in the band between the sink-window cache's window (half the
model's) and the model's own, greedy recall under ``native``, ``sink-window``, ``sink-window+restore`` with each
f_theta, and ``sink-window+oracle``: the same restore path (latent ring, restore mask, per-slot RoPE, block-8
verify) but every restored slot's K/V replaced by the exact post-norm K/V the target computes natively for
that position (a bench-only patch of this process's ``TargetMLX._restored``; nothing in services/ knows of it).
Perfect restoration recalling what ``native`` recalls says the path is sound and f_theta's quality is what
is missing.

Per f_theta and band case, on the prompt through the native target: the relative MSE of the restored
post-norm K/V against the true ones at the needle's code tokens and over the whole prompt, and, per layer,
the attention mass the last prompt position (the query that must find the needle) puts on the code tokens
with exact keys within the window and restored ones in the band, against native's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import write_result

ROOT = Path(__file__).resolve().parents[1]


def native_truths(target, ids: list[int], aux_layers):
    import mlx.core as mx

    from kakeya.training.ftheta_objective import capture

    sliding = [i for i in range(target.n_cached) if target.layer_types[i] == "sliding_attention"]
    return capture(target, mx.array([ids]), list(aux_layers), set(sliding))


def install_oracle(target) -> None:
    """Restored slots get the native K/V of the tokens this session has fed at their positions."""
    import mlx.core as mx

    fed: list[int] = []
    forward, layers = (
        target.forward,
        [i for i in range(target.n_cached) if target.layer_types[i] == "sliding_attention"],
    )

    def recording_forward(segments):
        (seg,) = segments  # one session at a time in this bench
        start = seg.plan.start
        del fed[start:]
        fed.extend(seg.ids)
        return forward(segments)

    def oracle_restored(restore):
        start = int(restore.positions.max()) + 1 if (restore.positions >= 0).any() else 0
        _aux, truths = native_truths(target, fed[: max(start, 1)], [0])
        pos = np.clip(restore.positions, 0, max(start - 1, 0))
        offsets = mx.array(np.maximum(restore.positions, 0))
        out = []
        for i in layers:
            attn = target.inner.layers[i].self_attn
            k, v = truths[i].k[0][mx.array(pos)], truths[i].v[0][mx.array(pos)]  # [slots, kv, hd]
            k = attn.rope(k[:, :, None, :], offset=offsets)[:, :, 0, :]
            out.append((k.transpose(1, 0, 2)[None], v.transpose(1, 0, 2)[None]))
        return out

    target.forward, target._restored = recording_forward, oracle_restored


def kv_error(target, restorer, ids: list[int], code_at: list[int], window: int, w: int) -> dict:
    """f_theta's K/V error on one prompt (native aux) and the last query's attention mass on the code tokens."""
    import mlx.core as mx

    aux, truths = native_truths(target, ids, restorer.config.target_layer_ids)
    z = restorer.encode(aux[0])
    T, t = len(ids), len(ids) - 1
    d = t - np.arange(T)
    exact, band = (d >= 0) & (d < w), (d >= w) & (d < window)
    per_layer = {}
    for i, truth in truths.items():
        attn = target.inner.layers[i].self_attn
        kh, vh = restorer.layer_kv(z, i, attn)  # [T, kv, hd] post-norm, pre-RoPE
        k, v = truth.k[0], truth.v[0]

        def rel(a, b, at=slice(None)):
            return float(((a[at] - b[at]) ** 2).sum() / (b[at] ** 2).sum())

        at = mx.array(code_at)

        def rope(x, attn=attn):  # [T, kv, hd] -> [kv, T, hd], rotated at positions 0..T-1
            return attn.rope(x.transpose(1, 0, 2)[None])[0]

        q = truth.q[0, :, t]  # [heads, hd], RoPE'd
        rep = q.shape[0] // k.shape[1]
        kr, khr = mx.repeat(rope(k), rep, axis=0), mx.repeat(rope(kh), rep, axis=0)
        s_true = (kr @ q[:, :, None])[..., 0] * attn.scale  # [heads, T]
        s_hat = mx.where(mx.array(band), (khr @ q[:, :, None])[..., 0] * attn.scale, s_true)
        keep = mx.array(exact | band)
        p_true = mx.softmax(mx.where(keep, s_true, -1e9), axis=-1)
        p_hat = mx.softmax(mx.where(keep, s_hat, -1e9), axis=-1)
        per_layer[str(i)] = {
            "rel_mse_k_code": round(rel(kh, k, at), 4),
            "rel_mse_v_code": round(rel(vh, v, at), 4),
            "rel_mse_k_prompt": round(rel(kh, k), 4),
            "rel_mse_v_prompt": round(rel(vh, v), 4),
            "code_attention_native": round(float(p_true[:, at].sum(-1).max()), 4),
            "code_attention_restored": round(float(p_hat[:, at].sum(-1).max()), 4),
        }
    return per_layer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default=str(ROOT / "services" / "models" / "recall" / "slide"))
    ap.add_argument("--ftheta", nargs="*", default=None, help="f_theta directories (default: the pair's ftheta/)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 160, 192, 224, 256])
    ap.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.6, 0.75, 0.9, 1.0])
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "ftheta_oracle_slide.json"))
    args = ap.parse_args()

    from kakeya.orchestrator.assembly import build_local_engine, set_torch_threads
    from kakeya.orchestrator.niah import (
        build_prompt,
        haystack_lines,
        needle_code,
        needle_distance,
        parse_policy,
        run_niah,
    )

    set_torch_threads(1, "cpu", embedded=False, backend="mlx")
    pair = Path(args.pair)
    fthetas = args.ftheta if args.ftheta is not None else [str(pair / "ftheta")]
    engine = build_local_engine(str(pair / "target"), str(pair / "draft"), "mlx")
    target, codec = engine.verifier.target, engine.codec
    window = engine.verifier.info.sliding_window
    w = window // 2
    lines = haystack_lines(max(args.contexts) * 8)
    band = []  # (context, depth, code, ids, distance): the cases only restoration can recall
    for c in args.contexts:
        for d in args.depths:
            code = needle_code(c, d)
            ids = build_prompt(codec, lines, c, d, code)
            dist = needle_distance(codec, ids, code)
            if dist is not None and w < dist <= window:  # the cases niah_recall.py counts in its band
                band.append((c, d, code, ids, dist))
    log = lambda m: print(m, file=sys.stderr, flush=True)
    log(f"{len(band)} band cases (needle {w} < distance <= {window})")

    def recall(policy) -> list[dict]:
        rows = []
        for c, d, code, _ids, dist in band:
            out = run_niah(engine, [c], [d], {"p": policy}, max_tokens=8, block_size=8)["p"]["cases"][0]
            rows.append(
                {"context": c, "depth": d, "distance": dist, "recalled": out["recalled"], "output": out["output"]}
            )
        log(f"{policy.resolve(window).label}: {sum(r['recalled'] for r in rows)}/{len(rows)}")
        return rows

    policies = {"native": recall(parse_policy("native", args.sink, w, None))}
    policies["sink-window"] = recall(parse_policy("sink-window", args.sink, w, None))
    errors = {}
    for f in fthetas:
        policies[f"sink-window+restore {f}"] = recall(parse_policy("sink-window+restore", args.sink, w, f))
        restorer = target.restorer(f)
        per_case = []
        for c, d, code, ids, dist in band:
            start = len(ids) - dist
            want = codec.encode(f" {code}.")[1 if codec.add_bos and codec.bos_id is not None else 0 :]
            code_at = list(range(start, start + len(want) - 1))  # the code's tokens, not the full stop
            per_case.append(
                {"context": c, "depth": d, "distance": dist}
                | {"layers": kv_error(target, restorer, ids, code_at, window, w)}
            )
        layer_keys = per_case[0]["layers"]["0"].keys()
        mean = {
            k: round(float(np.mean([[r[k] for r in pc["layers"].values()] for pc in per_case])), 4) for k in layer_keys
        }
        errors[f] = {"mean_over_layers_and_cases": mean, "cases": per_case}
        log(f"{f}: {mean}")
    install_oracle(target)
    policies["sink-window+oracle"] = recall(parse_policy("sink-window+restore", args.sink, w, fthetas[0]))
    result = {
        "pair": str(pair),
        "model_window": window,
        "window": w,
        "sink": args.sink,
        "band_cases": len(band),
        "recalled": {k: sum(r["recalled"] for r in v) for k, v in policies.items()},
        "policies": policies,
        "ftheta_error": errors,
        "notes": [
            (
                "sink-window+oracle: the restore path with every restored slot's K/V the target's native post-norm"
                " K/V (bench-only patch of TargetMLX._restored)"
            ),
            (
                "ftheta_error: restored K/V from the native forward's aux rows; *_code: at the needle code's tokens;"
                " code_attention_*: the largest per-head attention mass of the last prompt position on the code's"
                " tokens (exact keys within the window, restored in the band; native: true keys throughout)"
            ),
        ],
    }
    write_result(args.out, result)
    for k, v in result["recalled"].items():
        print(f"{k:<60} {v}/{len(band)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
