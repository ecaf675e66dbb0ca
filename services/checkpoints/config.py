"""Checkpoint-directory reading: one normalised reading of every published spelling, one clear error per problem.

Every reader reads a config through :func:`target_config` (a Gemma-4 text model as transformers reads it, every field
made explicit with transformers' default, since mlx-lm's differ; :func:`mlx_model_config`: the same in mlx-lm's shape)
and :func:`draft_config` (a DFlash drafter as the ``dflash`` package reads it), so a spelling is understood or refused
once. ``check_pair`` checks that a drafter fits a target. Failures raise :class:`CheckpointError` (a ``ValueError``)
naming the file, the field and what was expected; loaded dicts carry their directory under ``"_path"``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TARGET_MODEL_TYPES = ("gemma4_text",)
MULTIMODAL_MODEL_TYPES = ("gemma4",)
PATH_KEY = "_path"
FULL, SLIDING = "full_attention", "sliding_attention"
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # as checkpoints/tokenizer.py writes it

# transformers' Gemma4TextConfig defaults for every field the model code of either backend reads: a field the
# file leaves out means what transformers (which wrote it) reads back, never mlx-lm's own default.
GEMMA4_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size_per_layer_input": 262_144,
    "hidden_size_per_layer_input": 256,
    "intermediate_size": 9216,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "global_head_dim": 512,  # transformers pops it with this default when no per_layer_config is given
    "num_global_key_value_heads": None,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "sliding_window": 512,
    "final_logit_softcapping": None,
    "attention_k_eq_v": False,
    "num_kv_shared_layers": 0,
    "enable_moe_block": False,
    "use_double_wide_mlp": False,
    "num_experts": None,
    "top_k_experts": None,
    "moe_intermediate_size": None,
}
GEMMA4_ROPE_DEFAULTS = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
QWEN3_DEFAULT_THETA = 10_000.0  # transformers' default_theta, what a drafter without any RoPE field runs at
DFLASH_DEFAULT_BLOCK = 16  # the dflash package's DFlashDraftModel default
DFLASH_FIELDS = ("block_size", "target_layer_ids", "mask_token_id", "input_embedding_scale", "output_multiplier")
DFLASH_FIELDS += ("final_logit_softcapping",)


class CheckpointError(ValueError):
    """A checkpoint directory is missing, malformed, or does not fit its partner."""


def read_json(f: Path, what: str) -> dict[str, Any]:
    try:
        cfg = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{what} checkpoint {f}: unreadable {f.name} ({exc})") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{what} checkpoint {f}: {f.name} is not a JSON object")
    return cfg


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require_int(cfg: dict[str, Any], key: str, where: str, what: str) -> int:
    value = cfg.get(key)
    if not _int(value):
        raise CheckpointError(f"{what} checkpoint {where}: field {key!r} must be an integer, got {value!r}")
    return value


def load_target_config(path: str | Path) -> dict[str, Any]:
    """Read a Gemma-4 target's config (the ``text_config`` of a multimodal one): :func:`target_config`."""
    return _load(path, "target", target_config)


def _load(path: str | Path, what: str, reading) -> dict[str, Any]:
    """``reading`` of the config at ``path`` (``what``: "target" / "draft", for errors), its directory kept."""
    d = Path(path)
    if not d.exists():
        raise CheckpointError(f"{what} checkpoint {d}: directory does not exist")
    if not d.is_dir():
        raise CheckpointError(f"{what} checkpoint {d}: not a directory")
    if not (d / "config.json").is_file():
        raise CheckpointError(f"{what} checkpoint {d}: no config.json")
    cfg = reading(read_json(d / "config.json", what), d)
    cfg[PATH_KEY] = str(d)
    return cfg


