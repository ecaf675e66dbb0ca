"""f_theta: restore evicted sliding-layer K/V of the verifier from the drafter's context K/V (``docs/ftheta.md``).

With ``sink-window(S, W)`` and a model window ``Wn > W`` a sliding layer's query still attends, natively,
to positions the bounded cache evicted; :class:`FTheta` gives them back approximately from a latent code
of ``2r`` floats a position (shared low-rank encoders of the draft's pre-RoPE context K/V, one decoder per
sliding layer). Full-attention layers are never restored (the "S5" rule); their decoders, if any, are
report-only probes. ``docs/ftheta.md`` ("The module") describes the inputs, the decoders and the
self-describing directory (``config.json``, ``ftheta.safetensors``, ``draft_context.safetensors``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx import nn
from mlx.utils import tree_flatten

from kakeya.core.contract import SLIDING

FORMAT = "kakeya-ftheta/1"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "ftheta.safetensors"
DRAFT_FILE = "draft_context.safetensors"


@dataclass(frozen=True)
class LayerSpec:
    """One verifier layer f_theta decodes for."""

    index: int  # the verifier layer
    type: str  # sliding_attention | full_attention
    kv_heads: int
    head_dim: int
    k_eq_v: bool  # V = v_norm(K projection) (Gemma-4 full layers with attention_k_eq_v)
    restored: bool  # True: used at inference; False: a probe (full layers, S5 keeps them exact)


@dataclass(frozen=True)
class FThetaConfig:
    rank: int
    encoder_hidden: int  # 0: linear encoder
    hidden_size: int  # target hidden == draft hidden
    target_layer_ids: tuple[int, ...]  # aux layers the draft's fc reads, in order
    draft_layers: int
    draft_kv_heads: int
    draft_head_dim: int
    draft_rms_norm_eps: float
    sliding_window: int  # the target's native sliding window Wn
    layers: tuple[LayerSpec, ...]
    target: dict = field(default_factory=dict)  # path, model_type, num_hidden_layers, ...
    draft: dict = field(default_factory=dict)  # path, fingerprint of the copied context weights
    format: str = FORMAT

    @property
    def latent_dim(self) -> int:
        return 2 * self.rank

    @property
    def feature_dim(self) -> int:
        return self.draft_layers * self.draft_kv_heads * self.draft_head_dim

    @property
    def restored_layers(self) -> tuple[int, ...]:
        return tuple(l.index for l in self.layers if l.restored)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids)
        d["layers"] = [asdict(l) for l in self.layers]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> FThetaConfig:
        if d.get("format") != FORMAT:
            raise ValueError(f"not an f_theta directory (config format {d.get('format')!r}, expected {FORMAT!r})")
        d = dict(d)
        d["target_layer_ids"] = tuple(d["target_layer_ids"])
        d["layers"] = tuple(LayerSpec(**l) for l in d["layers"])
        return cls(**d)


class _DraftLayerKV(nn.Module):
    def __init__(self, hidden: int, kv_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.k_norm = nn.RMSNorm(head_dim, eps=eps)


class DraftContext(nn.Module):
    """The draft's context projections, frozen: aux rows -> per-layer PRE-RoPE context K/V features."""

    def __init__(self, cfg: FThetaConfig):
        super().__init__()
        self.kv_heads, self.head_dim, self.eps = cfg.draft_kv_heads, cfg.draft_head_dim, cfg.draft_rms_norm_eps
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.draft_rms_norm_eps)
        self.layers = [
            _DraftLayerKV(cfg.hidden_size, cfg.draft_kv_heads, cfg.draft_head_dim, cfg.draft_rms_norm_eps)
            for _ in range(cfg.draft_layers)
        ]

    def __call__(self, aux: mx.array) -> tuple[mx.array, mx.array]:
        """``aux`` -> (K features, V features): K the draft's ``k_norm(k_proj(h))`` before RoPE; V its ``v_proj(h)``
        RMS-normalised per head, so both see inputs of a fixed scale whatever the checkpoint."""
        h = self.hidden_norm(self.fc(aux.astype(self.fc.weight.dtype)))
        shape = h.shape[:-1] + (self.kv_heads, self.head_dim)
        flat = h.shape[:-1] + (-1,)
        ks = [l.k_norm(l.k_proj(h).reshape(shape)).reshape(flat) for l in self.layers]
        vs = [mx.fast.rms_norm(l.v_proj(h).reshape(shape), None, self.eps).reshape(flat) for l in self.layers]
        return mx.concatenate(ks, axis=-1), mx.concatenate(vs, axis=-1)

    @classmethod
    def from_draft(cls, cfg: FThetaConfig, draft) -> DraftContext:
        """Copy the context projections out of a loaded ``DFlashDraftModel``."""
        ctx = cls(cfg)
        weights = [("fc.weight", draft.fc.weight), ("hidden_norm.weight", draft.hidden_norm.weight)]
        for i, layer in enumerate(draft.layers):
            a = layer.self_attn
            weights += [
                (f"layers.{i}.{name}.weight", getattr(a, name).weight) for name in ("k_proj", "v_proj", "k_norm")
            ]
        ctx.load_weights([(k, v.astype(mx.float32)) for k, v in weights], strict=True)
        ctx.freeze()
        return ctx


