"""``kakeya inspect DIR [--draft DIR]``: what a checkpoint directory holds, whether a drafter fits its target, and the
memory the pair needs for a context and a number of sessions -- before any weight loads (the configs, the tokenizer and
the safetensors headers only: no tensor is read, no backend imported). They go through the loaders' own readers
(``checkpoints/config.py``, ``orchestrator/text.py``), so ``inspect`` refuses what a load would refuse, with the same
message. The first command to run on a download. A pair that does not fit is printed, then refused with every reason.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from kakeya.checkpoints import layout
from kakeya.checkpoints.config import PATH_KEY, CheckpointError, load_draft_config, load_target_config, pair_problems
from kakeya.core.contract import FULL, SLIDING
from kakeya.core.request import CachePolicy
from kakeya.drafter.config import DFlashConfig
from kakeya.orchestrator.text import TextCodec
from kakeya.verifier.memory import DTYPE_BYTES, KVShape, session_bytes

UNITS = ("bytes", "KiB", "MiB", "GiB", "TiB")


def tensors(ckpt: str | Path) -> dict[str, Any]:
    """``{"files", "sharded", "tensors", "bytes", "tensor_dtypes", "names", "headers"}`` of a checkpoint's
    safetensors."""
    d = Path(ckpt)
    try:
        files = layout.shard_files(d)
    except (FileNotFoundError, ValueError) as exc:
        raise CheckpointError(str(exc)) from None
    headers = {name: meta for f in files for name, meta in layout.safetensors_header(f).items()}
    names, dtypes = list(headers), Counter(meta.get("dtype", "?") for meta in headers.values())
    return {
        "files": len(files),
        "sharded": (d / layout.SAFETENSORS_INDEX).is_file(),
        "tensors": len(names),
        "bytes": sum(_nbytes(meta) for meta in headers.values()),
        "tensor_dtypes": dict(sorted(dtypes.items())),
        "names": names,
        "headers": headers,
    }


def _nbytes(meta: dict) -> int:
    start, end = meta.get("data_offsets", (0, 0))
    return int(end) - int(start)


def layer_pattern(types: list[str]) -> str:
    """``layer_types`` in short: ``"(5 sliding, 1 full) x 5"`` or the run lengths, ``"2 sliding, 1 full"``."""
    runs: list[list] = []
    for t in types:
        kind = "sliding" if t == SLIDING else "full" if t == FULL else t
        if runs and runs[-1][1] == kind:
            runs[-1][0] += 1
        else:
            runs.append([1, kind])
    for period in range(2, len(runs) // 2 + 1):
        if len(runs) % period == 0 and all(runs[i] == runs[i % period] for i in range(len(runs))):
            return f"({', '.join(f'{n} {k}' for n, k in runs[:period])}) x {len(runs) // period}"
    return ", ".join(f"{n} {k}" for n, k in runs)


def quantization(top: dict, text: dict, names: list[str]) -> dict | None:
    """``mlx_lm.convert``'s ``quantization`` ({bits, group_size}) or a ``quantization_config``; quantized
    tensors (``.scales``) with neither are reported too. A mixed convert's modules (own entries; the rest and null
    group sizes take the top-level default) are counted per bits/group size, the default alone would mislead."""
    q = top.get("quantization") or top.get("quantization_config") or text.get("quantization")
    if isinstance(q, dict):
        own = [s for s in q.values() if isinstance(s, dict)]
        keys = ("mode", "quant_method") if own else ("bits", "group_size", "mode", "quant_method")
        out = {k: q[k] for k in keys if k in q and not isinstance(q[k], dict)}
        specs = own + [q] * (sum(n.endswith(".scales") for n in names) - len(own))
        per_bits = Counter(f"{s['bits']}-bit/{s.get('group_size') or q.get('group_size')}" for s in specs)
        return out | ({"modules_per_bits": dict(sorted(per_bits.items()))} if own else {})
    return {"bits": None, "group_size": None} if layout.is_quantized(names) else None


def describe_target(path: str | Path) -> tuple[dict, dict]:
    """(what a target directory holds, its text config as the loaders read it)."""
    cfg = load_target_config(path)
    d = Path(cfg[PATH_KEY])
    top = json.loads((d / "config.json").read_text(encoding="utf-8"))  # as written (the loader has read it)
    t = tensors(d)
    text = layout.find_text_tensors(t["names"], d, cfg["tie_word_embeddings"])
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
        # what a drafter loads of the target: its embedding table and LM head (quantized: with scales, biases)
        "embed_and_head_bytes": sum(
            _nbytes(t["headers"][module + suffix])
            for module in filter(None, (text.embed, text.head))
            for suffix in (".weight", ".scales", ".biases")
            if module + suffix in t["headers"]
        ),
    }
    return out, cfg


def register(sub) -> None:
    p = sub.add_parser(
        "inspect",
        help="what a checkpoint directory holds, whether a drafter fits it, and the memory the pair needs",
        description="Reads the configs, the tokenizer and the safetensors headers only: no weights load.",
    )
    p.add_argument("dir", help="a Gemma-4 target checkpoint directory (or a DFlash drafter's)")
    p.add_argument("--draft", help="a DFlash drafter directory to check against the target DIR")
    p.add_argument("--context", type=int, default=8192, help="positions per session for the memory (default 8192)")
    p.add_argument("--sessions", type=int, default=1, help="concurrent sessions for the memory (default 1)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.set_defaults(func=cmd_inspect)


def describe_draft(path) -> dict:
    """What a drafter directory holds, read through ``load_draft_config`` and ``DFlashConfig``."""
    cfg = load_draft_config(path)
    t = tensors(cfg[PATH_KEY])
    where = Path(cfg["_path"]) / "config.json"
    try:
        dc = DFlashConfig.from_dict(cfg)
    except KeyError as exc:
        raise CheckpointError(f"draft checkpoint {where}: field {exc} is missing") from None
    except (ValueError, TypeError) as exc:
        raise CheckpointError(f"draft checkpoint {where}: {exc}") from None
    dfl = cfg.get("dflash_config") or {}
    if dc.dflash2 is not None:
        layout = "DFlash2 (block convolution + candidate selector)"
    elif "block_size" not in dfl:
        layout = "dflash package / z-lab through May 2026 (block_size at the top level)"
    elif SLIDING in dc.layer_types:
        layout = "z-lab June 2026 (block_size in dflash_config, sliding drafter layers)"
    else:
        layout = "DFlash (block_size in dflash_config)"
    return {
        "path": cfg["_path"], "kind": "draft", "architectures": cfg.get("architectures") or [], "layout": layout,
        "num_hidden_layers": dc.num_hidden_layers, "layer_pattern": layer_pattern(list(dc.layer_types)),
        "sliding_window": dc.sliding_window, "hidden_size": dc.hidden_size, "vocab_size": dc.vocab_size,
        "attention": {"heads": dc.num_attention_heads, "kv_heads": dc.num_key_value_heads, "head_dim": dc.head_dim},
        "target_layer_ids": list(dc.target_layer_ids), "mask_token_id": dc.mask_token_id, "block_size": dc.block_size,
        "dflash2": None if dc.dflash2 is None else dict(dc.dflash2.__dict__),
        "dtype": cfg.get("dtype") or cfg.get("torch_dtype"),
        **{k: t[k] for k in ("files", "tensors", "bytes", "tensor_dtypes")}, "_config": dc,
    }  # fmt: skip


def memory(target: dict, target_cfg: dict, draft: dict | None, context: int, sessions: int) -> dict:
    """Bytes the pair needs: weights once (the drafter's own, and its copy of the target's embedding and
    LM head), then per session the verifier's K/V under the default (native) policy -- ``verifier/memory.py``,
    the numbers a session reports as ``KVBytes`` -- and the drafter's context K/V rows."""
    shape = KVShape.from_config(target_cfg)  # the loaders' reading: full layers' shapes in the hub's spelling
    kv = session_bytes(shape, CachePolicy(), context)
    out = {
        "context": context, "sessions": sessions, "cache_policy": "native", "target_weights_bytes": target["bytes"],
        "target_kv_per_session": {"sliding": kv["sliding_bytes"], "full": kv["full_bytes"]},
        "full_attention": {"kv_heads": shape.full_kv_heads, "head_dim": shape.full_head_dim},
        "sliding_attention": {"kv_heads": shape.sliding_kv_heads, "head_dim": shape.sliding_head_dim},
    }  # fmt: skip
    per_session, weights = kv["total_bytes"], target["bytes"]
    if draft is not None:
        dc = draft["_config"]
        width = 2 * dc.num_key_value_heads * dc.head_dim * DTYPE_BYTES.get(draft["dtype"] or "", shape.dtype_bytes)
        rows = sum(
            min(context, int(dc.sliding_window) - 1) if t == SLIDING else context for t in dc.layer_types
        )  # drafter/context.py: a sliding layer keeps window - 1 rows, a full one every position
        head = target["embed_and_head_bytes"]
        out.update(
            draft_weights_bytes=draft["bytes"], draft_target_head_bytes=head, draft_context_per_session=rows * width
        )
        per_session += rows * width
        weights += draft["bytes"] + head
    out["per_session_bytes"] = per_session
    out["total_bytes"] = weights + sessions * per_session
    return out