def target_config(raw: dict[str, Any], directory: str | Path | None = None) -> dict[str, Any]:
    """The one reading of a Gemma-4 target's ``config.json`` dict: its text model's fields in the hub's spelling,
    every field the model code reads explicit, ``eos_token_id`` a list and ``chat_template`` the template's
    source (None without one) when ``directory`` is given. Idempotent: a reading reads back as itself."""
    d = Path(directory) if directory is not None else None
    where = f"{d / 'config.json'}" if d is not None else "config.json"
    model_type = raw.get("model_type")
    if model_type in MULTIMODAL_MODEL_TYPES:
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise CheckpointError(f"target checkpoint {where}: model_type {model_type!r} has no 'text_config' object")
        if text.get("model_type", "gemma4_text") not in TARGET_MODEL_TYPES:
            raise CheckpointError(
                f"target checkpoint {where}: field 'text_config.model_type' is"
                f" {text.get('model_type')!r}, expected 'gemma4_text'"
            )
        cfg, field = dict(text), "text_config."
        if "vocab_size" not in cfg and "vocab_size" in raw:  # mlx-lm's wrapper args keep it at the top level
            cfg["vocab_size"] = raw["vocab_size"]
    elif model_type in TARGET_MODEL_TYPES:
        cfg, field = dict(raw), ""
    else:
        raise CheckpointError(
            f"target checkpoint {where}: field 'model_type' is {model_type!r},"
            " expected 'gemma4_text' (or 'gemma4' with a text_config)"
        )
    cfg["model_type"] = "gemma4_text"
    for key in ("hidden_size", "num_hidden_layers", "vocab_size"):
        _require_int(cfg, key, where, "target")
    if cfg.get("use_bidirectional_attention") == "all":
        raise CheckpointError(
            f"target checkpoint {where}: field '{field}use_bidirectional_attention' is 'all' (an encoder that"
            " sees every position), expected null or 'vision': only causal Gemma-4 generators are served"
        )
    for key, value in GEMMA4_TEXT_DEFAULTS.items():
        cfg.setdefault(key, value)  # an explicit null stays null, as transformers reads it
    cfg["layer_types"] = _layer_types(cfg, where, field)
    _per_layer_config(cfg, where, field)
    rope = {k: dict(v) for k, v in GEMMA4_ROPE_DEFAULTS.items()}
    for k, v in (cfg.get("rope_parameters") or {}).items():
        if isinstance(v, dict):
            rope[k] = dict(v)
    cfg["rope_parameters"] = rope
    if d is not None:
        cfg["eos_token_id"] = _eos_token_ids(d, raw, cfg)
        cfg["chat_template"] = chat_template_source(d)
    return cfg


def _layer_types(cfg: dict[str, Any], where: str, field: str) -> list[str]:
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:  # transformers' default pattern (mlx-lm's sliding_window_pattern default differs)
        types = [SLIDING if (i + 1) % 6 else FULL for i in range(n)]
    _check_layer_types(types, n, f"target checkpoint {where}: field '{field}layer_types'")
    if FULL not in types:
        # every layer slides: kept as written, as mlx-lm reads it (transformers would force the last layer full
        # and could not load its weights); the vehicle on which only f_theta brings back an evicted needle
        return list(types)
    return list(types[:-1]) + [FULL]  # transformers forces the last layer of a hybrid to full attention


def _check_layer_types(types: Any, n: int, what: str) -> None:
    if not isinstance(types, list) or len(types) != n or any(t not in (FULL, SLIDING) for t in types):
        raise CheckpointError(
            f"{what} must list {n} entries (num_hidden_layers), each 'sliding_attention' or 'full_attention',"
            f" got {types!r}"
        )


