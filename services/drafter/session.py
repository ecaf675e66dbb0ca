"""MLX implementation of the ``Drafter`` / ``DrafterSession`` protocols.

Per ``draft`` call the work is O(new positions + block): the new aux rows are
projected to per-layer context K/V and appended to the session's
``ContextKVCache`` (never a rescan of the context), then ONE forward runs over
the block ``[last_token, mask * (B-1)]`` and the argmax comes back in a single
host sync.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import mlx.core as mx

from services import sampling_mlx
from services.contract import SamplingParams
from services.drafter.config import aux_rows, check_draft_args
from services.drafter.dflash_mlx import DFlashDraftModel, load_dflash_mlx
from services.drafter.sampling import sampled_draft, session_sampling



class MLXDrafterSession:
    def __init__(self, model: DFlashDraftModel, sampling: SamplingParams | None = None):
        self.model = model
        self.sampling, self.rng = session_sampling(sampling)
        self.cache = model.make_cache()
        self._closed = False
        self.calls = 0

    # -- validation ------------------------------------------------------------------
    def _check_aux(self, new_aux) -> mx.array:
        if not isinstance(new_aux, mx.array):
            raise ValueError(f"new_aux must be an mx.array, got {type(new_aux).__name__}")
        if aux_rows(new_aux.shape, self.model.config.aux_width):
            new_aux = new_aux[0]
        if not mx.issubdtype(new_aux.dtype, mx.floating):
            raise ValueError(f"new_aux must be floating point, got {new_aux.dtype}")
        return new_aux

    # -- protocol --------------------------------------------------------------------
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
            mx.eval(self.cache.state)
            return []
        mask_id = self.model.config.mask_token_id
        block = mx.array([last_token] + [mask_id] * (block_size - 1), dtype=mx.int32)
        if self.sampling is not None:
            draft = sampled_draft(self.model.draft_logits(block, self.cache), sampling_mlx, self.sampling, self.rng)
            mx.eval(self.cache.state)
            return draft
        tokens = self.model.draft_tokens(block, self.cache)
        mx.eval(tokens, self.cache.state)
        return tokens.tolist()

    def stats(self) -> dict:
        return {
            "context_len": self.cache.length,
            "ctx_cache_bytes": self.cache.nbytes,
            "draft_calls": self.calls,
        }

    def close(self) -> None:
        self._closed = True
        self.cache = self.model.make_cache()


class MLXDrafter:
    """``Drafter`` protocol over one loaded DFlash model (sessions share the weights).

    ``MLXDrafter(draft_dir, target_dir)`` loads the draft checkpoint and only the
    target's embedding / LM head; ``MLXDrafter(model)`` wraps an already bound
    ``DFlashDraftModel``.
    """

    def __init__(
        self,
        draft: str | Path | DFlashDraftModel,
        target_dir: str | Path | None = None,
        dtype: Optional[mx.Dtype] = None,
    ):
        if isinstance(draft, DFlashDraftModel):
            if target_dir is not None or dtype is not None:
                raise ValueError("target_dir/dtype apply only when loading from a draft directory")
            model = draft
        else:
            if target_dir is None:
                raise ValueError("target_dir is required to load the drafter's embedding/LM head")
            model = load_dflash_mlx(draft, target_dir, dtype=dtype)
        if model.target is None:
            raise ValueError("DFlashDraftModel must be bound to the target's embedding/LM head")
        self.model = model
        self.block_size: int = int(model.config.block_size)
        self.mask_token_id: int = int(model.config.mask_token_id)
        self.target_layer_ids: tuple[int, ...] = tuple(model.config.target_layer_ids)

    @classmethod
    def load(
        cls, draft_dir: str | Path, target_dir: str | Path, dtype: Optional[mx.Dtype] = None
    ) -> "MLXDrafter":
        return cls(draft_dir, target_dir, dtype=dtype)

    def open_session(self, sampling: SamplingParams | None = None) -> MLXDrafterSession:
        return MLXDrafterSession(self.model, sampling)