class _Encoder(nn.Module):
    def __init__(self, d_in: int, hidden: int, rank: int):
        super().__init__()
        if hidden:
            self.inp = nn.Linear(d_in, hidden)
            self.out = nn.Linear(hidden, rank)
        else:
            self.out = nn.Linear(d_in, rank)

    def __call__(self, x: mx.array) -> mx.array:
        if "inp" in self:
            x = nn.gelu(self.inp(x))
        return self.out(x)


class _Decoder(nn.Module):
    def __init__(self, rank: int, spec: LayerSpec):
        super().__init__()
        width = spec.kv_heads * spec.head_dim
        self.k = nn.Linear(rank, width)
        if not spec.k_eq_v:
            self.v = nn.Linear(rank, width)


class FTheta(nn.Module):
    """Shared low-rank encoders (separate K and V paths) + one decoder per verifier layer."""

    def __init__(self, cfg: FThetaConfig):
        super().__init__()
        self.rank = cfg.rank
        self.enc_k = _Encoder(cfg.feature_dim, cfg.encoder_hidden, cfg.rank)
        self.enc_v = _Encoder(cfg.feature_dim, cfg.encoder_hidden, cfg.rank)
        self.decoders = [_Decoder(cfg.rank, l) for l in cfg.layers]

    def encode(self, fk: mx.array, fv: mx.array) -> mx.array:
        """Latent codes ``[..., 2r]``: ``[z_k, z_v]``."""
        return mx.concatenate([self.enc_k(fk), self.enc_v(fv)], axis=-1)

    def decode_pre_norm(self, z: mx.array, j: int, spec: LayerSpec) -> tuple[mx.array, mx.array]:
        """Decoder ``j``: pre-norm K and V ``[..., kv_heads, head_dim]`` (V is K's for k_eq_v layers)."""
        dec = self.decoders[j]
        shape = z.shape[:-1] + (spec.kv_heads, spec.head_dim)
        k = dec.k(z[..., : self.rank]).reshape(shape)
        v = k if spec.k_eq_v else dec.v(z[..., self.rank :]).reshape(shape)
        return k, v


