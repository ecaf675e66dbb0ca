"""PyTorch implementation of the ``Drafter`` / ``DrafterSession`` protocols.

Same semantics as the MLX drafter (``session.py``): per ``draft`` call the new
aux rows are projected to per-layer context K/V and appended to the session's
``ContextKVCache`` (never a rescan of the context), then ONE forward runs over
the block ``[last_token, mask * (B-1)]`` and the argmax comes back in a single
host sync.

``new_aux`` may be a ``torch.Tensor`` on any device (a colocated torch
verifier), or anything numpy can read (``np.ndarray``, ``mx.array``: a mixed
deployment converts once per block, only the kept rows).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from services import sampling_torch
from services.contract import SamplingParams
from services.drafter.config import aux_rows, check_draft_args
from services.drafter.dflash_torch import DFlashDraftModel, load_dflash_torch
from services.drafter.sampling import sampled_draft, session_sampling


def as_torch(aux, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``aux`` as a floating tensor on ``device`` (numpy round trip for foreign arrays)."""
    if isinstance(aux, torch.Tensor):
        t = aux
    else:
        a = np.asarray(aux)
        if a.dtype.kind != "f":
            raise ValueError(f"new_aux must be floating point, got {a.dtype}")
        t = torch.from_numpy(np.ascontiguousarray(a))
    if not t.is_floating_point():
        raise ValueError(f"new_aux must be floating point, got {t.dtype}")
    return t.to(device=device, dtype=dtype, non_blocking=True)


class TorchDrafterSession:
    def __init__(self, model: DFlashDraftModel, sampling: SamplingParams | None = None):
        self.model = model
        self.sampling, self.rng = session_sampling(sampling)
        self.cache = model.make_cache()
        self._closed = False
        self.calls = 0

    def _check_aux(self, new_aux) -> torch.Tensor:
        aux = as_torch(new_aux, self.model.device, self.model.dtype)
        return aux[0] if aux_rows(tuple(aux.shape), self.model.config.aux_width) else aux

    def draft(self, new_aux, last_token: int, block_size: int) -> list[int]:
        if self._closed:
            raise RuntimeError("drafter session is closed")
        check_draft_args(last_token, block_size, self.model.target.vocab_size)
        aux = self._check_aux(new_aux)
        if self.cache.length + aux.shape[0] == 0:
            raise ValueError("new_aux must hold at least one position on the first draft call")
        self.calls += 1
        self.model.extend(self.cache, aux)
        if block_size == 1:
            return []
        mask_id = self.model.config.mask_token_id
        block = torch.tensor([last_token] + [mask_id] * (block_size - 1), dtype=torch.long)
        block = block.to(self.model.device, non_blocking=True)
        if self.sampling is not None:
            with torch.inference_mode():
                logits = self.model.draft_logits(block, self.cache)
            return sampled_draft(logits, sampling_torch, self.sampling, self.rng)
        return self.model.draft_tokens(block, self.cache).tolist()

    def stats(self) -> dict:
        return {"context_len": self.cache.length, "ctx_cache_bytes": self.cache.nbytes, "draft_calls": self.calls}

    def close(self) -> None:
        self._closed = True
        self.cache = self.model.make_cache()


class TorchDrafter:
    """``Drafter`` protocol over one loaded torch DFlash model (sessions share the weights)."""

    def __init__(
        self,
        draft_dir: str | Path | None = None,
        target_dir: str | Path | None = None,
        device: str | torch.device | None = "cpu",
        dtype: str | torch.dtype | None = "float32",
        *,
        model: DFlashDraftModel | None = None,
    ):
        if model is None:
            if draft_dir is None or target_dir is None:
                raise ValueError("TorchDrafter needs draft_dir and target_dir (or model=)")
            model = load_dflash_torch(draft_dir, target_dir, device, dtype)
        if model.target is None:
            raise ValueError("DFlashDraftModel must be bound to the target's embedding/LM head")
        self.model = model
        self.block_size: int = int(model.config.block_size)
        self.mask_token_id: int = int(model.config.mask_token_id)
        self.target_layer_ids: tuple[int, ...] = tuple(model.config.target_layer_ids)

    @classmethod
    def colocated(cls, draft_dir: str | Path, target) -> "TorchDrafter":
        """Share a loaded ``TargetTorch``'s embedding / LM head tensors (no second copy on the device)."""
        from services.drafter.dflash_torch import TargetHead, load_draft_model

        model = load_draft_model(draft_dir, target.device, target.dtype)
        return cls(model=model.bind(TargetHead(target.model.embed, target.model.lm_head)))

    def open_session(self, sampling: SamplingParams | None = None) -> TorchDrafterSession:
        return TorchDrafterSession(self.model, sampling)

    def warmup(self, ctx: int = 1024, max_block: int = 16) -> float:
        """One context extension of ``ctx`` rows and one draft per block size, before serving."""
        import time

        t0 = time.perf_counter()
        m = self.model
        s = self.open_session()
        aux = torch.zeros((max(1, ctx), m.config.aux_width), device=m.device, dtype=m.dtype)
        s.draft(aux, 2, 1)
        for B in range(2, max_block + 1):
            s.draft(aux[:1], 2, B)
        s.close()
        if m.device.type == "cuda":
            torch.cuda.synchronize(m.device)
        return time.perf_counter() - t0
