"""Checkpoint-directory validation with one clear error line per problem.

``load_target_config(dir)`` / ``load_draft_config(dir)`` read and check a
``config.json``; ``check_pair(target_cfg, draft_cfg)`` checks that a drafter fits
a target. Every failure raises :class:`CheckpointError` (a ``ValueError``) whose
message names the path and the offending field.

The dicts returned carry the directory they came from under ``"_path"`` (a
string) so ``check_pair`` can name it; it is not part of the checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TARGET_MODEL_TYPES = ("gemma4_text",)
MULTIMODAL_MODEL_TYPES = ("gemma4",)
DRAFT_REQUIRED = ("block_size", "target_layer_ids", "mask_token_id")
PATH_KEY = "_path"


class CheckpointError(ValueError):
    """A checkpoint directory is missing, malformed, or does not fit its partner."""


def _read_config(path: str | Path, what: str) -> tuple[Path, dict[str, Any]]:
    d = Path(path).expanduser()
    if not d.exists():
        raise CheckpointError(f"{what} checkpoint {d}: directory does not exist")
    if not d.is_dir():
        raise CheckpointError(f"{what} checkpoint {d}: not a directory")
    f = d / "config.json"
    if not f.is_file():
        raise CheckpointError(f"{what} checkpoint {d}: no config.json")
    try:
        cfg = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{what} checkpoint {f}: unreadable config.json ({exc})") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{what} checkpoint {f}: config.json is not a JSON object")
    return d, cfg


def _require_int(cfg: dict[str, Any], key: str, where: str, what: str) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise CheckpointError(f"{what} checkpoint {where}: field {key!r} must be an integer, got {value!r}")
    return value


def load_target_config(path: str | Path) -> dict[str, Any]:
    """Read a Gemma-4 text target's config (the ``text_config`` of a multimodal one)."""
    d, cfg = _read_config(path, "target")
    top = cfg
    where = d / "config.json"
    model_type = cfg.get("model_type")
    if model_type in MULTIMODAL_MODEL_TYPES:
        text = cfg.get("text_config")
        if not isinstance(text, dict):
            raise CheckpointError(f"target checkpoint {where}: model_type {model_type!r} has no 'text_config' object")
        if text.get("model_type", "gemma4_text") not in TARGET_MODEL_TYPES:
            raise CheckpointError(
                f"target checkpoint {where}: field 'text_config.model_type' is"
                f" {text.get('model_type')!r}, expected 'gemma4_text'"
            )
        cfg = dict(text)
        cfg.setdefault("model_type", "gemma4_text")
        where_text = f"{where} (text_config)"
    elif model_type in TARGET_MODEL_TYPES:
        cfg = dict(cfg)
        where_text = str(where)
    else:
        raise CheckpointError(
            f"target checkpoint {where}: field 'model_type' is {model_type!r},"
            " expected 'gemma4_text' (or 'gemma4' with a text_config)"
        )
    for key in ("hidden_size", "num_hidden_layers", "vocab_size"):
        _require_int(cfg, key, where_text, "target")
    layer_types = cfg.get("layer_types")
    if layer_types is not None and len(layer_types) != cfg["num_hidden_layers"]:
        raise CheckpointError(
            f"target checkpoint {where_text}: field 'layer_types' has {len(layer_types)} entries,"
            f" num_hidden_layers is {cfg['num_hidden_layers']}"
        )
    cfg["eos_token_id"] = _eos_token_ids(d, top, cfg)
    cfg[PATH_KEY] = str(d)
    return cfg