class Restorer:
    """A loaded f_theta: aux rows -> latents; latents -> a verifier layer's PRE-RoPE K/V."""

    def __init__(self, config: FThetaConfig, ftheta: FTheta, context: DraftContext, path: Path | None = None):
        self.config, self.ftheta, self.context, self.path = config, ftheta, context, path
        self._slot = {l.index: j for j, l in enumerate(config.layers)}
        self._columns: dict[tuple[int, ...], mx.array | None] = {}

    @property
    def latent_dim(self) -> int:
        return self.config.latent_dim

    @classmethod
    def init(
        cls,
        target,
        draft,
        *,
        rank: int = 128,
        encoder_hidden: int | None = None,
        draft_dir=None,
        target_dir=None,
        probe_full: bool = True,
        seed: int = 0,
    ) -> Restorer:
        """A freshly initialised f_theta for ``target`` (``TargetMLX``) and ``draft`` (``DFlashDraftModel``)."""
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        a, dc = target.args, draft.config
        if dc.hidden_size != a.hidden_size:
            raise ValueError(f"draft hidden_size {dc.hidden_size} != target hidden_size {a.hidden_size}")
        layers = []
        for i in range(target.n_cached):
            attn = target.inner.layers[i].self_attn
            sliding = target.layer_types[i] == SLIDING
            if not sliding and not probe_full:
                continue
            kind = target.layer_types[i]
            layers.append(LayerSpec(i, kind, attn.n_kv_heads, attn.head_dim, bool(attn.use_k_eq_v), restored=sliding))
        if not any(l.restored for l in layers):
            raise ValueError("the target has no sliding-attention layers with their own K/V: nothing to restore")
        cfg = FThetaConfig(
            rank=rank,
            encoder_hidden=2 * rank if encoder_hidden is None else encoder_hidden,
            hidden_size=a.hidden_size,
            target_layer_ids=tuple(dc.target_layer_ids),
            draft_layers=dc.num_hidden_layers,
            draft_kv_heads=dc.num_key_value_heads,
            draft_head_dim=dc.head_dim,
            draft_rms_norm_eps=dc.rms_norm_eps,
            sliding_window=a.sliding_window,
            layers=tuple(layers),
            target={
                "path": str(target_dir or target.path),
                "model_type": getattr(a, "model_type", "gemma4_text"),
                "num_hidden_layers": a.num_hidden_layers,
                "layer_types": list(target.layer_types),
            },
            draft={"path": str(draft_dir) if draft_dir else None},
        )
        mx.random.seed(seed)
        ftheta = FTheta(cfg)
        context = DraftContext.from_draft(cfg, draft)
        cfg = replace(cfg, draft={**cfg.draft, "context_sha256": _fingerprint(context)})
        mx.eval(ftheta.parameters())
        return cls(cfg, ftheta, context)

    def check_target(self, target) -> None:
        """Raise ValueError unless ``target`` has the dims this f_theta was built for."""
        a, c = target.args, self.config
        problems = []
        if a.hidden_size != c.hidden_size:
            problems.append(f"hidden_size {a.hidden_size} != {c.hidden_size}")
        if a.sliding_window != c.sliding_window:
            problems.append(f"sliding_window {a.sliding_window} != {c.sliding_window}")
        for l in c.layers:
            if l.index >= target.n_cached or target.layer_types[l.index] != l.type:
                problems.append(f"layer {l.index} is not a {l.type} layer with its own K/V")
                continue
            attn = target.inner.layers[l.index].self_attn
            if (attn.n_kv_heads, attn.head_dim) != (l.kv_heads, l.head_dim):
                problems.append(
                    f"layer {l.index} K/V is {attn.n_kv_heads}x{attn.head_dim}, f_theta's {l.kv_heads}x{l.head_dim}"
                )
        missing = [i for i in range(target.n_cached) if target.layer_types[i] == SLIDING and i not in c.restored_layers]
        if missing:
            problems.append(f"no decoder for sliding layers {missing}")
        if problems:
            where = f" ({self.path})" if self.path else ""
            raise ValueError(f"f_theta{where} does not fit this target: " + "; ".join(problems))

    def features(self, aux: mx.array, aux_layers: Sequence[int] | None = None) -> tuple[mx.array, mx.array]:
        return self.context(self._select(aux, aux_layers))

    def encode(self, aux: mx.array, aux_layers: Sequence[int] | None = None) -> mx.array:
        """Latent codes ``[n, 2r]`` (float32) of aux rows laid out as ``aux_layers`` (default: the draft's)."""
        return self.ftheta.encode(*self.features(aux, aux_layers))

    def layer_kv(self, z: mx.array, layer: int, attn) -> tuple[mx.array, mx.array]:
        """Verifier layer ``layer``'s PRE-RoPE K/V ``[..., kv_heads, head_dim]`` from latents ``z``, finished by
        that layer's own ``k_norm`` and ``v_norm`` (``attn``: its mlx-lm attention module)."""
        k, v = self.pre_norm_kv(z, layer)
        return attn.k_norm(k), attn.v_norm(v)

    def pre_norm_kv(self, z: mx.array, layer: int) -> tuple[mx.array, mx.array]:
        j = self._slot.get(layer)
        if j is None:
            raise KeyError(f"f_theta has no decoder for layer {layer}")
        return self.ftheta.decode_pre_norm(z, j, self.config.layers[j])

    def _select(self, aux: mx.array, aux_layers: Sequence[int] | None) -> mx.array:
        want = self.config.target_layer_ids
        have = tuple(want if aux_layers is None else aux_layers)
        if have not in self._columns:
            missing = [i for i in want if i not in have]
            if missing:
                raise ValueError(f"f_theta needs aux of target layers {list(want)}; the session captures {list(have)}")
            if have == want:
                self._columns[have] = None
            else:
                h = self.config.hidden_size
                self._columns[have] = mx.array(
                    np.concatenate([np.arange(have.index(i) * h, (have.index(i) + 1) * h) for i in want])
                )
        cols = self._columns[have]
        return aux if cols is None else mx.take(aux, cols, axis=-1)

    def save(self, out_dir: str | Path, extra: dict | None = None) -> Path:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        cfg = self.config.to_dict()
        if extra:
            cfg["training"] = extra
        mx.save_safetensors(str(out / WEIGHTS_FILE), dict(tree_flatten(self.ftheta.parameters())))
        mx.save_safetensors(str(out / DRAFT_FILE), dict(tree_flatten(self.context.parameters())))
        (out / CONFIG_FILE).write_text(json.dumps(cfg, indent=2) + "\n")
        return out


