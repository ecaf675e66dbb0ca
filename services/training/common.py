"""Shared trainer plumbing: progress bar, LR schedule, resumable checkpoints, reports."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

# MLX is imported inside the functions that need it: torch trainers share this module.


class Progress:
    """A one-line progress bar on stderr (``\\r``-updated when stderr is a TTY, else every ~10%)."""

    def __init__(self, total: int, label: str, start: int = 0, quiet: bool = False):
        self.total, self.label, self.quiet = total, label, quiet
        self.t0 = time.time()
        self.start = start
        self.tty = sys.stderr.isatty()
        self._last_pct = -1

    def update(self, step: int, **fields: Any) -> None:
        if self.quiet:
            return
        done = step - self.start
        el = time.time() - self.t0
        eta = el / done * (self.total - step) if done > 0 else 0.0
        pct = int(100 * step / max(self.total, 1))
        bar = "#" * (pct // 5) + "." * (20 - pct // 5)
        info = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items())
        line = f"{self.label} [{bar}] {step}/{self.total} {info} elapsed {el:.0f}s eta {eta:.0f}s"
        if self.tty:
            print("\r" + line, end="", file=sys.stderr, flush=True)
        elif pct // 10 != self._last_pct // 10 or step == self.total:
            print(line, file=sys.stderr, flush=True)
        self._last_pct = pct

    def close(self) -> None:
        if self.tty and not self.quiet:
            print(file=sys.stderr, flush=True)


def lr_at(step: int, steps: int, lr: float, warmup: int, min_ratio: float = 0.1, spent: float = 0.0) -> float:
    """Linear warm-up then cosine decay to ``min_ratio * lr``. ``spent``: the share of a time budget
    already used; the decay follows whichever of steps and time runs out first, so a run that its
    budget stops still ends on a decayed rate, not halfway down the curve."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = min(1.0, max((step - warmup) / max(1, steps - warmup), spent))
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def budget_spent(train_s: float, time_budget: float) -> float:
    """The share of ``time_budget`` seconds that ``train_s`` seconds of training used (0 without a budget)."""
    return min(1.0, train_s / time_budget) if time_budget else 0.0


def check_names(have, w: dict, layout: str = "the HF layout") -> None:
    """A freshly built model's parameter names are the initial weights' (``tiny``'s), or stop."""
    if set(have) != set(w):
        raise RuntimeError(f"parameter names differ from {layout}: {sorted(set(have) ^ set(w))[:8]}")


def write_meta(ckpt_dir: Path, meta: dict) -> None:
    """``state.json`` written last and atomically: a checkpoint with one is whole."""
    tmp = ckpt_dir / "state.json.tmp"
    tmp.write_text(json.dumps(meta) + "\n")
    tmp.replace(ckpt_dir / "state.json")


def save_state(ckpt_dir: Path, model, opt, meta: dict) -> None:
    """MLX model + optimizer state + meta (step, loss curve)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    ckpt_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(ckpt_dir / "model.safetensors"), dict(tree_flatten(model.trainable_parameters())))
    mx.save_safetensors(str(ckpt_dir / "optimizer.safetensors"), dict(tree_flatten(opt.state)))
    write_meta(ckpt_dir, meta)


def load_state(ckpt_dir: Path, model, opt) -> dict | None:
    """Restore what :func:`save_state` wrote; None when there is nothing to resume."""
    if not (ckpt_dir / "state.json").is_file():
        return None
    import mlx.core as mx
    from mlx.utils import tree_unflatten

    model.load_weights(list(mx.load(str(ckpt_dir / "model.safetensors")).items()), strict=False)
    opt.state = tree_unflatten(list(mx.load(str(ckpt_dir / "optimizer.safetensors")).items()))
    mx.eval(model.parameters(), opt.state)
    return json.loads((ckpt_dir / "state.json").read_text())


def torch_device(device: str | None):
    """The ``--device`` asked for, else CUDA when there is one, else the CPU."""
    import torch

    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def torch_adamw(params, lr: float, weight_decay: float):
    """torch's AdamW with the trainers' betas, decaying matrices only (not norms' vectors)."""
    import torch

    params = list(params)
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def set_lr(opt, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, default=_np_default) + "\n", encoding="utf-8")


def _np_default(o):
    if isinstance(o, np.generic):  # numpy scalars in a report
        return o.item()
    raise TypeError(type(o))


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def seed_all(seed: int) -> None:
    np.random.seed(seed)
    try:
        import mlx.core as mx
    except ImportError:  # a torch-only node
        return
    mx.random.seed(seed)


def device_label(device) -> str:
    """Where a torch run trained, for its report and the model card: "cpu", or "cuda (NVIDIA H100 80GB
    HBM3)" with the GPU's name."""
    import torch

    d = torch.device(device)
    return f"{d.type} ({torch.cuda.get_device_name(d)})" if d.type == "cuda" else d.type


def hf_text_config(cfg: dict):
    """transformers' ``Gemma4TextConfig`` for a target config dict, its ``layer_types`` kept as written: transformers
    forces the last layer to full attention, mlx-lm and our verifiers do not (an all-sliding target is where only
    f_theta brings back an evicted needle), so the full layers' overrides go to the layers that really are full."""
    from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig

    types = list(cfg["layer_types"])
    conf = Gemma4TextConfig(**dict(cfg, layer_types=list(types)))
    if conf.layer_types != types:
        full = conf.per_layer_config[len(types) - 1]  # the forced layer's overrides: a full layer's
        overrides = {"head_dim": full.head_dim, "num_key_value_heads": full.num_key_value_heads}
        per_layer = {i: overrides for i, t in enumerate(types) if t == "full_attention"}
        conf = Gemma4TextConfig(**dict(cfg, layer_types=list(types), per_layer_config=per_layer))
        conf.layer_types = types
    return conf
