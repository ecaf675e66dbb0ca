"""Loading the torch DFlash drafter: its own checkpoint, and ONLY the embedding table and LM
head of its target (the drafter has neither of its own; see ``dflash_torch.TargetHead``)."""

from __future__ import annotations

from pathlib import Path

import torch

from kakeya.backends.torch.ops import resolve_device, resolve_dtype
from kakeya.checkpoints.config import load_target_config
from kakeya.checkpoints.layout import loading, shard_files, torch_text_tensors
from kakeya.drafter.backend import bind, check_target_head
from kakeya.drafter.config import DFlashConfig
from kakeya.drafter.torch_backend.model import DFlashDraftModel, TargetHead, rope_inv_freq


def load_target_head(target_dir: str | Path, device=None, dtype=None) -> TargetHead:
    """Read ONLY the target's embedding table and LM head (tied when the checkpoint has none)."""
    from safetensors import safe_open

    target_dir = Path(target_dir)
    device, dtype = resolve_device(device), resolve_dtype(dtype)
    tied = load_target_config(target_dir)["tie_word_embeddings"]
    names, where = torch_text_tensors(target_dir, "embedding / LM head", tied)

    def get(name: str) -> torch.Tensor:
        with safe_open(str(names[name]), framework="pt") as sf:
            return sf.get_tensor(name).to(device=device, dtype=dtype)

    head = get(where.head + ".weight") if where.head is not None else None
    return check_target_head(TargetHead(get(where.embed + ".weight"), head), target_dir)


def load_draft_model(draft_dir: str | Path, device=None, dtype=None) -> DFlashDraftModel:
    from safetensors.torch import load_file

    draft_dir = Path(draft_dir)
    device, dtype = resolve_device(device), resolve_dtype(dtype)
    config = DFlashConfig.from_dir(draft_dir)
    weights = {name: w for f in shard_files(draft_dir) for name, w in load_file(str(f)).items()}
    with torch.device("meta"):
        if config.dflash2 is not None:
            from kakeya.drafter.torch_backend.dflash2 import DFlash2DraftModel

            model = DFlash2DraftModel(config)
        else:
            model = DFlashDraftModel(config)
    model.inv_freq = rope_inv_freq(config)[0]
    with loading(draft_dir, "draft"):
        model.load_state_dict(weights, strict=True, assign=True)
    model = model.to(device=device, dtype=dtype)
    model.inv_freq = model.inv_freq.float()
    model.eval().requires_grad_(False)
    return model


def load_dflash_torch(draft_dir: str | Path, target_dir: str | Path, device=None, dtype=None) -> DFlashDraftModel:
    """Load the DFlash draft and bind the target's embedding / LM head (same device and dtype)."""
    model = load_draft_model(draft_dir, device, dtype)
    return bind(model, load_target_head(target_dir, model.device, model.dtype))