def load_ftheta(path: str | Path) -> Restorer:
    """Open an f_theta directory written by :meth:`Restorer.save` (``ftheta:`` prefix allowed)."""
    path = Path(str(path).removeprefix("ftheta:"))
    cfg_file = path / CONFIG_FILE
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{path}: not an f_theta directory (no {CONFIG_FILE})")
    raw = json.loads(cfg_file.read_text())
    raw.pop("training", None)
    cfg = FThetaConfig.from_dict(raw)
    for f in (WEIGHTS_FILE, DRAFT_FILE):
        if not (path / f).is_file():
            raise FileNotFoundError(f"{path}: f_theta directory has no {f}")
    ftheta = FTheta(cfg)
    ftheta.load_weights(str(path / WEIGHTS_FILE), strict=True)
    context = DraftContext(cfg)
    context.load_weights(str(path / DRAFT_FILE), strict=True)
    context.freeze()
    want = cfg.draft.get("context_sha256")
    if want and _fingerprint(context) != want:
        raise ValueError(f"{path}: {DRAFT_FILE} does not match the fingerprint in {CONFIG_FILE}")
    mx.eval(ftheta.parameters(), context.parameters())
    ftheta.eval()
    return Restorer(cfg, ftheta, context, path)


def _fingerprint(context: DraftContext) -> str:
    h = hashlib.sha256()
    for name, a in sorted(tree_flatten(context.parameters())):
        h.update(name.encode())
        h.update(np.asarray(a.astype(mx.float32)).tobytes())
    return h.hexdigest()
