"""A loaded DFlash drafter in this process (:class:`LocalDrafter`, :class:`MLXDrafter`, :class:`TorchDrafter`):
the Drafter protocol without a wire (over gRPC: ``orchestrator/remote/drafter.py``); many sessions' blocks
drafted in one forward (``session.draft_batch``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path

from kakeya.core.contract import SessionOptions
from kakeya.core.prefix import PrefixCache
from kakeya.core.request import SamplingParams
from kakeya.drafter.backend import DraftModel, bind
from kakeya.drafter.session import WARM_BLOCK_SIZES, LocalDrafterSession, draft_batch


class LocalDrafter:
    """``Drafter`` protocol over one loaded DFlash model (either backend); sessions share the weights.
    ``prefixes``: their prefix cache (None: none)."""

    def __init__(self, model: DraftModel, prefixes: PrefixCache | None = None):
        if model.target is None:
            raise ValueError("DFlashDraftModel must be bound to the target's embedding/LM head")
        self.model = model
        self.prefixes = prefixes
        self.backend: str = model.backend
        self.block_size: int = int(model.config.block_size)
        self.mask_token_id: int = int(model.config.mask_token_id)
        self.target_layer_ids: tuple[int, ...] = tuple(model.config.target_layer_ids)
        # what must fit the target it drafts for
        self.vocab_size, self.hidden_size = model.target.vocab_size, model.config.hidden_size
        self.model_name = ""  # its checkpoint, once ``drafter/loader.py`` loaded it from one

    def open_session(
        self, sampling: SamplingParams | None = None, options: SessionOptions | None = None
    ) -> LocalDrafterSession:
        ranked = options.ranked if options is not None else 0
        return LocalDrafterSession(self.model, sampling, self.prefixes, ranked)

    open_session_now = open_session  # in this process no failure backs the drafter off

    def status(self) -> dict[str, str]:
        return {}  # in this process: no connection to lose

    draft_batch = staticmethod(draft_batch)  # ``session.draft_batch`` itself: no wrapper a round passes through

    def warm_up(self, block_sizes: Iterable[int] = WARM_BLOCK_SIZES, ctx: int = 64, aux=None) -> float:
        """One short session drafting each block size once, before serving; returns the seconds it took.
        ``aux``: the first call's context rows (a server's, through its wire decoding; default ``ctx`` zeros)."""
        t0 = time.perf_counter()
        s = self.open_session()
        s.draft(self.model.zeros_aux(max(1, ctx)) if aux is None else aux, 2, 1)
        one = self.model.zeros_aux(1)
        for B in block_sizes:
            s.draft(one, 2, B)
        s.close()
        self.model.synchronize()
        return time.perf_counter() - t0


class MLXDrafter(LocalDrafter):
    """The MLX drafter: ``MLXDrafter(draft_dir, target_dir, dtype=None)`` loads the draft and only the
    target's embedding / LM head; ``MLXDrafter(model)`` wraps an already bound model."""

    def __init__(self, draft, target_dir: str | Path | None = None, dtype=None, **shared):
        """``shared``: :class:`LocalDrafter`'s ``prefixes``."""
        from kakeya.drafter.mlx_backend.model import DFlashDraftModel, load_dflash_mlx

        if isinstance(draft, DFlashDraftModel):
            if target_dir is not None or dtype is not None:
                raise ValueError("target_dir/dtype apply only when loading from a draft directory")
            model = draft
        else:
            if target_dir is None:
                raise ValueError("target_dir is required to load the drafter's embedding/LM head")
            model = load_dflash_mlx(draft, target_dir, dtype=dtype)
        super().__init__(model, **shared)


class TorchDrafter(LocalDrafter):
    """The torch drafter: ``TorchDrafter(draft_dir, target_dir, device, dtype)`` or ``TorchDrafter(model=...)``."""

    def __init__(
        self,
        draft_dir=None,
        target_dir=None,
        device="cpu",
        dtype="float32",
        *,
        model=None,
        cuda_graphs: bool | None = None,
        graph_options=None,
        compile: bool = False,
        graphed_min_batch: int | None = None,
        attention_kernel: bool | None = None,
        **shared,
    ):
        """``cuda_graphs``: capture every draft step (default: on for CUDA); ``graph_options`` (a
        ``GraphOptions``) overrides it and ``graphed_min_batch``; ``compile``: ``DFlashDraftModel.compile_layers``;
        ``attention_kernel``: ``DFlashDraftModel.use_attention_kernel``; ``shared``: :class:`LocalDrafter`'s."""
        from kakeya.backends.torch.graphs import GraphOptions

        if model is None:
            if draft_dir is None or target_dir is None:
                raise ValueError("TorchDrafter needs draft_dir and target_dir (or model=)")
            from kakeya.drafter.torch_backend.load import load_dflash_torch

            model = load_dflash_torch(draft_dir, target_dir, device, dtype)
        model.fuse_projections()
        model.use_attention_kernel(attention_kernel)
        options = graph_options or GraphOptions.for_device(model.device, cuda_graphs, graphed_min_batch)
        if options.static_extent:
            model.use_graphs(options)
        if compile:
            model.compile_layers()
        super().__init__(model, **shared)

    @classmethod
    def colocated(
        cls, draft_dir: str | Path, target, cuda_graphs: bool | None = None, compile: bool = False
    ) -> TorchDrafter:
        """Share a loaded ``TargetTorch``'s embedding / LM head tensors (no second copy on the device)."""
        from kakeya.drafter.torch_backend.load import load_draft_model
        from kakeya.drafter.torch_backend.model import TargetHead

        model = load_draft_model(draft_dir, target.device, target.dtype)
        head = TargetHead(target.model.embed, target.model.lm_head)
        return cls(model=bind(model, head), cuda_graphs=cuda_graphs, compile=compile)
