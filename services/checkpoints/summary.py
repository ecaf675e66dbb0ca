"""What a checkpoint directory holds, whether a drafter fits a target, and what the pair needs in memory,
from ``config.json`` and the safetensors headers alone (``kakeya inspect``): no tensor is read, no backend
imported. The configs go through the loaders' own readers (``config.py``), so ``inspect`` refuses what a
load would refuse, with the same message.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from kakeya.checkpoints import layout
from kakeya.checkpoints.config import PATH_KEY, CheckpointError, check_pair, load_draft_config, load_target_config
from kakeya.core.contract import FULL, SLIDING

SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "U64": 8, "I32": 4, "U32": 4}


def tensors(ckpt: str | Path) -> dict[str, Any]:
    """``{"files", "sharded", "tensors", "bytes", "tensor_dtypes", "names"}`` of a checkpoint's safetensors."""
    d = Path(ckpt)
    try:
        files = layout.shard_files(d)
    except (FileNotFoundError, ValueError) as exc:
        raise CheckpointError(str(exc)) from None
    names, dtypes, nbytes = [], Counter(), 0
    for f in files:
        for name, meta in layout.safetensors_header(f).items():
            names.append(name)
            dtypes[meta.get("dtype", "?")] += 1
            start, end = meta.get("data_offsets", (0, 0))
            nbytes += int(end) - int(start)
    return {
        "files": len(files),
        "sharded": (d / layout.SAFETENSORS_INDEX).is_file(),
        "tensors": len(names),
        "bytes": nbytes,
        "tensor_dtypes": dict(sorted(dtypes.items())),
        "names": names,
    }


def layer_pattern(types: list[str]) -> str:
    """``layer_types`` in short: ``"(5 sliding, 1 full) x 5"`` or the run lengths, ``"2 sliding, 1 full"``."""
    runs: list[list] = []
    for t in types:
        kind = "sliding" if t == SLIDING else "full" if t == FULL else t
        if runs and runs[-1][1] == kind:
            runs[-1][0] += 1
        else:
            runs.append([1, kind])
    text = ", ".join(f"{n} {k}" for n, k in runs)
    for period in range(2, len(runs) // 2 + 1):
        if len(runs) % period == 0 and all(runs[i] == runs[i % period] for i in range(len(runs))):
            return f"({', '.join(f'{n} {k}' for n, k in runs[:period])}) x {len(runs) // period}"
    return text


def quantization(top: dict, text: dict, names: list[str]) -> dict | None:
    """``mlx_lm.convert``'s ``quantization`` ({bits, group_size}) or a ``quantization_config``; quantized
    tensors (``.scales``) with neither are reported too: a loader must not take them for plain weights."""
    q = top.get("quantization") or top.get("quantization_config") or text.get("quantization")
    if isinstance(q, dict):
        keys = ("bits", "group_size", "mode", "quant_method")
        return {k: q[k] for k in keys if k in q and not isinstance(q[k], dict)}
    return {"bits": None, "group_size": None} if layout.is_quantized(names) else None


def describe_target(path: str | Path) -> tuple[dict, dict]:
    """(what a target directory holds, its text config as the loaders read it)."""
    cfg = load_target_config(path)
    d = Path(cfg[PATH_KEY])
    top = json.loads((d / "config.json").read_text(encoding="utf-8"))  # as written (the loader has read it)
    t = tensors(d)
    try:
        text = layout.find_text_tensors(t["names"], d)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    types = list(cfg.get("layer_types") or [])
    n_experts = cfg.get("num_experts") if cfg.get("enable_moe_block", cfg.get("num_experts")) else None
    out = {
        "path": str(d),
        "kind": "target",
        "architectures": top.get("architectures") or [],
        "model_type": top.get("model_type"),
        "multimodal": top.get("model_type") != cfg.get("model_type"),
        "num_hidden_layers": cfg["num_hidden_layers"],
        "hidden_size": cfg["hidden_size"],
        "vocab_size": cfg["vocab_size"],
        "layer_pattern": layer_pattern(types) if types else None,
        "sliding_window": cfg.get("sliding_window"),
        "attention_k_eq_v": bool(cfg.get("attention_k_eq_v")),
        "kv_shared_layers": int(cfg.get("num_kv_shared_layers") or 0),
        "per_layer_input": cfg.get("hidden_size_per_layer_input") or None,
        "experts": {"num_experts": n_experts, "top_k": cfg.get("top_k_experts")} if n_experts else None,
        "dtype": cfg.get("dtype") or cfg.get("torch_dtype") or top.get("dtype") or top.get("torch_dtype"),
        "quantization": quantization(top, cfg, t["names"]),
        "tied_lm_head": text.head is None,
        "eos_token_id": cfg.get("eos_token_id"),
        **{k: t[k] for k in ("files", "sharded", "tensors", "bytes", "tensor_dtypes")},
    }
    return out, cfg


def draft_checked(path: str | Path) -> tuple[dict, dict]:
    """(a drafter's config as ``load_draft_config`` checks it, its safetensors summary)."""
    cfg = load_draft_config(path)
    return cfg, tensors(cfg[PATH_KEY])


__all__ = ["CheckpointError", "check_pair", "describe_target", "draft_checked", "layer_pattern"]