def _per_layer_config(cfg: dict[str, Any], where: str, field: str) -> None:
    """transformers >= 5.2 writes the full layers' shapes as per-layer overrides; read them back into the hub's
    ``global_head_dim`` / ``num_global_key_value_heads``, the spelling mlx-lm and the torch model read."""
    per_layer = cfg.pop("per_layer_config", None)
    if per_layer is None:  # absent; {} (no layer overridden) means full layers of head_dim, as transformers builds
        return
    name = f"'{field}per_layer_config'"
    if not isinstance(per_layer, dict):
        raise CheckpointError(f"target checkpoint {where}: field {name} must be an object, got {per_layer!r}")
    full = [i for i, t in enumerate(cfg["layer_types"]) if t == FULL]
    overrides = {int(k): v for k, v in per_layer.items()}
    if odd := sorted(set(overrides) - set(full)):
        raise CheckpointError(
            f"target checkpoint {where}: field {name} overrides layers {odd}, expected only the full-attention"
            f" layers {full} (Gemma-4's global head shape)"
        )
    seen = {json.dumps(overrides.get(i, {}), sort_keys=True) for i in full}
    if len(seen) != 1:
        raise CheckpointError(
            f"target checkpoint {where}: field {name} gives the full-attention layers different shapes {sorted(seen)},"
            " expected one shape for all of them (Gemma-4's global_head_dim / num_global_key_value_heads)"
        )
    one = overrides.get(full[0], {}) if full else {}
    if extra := sorted(set(one) - {"head_dim", "num_key_value_heads"}):
        raise CheckpointError(
            f"target checkpoint {where}: field {name} overrides {extra}, expected only 'head_dim' and"
            " 'num_key_value_heads'"
        )
    cfg["global_head_dim"] = int(one.get("head_dim", cfg["head_dim"]))
    kv = one.get("num_key_value_heads")
    if kv is not None and not cfg["attention_k_eq_v"] and kv != cfg["num_key_value_heads"]:
        raise CheckpointError(
            f"target checkpoint {where}: field {name} gives full layers {kv} key/value heads without"
            f" 'attention_k_eq_v', expected num_key_value_heads ({cfg['num_key_value_heads']}): Gemma-4 has"
            " other global key/value heads only on k_eq_v layers"
        )
    cfg["num_global_key_value_heads"] = None if kv is None else int(kv)


def mlx_model_config(raw: dict[str, Any], text: dict[str, Any]) -> dict[str, Any]:
    """What mlx-lm's ``load_model(model_config=...)`` lays over ``raw`` so its model args read ``text`` (a
    :func:`target_config` reading): the multimodal wrapper's args overwrite ``text_config.vocab_size`` with
    their own top-level one (262144 when absent), so it goes at both levels."""
    keep = {k: v for k, v in text.items() if k not in (PATH_KEY, "chat_template")}
    multimodal = raw.get("model_type") in MULTIMODAL_MODEL_TYPES
    return {"text_config": keep, "vocab_size": text["vocab_size"]} if multimodal else keep


def _eos_token_ids(d: Path, top: dict[str, Any], text: dict[str, Any]) -> list[int]:
    """The ids that end a generation, as transformers and ``mlx_lm.load`` read them: ``generation_config.json``'s
    ``eos_token_id`` when it names one (an instruction-tuned Gemma lists its end-of-turn token there), else
    config.json's (a multimodal checkpoint's top level, where its ``text_config`` has none)."""
    gen_file = d / "generation_config.json"
    eos: Any = None
    if gen_file.is_file():
        eos = read_json(gen_file, "target").get("eos_token_id")
        where = gen_file
    if eos is None:
        eos = text.get("eos_token_id", top.get("eos_token_id"))
        where = d / "config.json"
    ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if not all(_int(i) for i in ids):
        raise CheckpointError(
            f"target checkpoint {where}: field 'eos_token_id' must be an integer or a list of them, got {eos!r}"
        )
    return ids


