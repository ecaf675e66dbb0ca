"""What ``kakeya train-ftheta`` fits f_theta to (``ftheta.py`` runs the training): the target's own queries and
pre-/post-norm K/V captured by a native forward, and the per-layer hybrid loss -- attention-output distillation,
post-norm direction, pre-norm magnitude -- with its held-out evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from kakeya.core.contract import FULL, SLIDING
from kakeya.verifier.mlx_backend.ftheta import Restorer

MAG_WEIGHT = 0.1  # the pre-norm magnitude term's weight in the hybrid loss


@dataclass
class LayerTruth:
    q: mx.array  # [B, heads, T, hd], q_norm + RoPE
    k_pre: mx.array  # [B, T, kv, hd]
    v_pre: mx.array
    k: mx.array  # post-norm, pre-RoPE [B, T, kv, hd]
    v: mx.array


def capture(target, ids: mx.array, aux_layers, wanted) -> tuple[mx.array, dict[int, LayerTruth]]:
    """The target's native forward over ``ids`` [B, T] (``TargetMLX.body``, uncached): aux rows [B, T, A] and each
    wanted layer's true Q/K/V, from its input: the output of the layer before it (layer 0's: the embedding)."""
    inner, a, T = target.inner, target.args, ids.shape[1]
    q_pos, k_pos = np.arange(T)[:, None], np.arange(T)[None, :]
    masks = {FULL: mx.array(k_pos <= q_pos), SLIDING: mx.array((k_pos <= q_pos) & (k_pos > q_pos - a.sliding_window))}
    _, outputs = target.body(ids, [], masks, {*aux_layers, *(w - 1 for w in wanted)})
    outputs[-1] = inner.embed_tokens(ids) * inner.embed_scale if 0 in wanted else None
    truths = {w: _truth(inner.layers[w].self_attn, inner.layers[w].input_layernorm(outputs[w - 1])) for w in wanted}
    return mx.concatenate([outputs[layer] for layer in aux_layers], axis=-1), truths


def _truth(attn, x: mx.array) -> LayerTruth:
    B, T, _ = x.shape
    q = attn.q_norm(attn.q_proj(x).reshape(B, T, attn.n_heads, attn.head_dim)).transpose(0, 2, 1, 3)
    k_pre = attn.k_proj(x).reshape(B, T, attn.n_kv_heads, attn.head_dim)
    v_pre = k_pre if attn.use_k_eq_v else attn.v_proj(x).reshape(B, T, attn.n_kv_heads, attn.head_dim)
    return LayerTruth(attn.rope(q), k_pre, v_pre, attn.k_norm(k_pre), attn.v_norm(v_pre))


def _cos(a: mx.array, b: mx.array) -> mx.array:
    return (a * b).sum(-1) / (mx.sqrt((a * a).sum(-1) * (b * b).sum(-1)) + 1e-8)


def _log_norm(x: mx.array) -> mx.array:
    return mx.log(mx.sqrt((x * x).sum(-1)) + 1e-6)


def _rope_keys(attn, k: mx.array) -> mx.array:
    return attn.rope(k.transpose(0, 2, 1, 3))  # [B, kv, T, hd], positions 0..T-1


def attention_masks(T: int, w: int, band: int) -> tuple[mx.array, mx.array]:
    """(split mask [T, 2T]: exact keys at distance < w ++ restored keys at w..band-1; reference mask [T, T])."""
    d = np.arange(T)[:, None] - np.arange(T)[None, :]
    exact = (d >= 0) & (d < w)
    restored = (d >= w) & (d < band)
    return mx.array(np.concatenate([exact, restored], axis=1)), mx.array((d >= 0) & (d < band))


def layer_terms(attn, spec, kh_pre, vh_pre, truth: LayerTruth, masks, qw=None) -> dict[str, mx.array]:
    """The hybrid loss terms of one layer, plus the relative K/V errors (for reports). ``qw`` [B, T]: weights of
    the queries in the attention-output error (``--answer-weight``), or None (all 1)."""
    kh, vh = attn.k_norm(kh_pre), attn.v_norm(vh_pre)
    k_rope, kh_rope = _rope_keys(attn, truth.k), _rope_keys(attn, kh)
    v_t, vh_t = truth.v.transpose(0, 2, 1, 3), vh.transpose(0, 2, 1, 3)
    split, ref = masks
    out_true = mx.fast.scaled_dot_product_attention(truth.q, k_rope, v_t, scale=attn.scale, mask=ref)
    out_hat = mx.fast.scaled_dot_product_attention(
        truth.q,
        mx.concatenate([k_rope, kh_rope], axis=2),
        mx.concatenate([v_t, vh_t], axis=2),
        scale=attn.scale,
        mask=split,
    )
    qw = 1.0 if qw is None else qw[:, None, :, None]  # [B, 1, T, 1] against [B, heads, T, hd]
    attn_err = (qw * (out_hat - out_true) ** 2).sum() / ((qw * out_true**2).sum() + 1e-8)
    direction = (1 - _cos(kh, truth.k)).mean() + (1 - _cos(vh, truth.v)).mean()
    magnitude = ((_log_norm(kh_pre) - _log_norm(truth.k_pre)) ** 2).mean()
    magnitude = magnitude + ((_log_norm(vh_pre) - _log_norm(truth.v_pre)) ** 2).mean()
    return {
        "attn": attn_err,
        "dir": direction,
        "mag": magnitude,
        "rel_mse_k": ((kh - truth.k) ** 2).sum() / (truth.k**2).sum(),
        "rel_mse_v": ((vh - truth.v) ** 2).sum() / (truth.v**2).sum(),
        "cos_k": _cos(kh, truth.k).mean(),
        "cos_v": _cos(vh, truth.v).mean(),
    }


def hybrid(terms: dict) -> mx.array:
    return terms["attn"] + terms["dir"] + MAG_WEIGHT * terms["mag"]


class Objective:
    """Loss of f_theta on one batch; the target and the draft context are constants."""

    def __init__(self, target, restorer: Restorer):
        self.target, self.restorer = target, restorer
        self.window = target.args.sliding_window
        self._masks: dict = {}

    def teacher(self, ids: mx.array):
        cfg = self.restorer.config
        aux, truths = capture(self.target, ids, cfg.target_layer_ids, {l.index for l in cfg.layers})
        fk, fv = self.restorer.features(aux)
        mx.eval(fk, fv, [[t.q, t.k_pre, t.v_pre, t.k, t.v] for t in truths.values()])
        return fk, fv, truths

    def masks(self, T: int, w: int, spec) -> tuple[mx.array, mx.array]:
        band = self.window if spec.type == SLIDING else T
        key = (T, min(w, band - 1), band)
        if key not in self._masks:
            self._masks[key] = attention_masks(T, *key[1:])
        return self._masks[key]

    def terms(self, ftheta, fk, fv, truths, w: int, qw=None) -> dict[int, dict]:
        z = ftheta.encode(fk, fv)
        out = {}
        for j, spec in enumerate(self.restorer.config.layers):
            zz = z if spec.restored else mx.stop_gradient(z)  # probes never move the encoder
            kh_pre, vh_pre = ftheta.decode_pre_norm(zz, j, spec)
            attn = self.target.inner.layers[spec.index].self_attn
            out[spec.index] = layer_terms(
                attn, spec, kh_pre, vh_pre, truths[spec.index], self.masks(fk.shape[1], w, spec), qw
            )
        return out

    def loss(self, ftheta, fk, fv, truths, w: int, qw=None):
        terms = self.terms(ftheta, fk, fv, truths, w, qw)
        specs = self.restorer.config.layers
        main = [terms[s.index] for s in specs if s.restored]
        probes = [terms[s.index] for s in specs if not s.restored]
        main_loss = sum(hybrid(t) for t in main) / len(main)
        total = main_loss + (sum(hybrid(t) for t in probes) / len(probes) if probes else 0.0)
        parts = [sum(t[k] for t in main) / len(main) for k in ("attn", "dir", "mag")]
        return total, main_loss, *parts


def evaluate(objective: Objective, ids: mx.array) -> dict:
    """Relative K/V error (post-norm, pre-RoPE) per layer and per layer type on held-out text."""
    fk, fv, truths = objective.teacher(ids)
    w = max(1, objective.window // 2)
    terms = objective.terms(objective.restorer.ftheta, fk, fv, truths, w)
    per_layer = {}
    for spec in objective.restorer.config.layers:
        t = {k: float(v) for k, v in terms[spec.index].items()}
        t["loss"] = t["attn"] + t["dir"] + MAG_WEIGHT * t["mag"]  # the hybrid training loss, held out
        truth = truths[spec.index]
        # context: the error of the best constant prediction (the mean K/V of the batch)
        t["baseline_rel_mse_k"] = float(((truth.k - truth.k.mean(axis=(0, 1))) ** 2).sum() / (truth.k**2).sum())
        t["baseline_rel_mse_v"] = float(((truth.v - truth.v.mean(axis=(0, 1))) ** 2).sum() / (truth.v**2).sum())
        t.update(type=spec.type, restored=spec.restored)
        per_layer[str(spec.index)] = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in t.items()}
    by_type = {}
    for kind, name in ((SLIDING, "sliding"), (FULL, "full")):
        rows = [r for r in per_layer.values() if r["type"] == kind]
        if not rows:
            continue
        agg = {k: round(float(np.mean([r[k] for r in rows])), 6) for k in rows[0] if isinstance(rows[0][k], float)}
        agg |= {"layers": len(rows), "restored": kind == SLIDING}
        if kind != SLIDING:
            agg["note"] = "probe decoders only: S5 keeps full-attention K/V exact, f_theta is never used there"
        by_type[name] = agg
    return {"exact_window_for_attn": w, "per_layer": per_layer, "by_type": by_type}