def inspect(path, draft_path=None, context: int = 8192, sessions: int = 1) -> tuple[dict, list[str]]:
    """(the report, the reasons the pair does not fit); CheckpointError for a directory that cannot be read."""
    if context < 1:
        raise ValueError(f"--context must be >= 1, got {context}")
    if sessions < 1:
        raise ValueError(f"--sessions must be >= 1, got {sessions}")
    config = Path(path) / "config.json"
    if config.is_file():
        try:
            is_draft = "dflash_config" in json.loads(config.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, TypeError):
            is_draft = False  # the target reader names the file and what is wrong with it
        if is_draft:
            if draft_path is not None:
                raise ValueError(f"{path} is a drafter: give the target as DIR and the drafter as --draft")
            return {"draft": {k: v for k, v in describe_draft(path).items() if k != "_config"}}, []
    target, target_cfg = describe_target(path)
    if (Path(path) / "tokenizer.json").is_file():  # what a load refuses of it (a verifier alone serves without one)
        TextCodec(path, target_cfg["vocab_size"])
    # the backends that load it: an MLX-quantized one (and so a drafter over it) MLX only
    target["backends"] = ["mlx"] if target["quantization"] is not None else ["torch", "mlx"]
    report: dict = {"target": target}
    problems: list[str] = []
    draft = None
    if draft_path is not None:
        draft = describe_draft(draft_path)
        problems = pair_problems(target_cfg, load_draft_config(draft_path))  # every reason it cannot run
        report["draft"] = draft
        report["fit"] = {"ok": not problems, "problems": problems}
    report["memory"] = memory(target, target_cfg, None if problems else draft, context, sessions)
    if draft is not None:
        draft.pop("_config")
    return report, problems


