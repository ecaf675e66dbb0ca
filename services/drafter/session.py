"""One generation's drafter state, and the loaded drafter that hands sessions out (backend-neutral).

Per ``draft`` call the work is O(new positions + block): the new aux rows are
projected to per-layer context K/V and appended to the session's context cache
(never a rescan of the context), then ONE forward runs over the block
``[last_token, mask * (B-1)]`` and the argmax comes back in a single host sync
(a sampling session: its noisy argmax under the coupled rule, or the [B-1, K]
proposal each candidate is drawn from under the rejection rule; see
``sampling.py``).

A draft alone is :func:`draft_together` of one session, the same code
``batch.draft_batch`` runs for several; only a greedy block on a model with a
static step (torch with CUDA graphs) takes that step instead. The model is a
``DraftModel`` (``backend.py``: the torch or MLX ``DFlashDraftModel``), asked
for nothing but what that protocol declares; the cache bookkeeping lives in
``context.py``. A session owns its cache; sessions share only the weights.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterable, Sequence

from kakeya.core.contract import Draft, SamplingParams, SessionOptions
from kakeya.drafter.backend import DraftModel, bind, extend
from kakeya.drafter.config import check_draft_args
from kakeya.drafter.sampling import session_rule

WARM_BLOCK_SIZES = range(2, 17)  # every block size the loop drafts (it stops at 16)


class _Empty:
    """A closed session's cache."""

    length = nbytes = 0


_EMPTY = _Empty()
NOTHING = Draft(())  # a block of size 1 drafts nothing (its call only extends the context)


class DrafterSession:
    def __init__(self, model: DraftModel, sampling: SamplingParams | None = None):
        self.model = model
        self.rule = session_rule(sampling)  # None: greedy
        self.cache = model.make_cache()
        self.calls = 0
        self._closed = False

    def draft(self, new_aux, last_token: int, block_size: int) -> Draft:
        """Extend the context by ``new_aux`` and draft ``block_size - 1`` tokens after ``last_token``."""
        return self.run(self.check(new_aux, last_token, block_size), last_token, block_size)

    def run(self, aux, last_token: int, block_size: int) -> Draft:
        """``draft`` after ``check``: ``aux`` is what ``check`` returned."""
        step = self.model.static_step
        if step is not None and self.rule is None and block_size > 1:
            self.calls += 1
            return Draft(step.draft(self.cache, aux, last_token, block_size))
        return draft_together([(self, aux, last_token, block_size)])[0]

    def check(self, new_aux, last_token: int, block_size: int):
        """Validate one draft call's arguments (ValueError naming the field); ``new_aux`` as the model's rows."""
        if self._closed:
            raise RuntimeError("drafter session is closed")
        check_draft_args(last_token, block_size, self.model.target.vocab_size)
        aux = self.model.read_aux(new_aux)
        if self.cache.length + aux.shape[0] == 0:
            raise ValueError("new_aux must hold at least one position on the first draft call")
        return aux

    def stats(self) -> dict:
        return {"context_len": self.cache.length, "ctx_cache_bytes": self.cache.nbytes, "draft_calls": self.calls}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.model.release_cache(self.cache)
        self.cache = _EMPTY  # frees the K/V now (or hands it to the next session), not when collected


def draft_together(work: Sequence[tuple[DrafterSession, Any, int, int]]) -> list[Draft]:
    """Checked draft calls ``(session, aux, last_token, block_size)`` of sessions of one model: ONE
    context extension, ONE forward over every block of size >= 2, one host sync for the greedy ones
    (a sampling session's candidates come from its own logits rows, its own seed and positions)."""
    model = work[0][0].model
    caches = [session.cache for session, *_ in work]
    for session, *_ in work:
        session.calls += 1
    extend(model, caches, [aux for _, aux, _, _ in work])
    drafting = [(session, last, size) for session, _, last, size in work if size > 1]
    if not drafting:
        model.settle(caches)
        return [NOTHING] * len(work)
    mask = model.config.mask_token_id
    logits = model.block_logits([(session.cache, [last] + [mask] * (size - 1)) for session, last, size in drafting])
    greedy = any(session.rule is None for session, _, _ in drafting)
    tokens = model.argmax(logits, caches) if greedy else None  # settles every cache too
    drafts, at = [], 0
    for session, _, _, size in work:
        if size == 1:
            drafts.append(NOTHING)
            continue
        rows = slice(at, at + size - 1)
        at += size - 1
        if session.rule is None:
            drafts.append(Draft(tokens[rows]))
        else:  # syncs on its candidates (coupled) or its [B-1, K] proposal (rejection)
            # The context now ends at last_token's position: candidate 1 is the next one.
            drafts.append(session.rule.draft(logits[rows], model.sampler, session.cache.length + 1))
    if not greedy:
        model.settle(caches)
    return drafts