def chat_template_source(d: str | Path) -> str | None:
    """The checkpoint's chat template, as transformers reads it: ``chat_template.jinja`` when present, else
    ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of named ones: the ``default``)."""
    d = Path(d)
    if (d / CHAT_TEMPLATE_FILE).is_file():
        return (d / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8") or None
    cfg_file = d / "tokenizer_config.json"
    source = read_json(cfg_file, "target").get("chat_template") if cfg_file.is_file() else None
    if isinstance(source, list):
        source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None)
    if source is not None and not isinstance(source, str):
        raise CheckpointError(
            f"target checkpoint {cfg_file}: field 'chat_template' must be a string or a list of"
            f" {{'name', 'template'}} objects, got {type(source).__name__}"
        )
    return source or None


def load_draft_config(path: str | Path) -> dict[str, Any]:
    """Read a DFlash drafter's config: :func:`draft_config`."""
    return _load(path, "draft", draft_config)


def draft_config(raw: dict[str, Any], directory: str | Path | None = None) -> dict[str, Any]:
    """The one reading of a DFlash drafter's ``config.json`` dict, as the ``dflash`` package and transformers'
    ``Qwen3Config`` read it: the DFlash fields in ``dflash_config``, ``rope_parameters`` (and ``rope_theta`` /
    ``rope_scaling`` beside it, the same values), ``layer_types`` / ``sliding_window`` explicit. Idempotent."""
    where = f"{Path(directory) / 'config.json'}" if directory is not None else "config.json"
    dflash = raw.get("dflash_config")
    if not isinstance(dflash, dict):
        raise CheckpointError(f"draft checkpoint {where}: no 'dflash_config' object -- not a DFlash drafter")
    cfg, dflash = dict(raw), dict(dflash)
    for key in ("hidden_size", "num_hidden_layers"):
        _require_int(cfg, key, where, "draft")
    # The dflash package reads each DFlash field from dflash_config first, then from the top level.
    for key in DFLASH_FIELDS:
        if key not in dflash and cfg.get(key) is not None:
            dflash[key] = cfg[key]
    dflash.setdefault("block_size", DFLASH_DEFAULT_BLOCK)
    if "target_layer_ids" not in dflash and _int(cfg.get("num_target_layers")):
        dflash["target_layer_ids"] = _spread_layer_ids(cfg["num_target_layers"], cfg["num_hidden_layers"])
    for key in ("target_layer_ids", "mask_token_id"):
        if key not in dflash:
            raise CheckpointError(
                f"draft checkpoint {where}: field 'dflash_config.{key}' is missing (nor at the top level"
                + (", nor num_target_layers to spread them over)" if key == "target_layer_ids" else ")")
            )
    ids = dflash["target_layer_ids"]
    if not isinstance(ids, list) or not ids or not all(_int(i) for i in ids):
        raise CheckpointError(
            f"draft checkpoint {where}: field 'dflash_config.target_layer_ids' must be a"
            f" non-empty list of integers, got {ids!r}"
        )
    for key in ("block_size", "mask_token_id"):
        value = dflash[key]
        if not _int(value) or value < 0:
            raise CheckpointError(
                f"draft checkpoint {where}: field 'dflash_config.{key}' must be a non-negative integer, got {value!r}"
            )
    if dflash["block_size"] < 2:
        raise CheckpointError(
            f"draft checkpoint {where}: field 'dflash_config.block_size' must be >= 2, got {dflash['block_size']}"
        )
    cfg["dflash_config"] = dflash
    cfg.pop("block_size", None)  # one place for each DFlash field: dflash_config
    _draft_rope(cfg)
    _draft_layers(cfg, where)
    return cfg


def _spread_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The dflash package's ``build_target_layer_ids``: the layers a drafter reads when its config names none."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def _draft_rope(cfg: dict[str, Any]) -> None:
    """transformers' precedence: ``rope_scaling`` over ``rope_parameters``; a ``rope_theta`` inside them over
    the top-level one over the default; ``type`` is the old name of ``rope_type``."""
    rope = dict(cfg.pop("rope_scaling", None) or cfg.get("rope_parameters") or {})
    rope.setdefault("rope_theta", cfg.get("rope_theta") if cfg.get("rope_theta") is not None else QWEN3_DEFAULT_THETA)
    rope.setdefault("rope_type", rope.get("type", "default"))
    cfg["rope_parameters"] = rope
    cfg["rope_scaling"] = rope
    cfg["rope_theta"] = float(rope["rope_theta"])