def _eos_token_ids(d: Path, top: dict[str, Any], text: dict[str, Any]) -> list[int]:
    """The ids that end a generation, read as transformers' ``generate`` and ``mlx_lm.load`` read them:
    ``generation_config.json``'s ``eos_token_id`` when it names one -- an instruction-tuned Gemma lists its
    end-of-turn token there beside ``<eos>``, and a chat that ignored it would run on past its answer --
    else config.json's (a multimodal checkpoint's top level, where its ``text_config`` has none)."""
    gen_file = d / "generation_config.json"
    eos: Any = None
    if gen_file.is_file():
        try:
            eos = json.loads(gen_file.read_text(encoding="utf-8")).get("eos_token_id")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as exc:
            raise CheckpointError(f"target checkpoint {gen_file}: unreadable generation_config.json ({exc})") from None
        where = gen_file
    if eos is None:
        eos = text.get("eos_token_id", top.get("eos_token_id"))
        where = d / "config.json"
    ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise CheckpointError(
            f"target checkpoint {where}: field 'eos_token_id' must be an integer or a list of them, got {eos!r}"
        )
    return ids


def load_draft_config(path: str | Path) -> dict[str, Any]:
    """Read a DFlash drafter's config; ``dflash_config`` must hold the DFlash fields."""
    d, cfg = _read_config(path, "draft")
    where = d / "config.json"
    dflash = cfg.get("dflash_config")
    if not isinstance(dflash, dict):
        raise CheckpointError(f"draft checkpoint {where}: no 'dflash_config' object -- not a DFlash drafter")
    for key in DRAFT_REQUIRED:
        if key not in dflash:
            raise CheckpointError(f"draft checkpoint {where}: field 'dflash_config.{key}' is missing")
    ids = dflash["target_layer_ids"]
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise CheckpointError(
            f"draft checkpoint {where}: field 'dflash_config.target_layer_ids' must be a"
            f" non-empty list of integers, got {ids!r}"
        )
    for key in ("block_size", "mask_token_id"):
        value = dflash[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CheckpointError(
                f"draft checkpoint {where}: field 'dflash_config.{key}' must be a non-negative integer, got {value!r}"
            )
    if dflash["block_size"] < 2:
        raise CheckpointError(
            f"draft checkpoint {where}: field 'dflash_config.block_size' must be >= 2, got {dflash['block_size']}"
        )
    _require_int(cfg, "hidden_size", str(where), "draft")
    cfg = dict(cfg)
    cfg[PATH_KEY] = str(d)
    return cfg


def check_pair(target_cfg: dict[str, Any], draft_cfg: dict[str, Any]) -> None:
    """Raise CheckpointError if the drafter cannot run against the target."""
    tpath = target_cfg.get(PATH_KEY, "<target>")
    dpath = draft_cfg.get(PATH_KEY, "<draft>")
    dflash = draft_cfg.get("dflash_config") or {}
    n_layers = target_cfg["num_hidden_layers"]
    bad = [i for i in dflash.get("target_layer_ids", []) if not 0 <= i < n_layers]
    if bad:
        raise CheckpointError(
            f"draft checkpoint {dpath}: field 'dflash_config.target_layer_ids' has {bad}"
            f" out of range for target {tpath} (num_hidden_layers {n_layers})"
        )
    if draft_cfg.get("hidden_size") != target_cfg["hidden_size"]:
        raise CheckpointError(
            f"draft checkpoint {dpath}: field 'hidden_size' is {draft_cfg.get('hidden_size')},"
            f" target {tpath} has hidden_size {target_cfg['hidden_size']}"
        )
    mask = dflash.get("mask_token_id")
    vocab = target_cfg["vocab_size"]
    if not isinstance(mask, int) or not 0 <= mask < vocab:
        raise CheckpointError(
            f"draft checkpoint {dpath}: field 'dflash_config.mask_token_id' is {mask},"
            f" not below target {tpath} vocab_size {vocab}"
        )
    n_target = draft_cfg.get("num_target_layers")
    if n_target is not None and n_target != n_layers:
        raise CheckpointError(
            f"draft checkpoint {dpath}: field 'num_target_layers' is {n_target},"
            f" target {tpath} has num_hidden_layers {n_layers}"
        )
