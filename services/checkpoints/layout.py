"""Where a Hugging Face checkpoint directory keeps its tensors (framework-free: no torch, no MLX).

* :func:`shard_files` / :func:`tensor_files`: the safetensors files and which holds each tensor (a sharded
  checkpoint's ``model.safetensors.index.json`` ``weight_map``, else every ``*.safetensors``' header).
* :func:`find_text_tensors`: where a Gemma-style target keeps its text model -- the name prefix
  (``model.``, ``model.language_model.`` ...), the embedding and the LM head (None when tied). The torch
  target reads its text model under that prefix; both drafters borrow the embedding and the head.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kakeya.checkpoints.config import CheckpointError

SAFETENSORS_INDEX = "model.safetensors.index.json"

# The embedding / LM head module names, plain and multimodal layouts, most common first.
EMBED_NAMES = (
    "model.embed_tokens",
    "model.language_model.embed_tokens",
    "language_model.model.embed_tokens",
    "model.language_model.model.embed_tokens",
    "embed_tokens",
)
HEAD_NAMES = ("lm_head", "language_model.lm_head", "model.language_model.lm_head", "model.lm_head")
# Towers and per-layer tables whose names may also end in embed_tokens / lm_head.
NOT_TEXT = ("vision", "audio", "multi_modal", "per_layer")


def shard_files(ckpt_dir: str | Path) -> list[Path]:
    """The checkpoint's safetensors files (the index's shards when it has one), sorted, each checked whole."""
    ckpt_dir = Path(ckpt_dir)
    index = ckpt_dir / SAFETENSORS_INDEX
    if index.is_file():
        files = sorted({ckpt_dir / f for f in _weight_map(index).values()})
        if missing := [f.name for f in files if not f.is_file()]:
            raise FileNotFoundError(f"{index} names missing shards {missing}")
    else:
        files = sorted(ckpt_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in checkpoint {ckpt_dir}")
    for f in files:
        safetensors_header(f)  # a download cut short is named here, not deep in a backend's loader
    return files


def tensor_files(ckpt_dir: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it (no tensor data is read)."""
    ckpt_dir, files = Path(ckpt_dir), shard_files(ckpt_dir)  # every shard there and whole
    held, index = {name: f for f in files for name in safetensors_header(f)}, ckpt_dir / SAFETENSORS_INDEX
    listed = {name: ckpt_dir / f for name, f in _weight_map(index).items()} if index.is_file() else held
    if wrong := next((n for n, f in listed.items() if held.get(n) != f), None):
        raise CheckpointError(f"{index}: weight_map puts {wrong!r} in {listed[wrong].name}, which does not hold it")
    return listed


def safetensors_header(path: str | Path) -> dict:
    """A safetensors file's header (tensor name -> dtype, shape, data_offsets), without its data."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(8)
            if len(raw) != 8:
                raise ValueError("no header")
            (n,), size = struct.unpack("<Q", raw), Path(path).stat().st_size
            if n > size:
                raise ValueError(f"header length {n} is past the end of the file")
            header = json.loads(fh.read(n))
        tensors = {k: v for k, v in header.items() if k != "__metadata__"}
        end = 8 + n + max((meta["data_offsets"][1] for meta in tensors.values()), default=0)
    except (ValueError, UnicodeDecodeError, OSError, AttributeError, LookupError, TypeError) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from None
    if end > size:
        raise CheckpointError(f"{path}: truncated at {size} bytes, its tensors end at {end}: download it again")
    return tensors


@contextmanager
def loading(ckpt: str | Path, what: str):
    """A weights loader's complaint (a tensor missing, unexpected or of another shape: torch's RuntimeError, mlx's
    ValueError, each over several lines and naming no directory) as one line naming the ``what`` checkpoint."""
    try:
        yield
    except (ValueError, RuntimeError) as exc:
        if type(exc).__name__ == "OutOfMemoryError":  # torch's, a RuntimeError: the device is full, not the checkpoint
            raise
        raise CheckpointError(f"{what} checkpoint {ckpt}: {' '.join(str(exc).split())}") from None


def _weight_map(index: Path) -> dict[str, str]:
    try:
        wm = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (ValueError, OSError, AttributeError) as exc:  # cut short, not JSON, not an object
        raise CheckpointError(f"{index}: unreadable ({exc})") from None
    if not isinstance(wm, dict) or not wm:
        raise ValueError(f"{index} has no weight_map")
    return wm


def is_quantized(names: Iterable[str]) -> bool:
    """An MLX-quantized checkpoint (``.scales`` beside the packed weights)."""
    return any(k.endswith(".scales") for k in names)


@dataclass(frozen=True)
class TextTensors:
    """Module names (without ``.weight``) of a target's text model in its checkpoint."""

    prefix: str  # put before "layers.N. ...", "norm.weight": "model.", "model.language_model.", ...
    embed: str  # e.g. "model.embed_tokens"
    head: str | None  # e.g. "lm_head"; None: the checkpoint has no LM head (tied to the embedding)


def find_text_tensors(names: Iterable[str], ckpt: str | Path, tied: bool) -> TextTensors:
    """Locate the embedding table, its prefix and the LM head among a checkpoint's tensor names
    (``ckpt`` only names the checkpoint in the error); ``tied``: its config's ``tie_word_embeddings``, which
    makes the embedding the head (a stray ``lm_head`` ignored, as transformers ties it)."""
    names = set(names)
    embed = _find(names, EMBED_NAMES, "embed_tokens")
    if embed is None:
        raise CheckpointError(f"no embed_tokens weight in target checkpoint {ckpt}".rstrip())
    prefix = embed[: -len("embed_tokens")]
    head = None if tied else _find(names, HEAD_NAMES + (prefix + "lm_head",), "lm_head")
    if head is None and not tied:
        raise CheckpointError(f"target checkpoint {ckpt}: tie_word_embeddings is false, yet no lm_head.weight")
    return TextTensors(prefix, embed, head)


def torch_text_tensors(ckpt: str | Path, what: str, tied: bool) -> tuple[dict[str, Path], TextTensors]:
    """:func:`tensor_files` and :func:`find_text_tensors` of a target the torch backend reads (``what``: which of
    its tensors, for the error): MLX-quantized ones it refuses by name."""
    names = tensor_files(ckpt)
    if is_quantized(names):
        raise ValueError(
            f"target checkpoint {ckpt}: MLX-quantized {what} (.scales beside packed weights, mlx_lm.convert -q) are"
            " read by the MLX backend only; use --backend mlx, or the unquantized checkpoint on torch"
        )
    return names, find_text_tensors(names, ckpt, tied)


def _find(names: set[str], known: tuple[str, ...], suffix: str) -> str | None:
    for n in known:
        if f"{n}.weight" in names:
            return n
    for k in sorted(names):
        if k.endswith(f".{suffix}.weight") and not any(s in k for s in NOT_TEXT):
            return k[: -len(".weight")]
    return None