class LocalDrafter:
    """``Drafter`` protocol over one loaded DFlash model (either backend); sessions share the weights."""

    def __init__(self, model: DraftModel):
        if model.target is None:
            raise ValueError("DFlashDraftModel must be bound to the target's embedding/LM head")
        self.model = model
        self.backend: str = model.backend
        self.block_size: int = int(model.config.block_size)
        self.mask_token_id: int = int(model.config.mask_token_id)
        self.target_layer_ids: tuple[int, ...] = tuple(model.config.target_layer_ids)

    def open_session(self, sampling: SamplingParams | None = None, options: SessionOptions | None = None) -> DrafterSession:
        return DrafterSession(self.model, sampling)

    def status(self) -> dict[str, str]:
        return {}  # in this process: no connection to lose

    def warm_up(self, block_sizes: Iterable[int] = WARM_BLOCK_SIZES, ctx: int = 64, aux=None) -> float:
        """One short session drafting each block size once, before serving; returns the seconds it took.

        ``aux``: the first call's context rows (a server passes them through its
        wire decoding); ``ctx`` zero rows by default.
        """
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

    def __init__(self, draft, target_dir: str | Path | None = None, dtype=None):
        from kakeya.drafter.mlx_backend.model import DFlashDraftModel, load_dflash_mlx

        if isinstance(draft, DFlashDraftModel):
            if target_dir is not None or dtype is not None:
                raise ValueError("target_dir/dtype apply only when loading from a draft directory")
            model = draft
        else:
            if target_dir is None:
                raise ValueError("target_dir is required to load the drafter's embedding/LM head")
            model = load_dflash_mlx(draft, target_dir, dtype=dtype)
        super().__init__(model)

    @classmethod
    def load(cls, draft_dir: str | Path, target_dir: str | Path, dtype=None) -> "MLXDrafter":
        return cls(draft_dir, target_dir, dtype=dtype)


class TorchDrafter(LocalDrafter):
    """The torch drafter: ``TorchDrafter(draft_dir, target_dir, device, dtype)`` or ``TorchDrafter(model=...)``."""

    def __init__(self, draft_dir=None, target_dir=None, device="cpu", dtype="float32", *, model=None,
                 cuda_graphs: bool | None = None, graph_options=None, compile: bool = False):
        """``cuda_graphs``: capture greedy draft calls (default: on for CUDA, see drafter/torch_backend/step.py);
        ``graph_options`` (a ``torch_graphs.GraphOptions``) overrides it; ``compile``:
        ``torch.compile`` the layers' row-wise halves (``DFlashDraftModel.compile_layers``)."""
        from kakeya.backends.torch.graphs import GraphOptions

        if model is None:
            if draft_dir is None or target_dir is None:
                raise ValueError("TorchDrafter needs draft_dir and target_dir (or model=)")
            from kakeya.drafter.torch_backend.load import load_dflash_torch

            model = load_dflash_torch(draft_dir, target_dir, device, dtype)
        model.fuse_projections()
        options = graph_options or GraphOptions.for_device(model.device, cuda_graphs)
        if options.static_extent:
            model.use_graphs(options)
        if compile:
            model.compile_layers()
        super().__init__(model)

    @classmethod
    def colocated(cls, draft_dir: str | Path, target, cuda_graphs: bool | None = None, compile: bool = False) -> "TorchDrafter":
        """Share a loaded ``TargetTorch``'s embedding / LM head tensors (no second copy on the device)."""
        from kakeya.drafter.torch_backend.load import load_draft_model
        from kakeya.drafter.torch_backend.model import TargetHead

        model = load_draft_model(draft_dir, target.device, target.dtype)
        head = TargetHead(target.model.embed, target.model.lm_head)
        return cls(model=bind(model, head), cuda_graphs=cuda_graphs, compile=compile)