def _draft_layers(cfg: dict[str, Any], where: str) -> None:
    """Sliding drafter layers: without ``layer_types``, ``Qwen3Config``'s rule (``use_sliding_window``: the layers from
    ``max_window_layers`` on); with it, its sliding layers keep ``sliding_window``, as the dflash package's MLX model
    reads it: one reading on both backends, what the writer meant."""
    n = cfg["num_hidden_layers"]
    cfg["num_key_value_heads"] = cfg.get("num_key_value_heads") or cfg.get("num_attention_heads")
    if cfg.get("head_dim") is None:
        cfg["head_dim"] = 128  # Qwen3Config's default (the dflash package reads config.head_dim)
    types = cfg.get("layer_types")
    window = cfg.get("sliding_window", 4096 if cfg.get("use_sliding_window") else None)
    if types is None:
        window = window if cfg.get("use_sliding_window") else None
        first = cfg.get("max_window_layers", 28)
        types = [SLIDING if window is not None and i >= first else FULL for i in range(n)]
    _check_layer_types(types, n, f"draft checkpoint {where}: field 'layer_types'")
    if SLIDING not in types:
        window = None
    elif not _int(window) or window < 1:
        raise CheckpointError(
            f"draft checkpoint {where}: field 'sliding_window' is {window!r}, expected a positive integer:"
            " 'layer_types' names sliding_attention layers"
        )
    cfg["layer_types"] = list(types)
    cfg["sliding_window"] = window
    cfg["use_sliding_window"] = window is not None


def pair_problems(target_cfg: dict[str, Any], draft_cfg: dict[str, Any]) -> list[str]:
    """Each field of the drafter that does not fit the target, naming the target ([] when it fits)."""
    tpath = target_cfg.get(PATH_KEY, "<target>")
    dflash = draft_cfg.get("dflash_config") or {}
    n_layers, vocab, problems = target_cfg["num_hidden_layers"], target_cfg["vocab_size"], []
    if bad := [i for i in dflash.get("target_layer_ids", []) if not 0 <= i < n_layers]:
        problems.append(
            f"field 'dflash_config.target_layer_ids' has {bad} out of range for target {tpath}"
            f" (num_hidden_layers {n_layers})"
        )
    if draft_cfg.get("hidden_size") != target_cfg["hidden_size"]:
        problems.append(
            f"field 'hidden_size' is {draft_cfg.get('hidden_size')}, target {tpath} has hidden_size"
            f" {target_cfg['hidden_size']}"
        )
    mask = dflash.get("mask_token_id")
    if not isinstance(mask, int) or not 0 <= mask < vocab:
        problems.append(f"field 'dflash_config.mask_token_id' is {mask}, not below target {tpath} vocab_size {vocab}")
    if (draft_vocab := draft_cfg.get("vocab_size")) not in (None, vocab):  # drafts in another tokenizer's ids
        problems.append(f"field 'vocab_size' is {draft_vocab}, target {tpath} has vocab_size {vocab}")
    n_target = draft_cfg.get("num_target_layers")
    if n_target is not None and n_target != n_layers:
        problems.append(f"field 'num_target_layers' is {n_target}, target {tpath} has num_hidden_layers {n_layers}")
    return problems


def check_pair(target_cfg: dict[str, Any], draft_cfg: dict[str, Any]) -> None:
    """Raise CheckpointError naming every field of the drafter that does not fit the target."""
    if problems := pair_problems(target_cfg, draft_cfg):
        raise CheckpointError(f"draft checkpoint {draft_cfg.get(PATH_KEY, '<draft>')}: " + "; ".join(problems))