def cmd_inspect(args) -> int:
    report, problems = inspect(args.dir, args.draft, args.context, args.sessions)
    print(json.dumps(report) if args.json else render(report))
    if problems:
        raise ValueError(f"draft {args.draft} does not fit target {args.dir}: " + "; ".join(problems))
    return 0


def _mib(n: int) -> str:
    """``n`` bytes in the largest binary unit that keeps the figure >= 1."""
    unit = 0
    while n >= 1024 ** (unit + 1) and unit < len(UNITS) - 1:
        unit += 1
    return f"{n} bytes" if unit == 0 else f"{n / 1024**unit:,.1f} {UNITS[unit]}"


def render(report: dict) -> str:
    lines = []
    if t := report.get("target"):
        lines.append(f"target {t['path']}")
        lines.append(
            f"  {t['model_type']} {', '.join(t['architectures'])}" + (" (multimodal)" if t["multimodal"] else "")
        )
        lines.append(f"  {t['num_hidden_layers']} layers: {t['layer_pattern']}; sliding window {t['sliding_window']}")
        lines.append(f"  hidden {t['hidden_size']}, vocab {t['vocab_size']}, k_eq_v {t['attention_k_eq_v']}")
        extras = []
        if t["experts"]:
            extras.append(f"MoE: {t['experts']['num_experts']} experts, top {t['experts']['top_k']}")
        if t["per_layer_input"]:
            extras.append(f"per-layer inputs ({t['per_layer_input']})")
        if t["kv_shared_layers"]:
            extras.append(f"KV shared by the last {t['kv_shared_layers']} layers")
        lines.append("  " + ("; ".join(extras) if extras else "dense, no per-layer inputs, no KV sharing"))
        q = t["quantization"]
        quant = "none" if q is None else ", ".join(f"{k} {v}" for k, v in q.items())
        lines.append(f"  dtype {t['dtype']}; quantization {quant}; tensors {t['tensor_dtypes']}")
        lines.append(
            f"  {t['tensors']} tensors in {t['files']} file(s){' (sharded, index)' if t['sharded'] else ''},"
            f" {_mib(t['bytes'])}; LM head {'tied to the embedding' if t['tied_lm_head'] else 'its own'}"
        )
        lines.append(f"  runs on {'/'.join(t['backends'])}")
    if d := report.get("draft"):
        lines.append(f"draft {d['path']}")
        lines.append(f"  {', '.join(d['architectures']) or 'DFlash'}: {d['layout']}")
        lines.append(
            f"  {d['num_hidden_layers']} layers: {d['layer_pattern']}"
            + (f"; sliding window {d['sliding_window']}" if d["sliding_window"] else "")
        )
        lines.append(
            f"  target_layer_ids {d['target_layer_ids']}, mask_token_id {d['mask_token_id']},"
            f" block_size {d['block_size']}, hidden {d['hidden_size']}, vocab {d['vocab_size']}"
        )
        if d["dflash2"]:
            lines.append("  " + ", ".join(f"{k} {v}" for k, v in d["dflash2"].items()))
        lines.append(f"  dtype {d['dtype']}; {d['tensors']} tensors, {_mib(d['bytes'])}")
    if fit := report.get("fit"):
        lines.append("fit: yes" if fit["ok"] else "fit: NO")
        lines += [f"  - {p}" for p in fit["problems"]]
    if m := report.get("memory"):
        kv = m["target_kv_per_session"]
        lines.append(f"memory at context {m['context']} x {m['sessions']} session(s), native cache policy:")
        sa, fa = m["sliding_attention"], m["full_attention"]
        lines.append(
            f"  target K/V heads x head dim: sliding {sa['kv_heads']} x {sa['head_dim']},"
            f" full {fa['kv_heads']} x {fa['head_dim']}"
        )
        lines.append(f"  target weights {_mib(m['target_weights_bytes'])}")
        lines.append(
            f"  target K/V per session {_mib(kv['sliding'] + kv['full'])} (sliding {_mib(kv['sliding'])},"
            f" full {_mib(kv['full'])})"
        )
        if "draft_weights_bytes" in m:
            lines.append(
                f"  draft weights {_mib(m['draft_weights_bytes'])} + its copy of the target's embedding"
                f" and LM head {_mib(m['draft_target_head_bytes'])}"
            )
            lines.append(f"  draft context K/V per session {_mib(m['draft_context_per_session'])}")
        lines.append(f"  total {_mib(m['total_bytes'])}")
    return "\n".join(lines)
