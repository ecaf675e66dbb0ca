"""The Gemma-4 target on PyTorch: the verifier's backend adapter over ``gemma4_torch.Gemma4Text``.

:class:`TargetTorch` mirrors ``model_mlx.TargetMLX`` method for method (``load``,
``make_cache``, ``run``, ``greedy``, ``materialize``, ``cat``, ``trim_full``,
``kv_bytes``, ``forward``, ``logits``), so ``session.py`` drives either backend
alike. The model itself -- config, layers -- is ``verifier/torch_backend/gemma4.py``, its weight loading ``verifier/torch_backend/load.py``.
What only the torch backend has (random weights for benchmarks, the plain-cache
reference decode, a warm-up) comes last; f_theta restoration is MLX-only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from kakeya.backends.torch import sampling as sampling_torch
from kakeya.backends.torch.graphs import GRAPHED_MIN_BATCH, GraphOptions
from kakeya.backends.torch.ops import resolve_device, resolve_dtype
from kakeya.core.contract import FULL, MAX_BLOCK_SIZE, SLIDING
from kakeya.verifier.layout import RingLayout, ForwardPlan
from kakeya.verifier.torch_backend.batch import Segment, forward_batch
from kakeya.verifier.torch_backend.cache import FullKVCache, QuantizedFullKVCache, RingKVCache
from kakeya.verifier.torch_backend.gemma4 import Forward, Gemma4Args, Gemma4Text
from kakeya.verifier.torch_backend.load import load_gemma4
from kakeya.verifier.torch_backend.step import TorchCaches, verify_block

DEFAULT_GRAPH_CONTEXT = 4096  # full-attention positions preallocated per session when graphs are on
MAX_FREE_CACHES = 4  # closed sessions' cache sets kept for reuse (graphs on)


class TargetTorch:
    """A loaded Gemma-4 target and the forward the verifier needs (torch backend)."""

    backend = "torch"
    sampler = sampling_torch  # p, the acceptance test and the draws when a session samples

    def __init__(self, model: Gemma4Text, path: Path | None = None, *, cuda_graphs: bool | None = None,
                 max_context: int | None = None, graph_options: GraphOptions | None = None):
        self.model = model
        self.path = path
        self.args = model.args
        self.layer_types = list(self.args.layer_types)
        self.n_cached = self.args.n_cached
        self.device = model.embed.device
        self.dtype = model.embed.dtype
        model.inv_freq = {t: f.to(self.device) for t, f in model.inv_freq.items()}
        # static verify step (verifier/torch_backend/step.py): graphs on CUDA, eager elsewhere
        # (graph_options: tests run the graph bookkeeping eagerly on a CPU with capture=False)
        self.graph_options = graph_options or GraphOptions.for_device(self.device, cuda_graphs)
        if self.graph_options.capture and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        if max_context is not None and max_context < 1:
            raise ValueError(f"max_context must be >= 1, got {max_context}")
        # full-attention buffers start this big with fixed shapes (a regrowth means new graphs)
        self.max_context = max_context or (DEFAULT_GRAPH_CONTEXT if self.graph_options.static_extent else 0)
        self._pool = torch.cuda.graph_pool_handle() if self.graph_options.capture else None
        self._free: list[TorchCaches] = []  # cache sets (and their graphs) of closed sessions, for reuse

    @classmethod
    def load(
        cls, path: str | Path, device: str | torch.device | None = "cpu", dtype: str | torch.dtype | None = "float32",
        **options,
    ) -> "TargetTorch":
        path = Path(path)
        return cls(load_gemma4(path, resolve_device(device), resolve_dtype(dtype)), path, **options)

    # -- what services/verifier/session.py needs from a backend --------------------------

    @property
    def min_batch(self) -> int:
        """Fewest queued sessions ``verify_batch`` runs as one forward (graphs: see GRAPHED_MIN_BATCH)."""
        return GRAPHED_MIN_BATCH if self.graph_options.capture else 2

    def make_cache(self, layout: RingLayout, policy=None) -> TorchCaches:
        """Rings on sliding layers; exact (or, with ``policy.full_kv_bits``, affine-quantized) full layers;
        with the static verify step's device state (a closed session's set is reused when graphs are on)."""
        bits = getattr(policy, "full_kv_bits", 0) if policy is not None else 0
        group = getattr(policy, "full_kv_group_size", 64) if policy is not None else 64
        key = (layout.sink, layout.window, layout.slack, bits, group)
        for c in self._free:
            if c.key == key:
                self._free.remove(c)
                return self._reset(c, layout)

        def full(i: int):
            if not bits:
                return FullKVCache(capacity=self.max_context)
            return QuantizedFullKVCache(bits, min(group, self.args.head_dim_of(i)), capacity=self.max_context)

        caches = [RingKVCache(layout) if self.layer_types[i] == SLIDING else full(i) for i in range(self.n_cached)]
        c = TorchCaches(caches, layout, self.device, self.graph_options, MAX_BLOCK_SIZE, self._pool)
        c.key = key
        return c

    @staticmethod
    def _reset(c: TorchCaches, layout: RingLayout) -> TorchCaches:
        c.layout = layout
        for r in c.rings:
            r.layout, r.plan = layout, None
        for f in c.fulls:
            f.offset = 0
        c.ring_stale = True  # the new layout is empty: ring_pos becomes all -1 before the next step
        return c

    def release_cache(self, cache) -> None:
        """A closed session's caches: kept (with their captured graphs) for the next session when
        graphs are on -- recapturing per session would cost more than a verify -- else dropped."""
        if self.graph_options.static_extent and isinstance(cache, TorchCaches) and len(self._free) < MAX_FREE_CACHES:
            self._free.append(cache)

    def kv_like(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A one-position K/V of cached layer ``i`` (shape, dtype, device) to size its buffers."""
        t = torch.zeros((1, self.args.kv_heads_of(i), 1, self.args.head_dim_of(i)), dtype=self.dtype, device=self.device)
        return t, t

    @torch.inference_mode()
    def verify_block(self, ids: Sequence[int], cache: TorchCaches, aux_layers: Sequence[int]):
        """One verify through the static step (``verifier/torch_backend/step.py``): ``(choices, aux of the block)``."""
        return verify_block(self, cache, ids, aux_layers)

    @torch.inference_mode()
    def run(self, ids: Sequence[int], cache: list, aux_layers: Sequence[int], plan: ForwardPlan) -> Forward:
        masks, pos = self._prepare(len(ids), cache, plan)
        return self.forward(self._ids(ids), cache, aux_layers, masks, pos)

    @torch.inference_mode()
    def run_batch(self, blocks: Sequence[tuple[Sequence[int], list, Sequence[int], ForwardPlan]]) -> list[Forward]:
        """Several sessions' ``run`` in one forward (``verifier/torch_backend/batch.py``): ``blocks`` of
        ``(ids, cache, aux_layers, plan)``, one ``Forward`` each, every cache written as by ``run``."""
        segs = [Segment(self._ids(ids), cache, tuple(aux), *self._prepare(len(ids), cache, plan)) for ids, cache, aux, plan in blocks]
        return forward_batch(self.model, segs)

    def _prepare(self, n: int, cache: list, plan: ForwardPlan) -> tuple[dict, torch.Tensor]:
        """Hand the rings their plan; the masks and positions of a dynamic forward of ``n`` positions."""
        start = None
        for c in cache:
            if isinstance(c, RingKVCache):
                c.plan = plan
                start = c.offset
            elif start is None:
                start = c.offset
        start = 0 if start is None else start
        if isinstance(cache, TorchCaches):
            cache.mark_dynamic()
        masks = {FULL: self._full_mask(start, n)}
        if SLIDING in self.layer_types:
            m = plan.mask
            masks[SLIDING] = None if m.all() else torch.from_numpy(m).to(self.device, non_blocking=True)
        return masks, self._positions(start, n)

    @torch.inference_mode()
    def greedy(self, hidden: torch.Tensor) -> list[int]:
        """The target's argmax at every position of ``hidden`` [1, L, H]: the one host sync of a verify."""
        return torch.argmax(self.model.logits(hidden)[0], dim=-1).tolist()

    @torch.inference_mode()
    def greedy_batch(self, hiddens: Sequence[torch.Tensor]) -> list[int]:
        """:meth:`greedy` of several blocks' hidden states, concatenated: one LM head, one host sync."""
        return self.greedy(hiddens[0] if len(hiddens) == 1 else torch.cat(list(hiddens), dim=1))

    @staticmethod
    def materialize(out: Forward, cache: list) -> None:
        """Eager backend: nothing is lazy (CUDA work is queued in order on one stream)."""

    @staticmethod
    def cat(chunks: list) -> torch.Tensor:
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=0)

    @staticmethod
    def trim_full(cache: list, n: int) -> None:
        for c in cache:
            if not isinstance(c, RingKVCache):
                c.trim(n)

    @staticmethod
    def kv_bytes(cache: list) -> dict:
        return {
            "sliding": sum(c.nbytes for c in cache if isinstance(c, RingKVCache)),
            "full": sum(c.nbytes for c in cache if not isinstance(c, RingKVCache)),
        }

    # -- the model itself ---------------------------------------------------------------

    def forward(
        self, ids: torch.Tensor, cache: list, aux_layers: Sequence[int], masks: dict, pos: torch.Tensor
    ) -> Forward:
        """Run ``ids`` [1, L] at positions ``pos`` [L] through the body, appending to ``cache``; no LM head."""
        return self.model(ids, cache, aux_layers, masks, pos)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden)

    def _positions(self, start: int, n: int) -> torch.Tensor:
        return torch.arange(start, start + n, device=self.device)

    def _ids(self, ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor([list(ids)], dtype=torch.long).to(self.device, non_blocking=True)

    def _full_mask(self, start: int, n: int) -> torch.Tensor | None:
        if n == 1:
            return None
        q = torch.arange(start, start + n, device=self.device)[:, None]
        k = torch.arange(start + n, device=self.device)[None, :]
        return k <= q

    # -- torch only: benchmarks, the reference decode, warm-up --------------------------

    @classmethod
    def random(
        cls, args: Gemma4Args, device: str | torch.device | None = "cpu", dtype: str | torch.dtype | None = "bfloat16", seed: int = 0,
        **options,
    ) -> "TargetTorch":
        """Random weights of the right shapes (for benchmarks: no checkpoint needed)."""
        device, dtype = resolve_device(device), resolve_dtype(dtype)
        with torch.device("meta"):
            model = Gemma4Text(args)
        g = torch.Generator(device=device).manual_seed(seed)

        def fill(shape: tuple[int, ...]) -> torch.Tensor:
            if len(shape) == 1:  # norms, scales, layer_scalar
                return torch.ones(shape, device=device, dtype=dtype)
            # std 1/sqrt(fan_in): unit-scale activations; drawn on the device (fast for 26B shapes)
            return torch.empty(shape, device=device, dtype=dtype).normal_(0.0, shape[-1] ** -0.5, generator=g)

        for mod in model.modules():
            for name, buf in list(mod._buffers.items()):
                if buf is not None:
                    mod._buffers[name] = fill(tuple(buf.shape))
        if not args.tie_word_embeddings:
            model.lm_head = fill((args.vocab_size, args.hidden_size))
        model.eval()
        return cls(model, None, **options)

    def make_plain_cache(self) -> list:
        """Unbounded full caches on every layer (the reference decode: window applied by the mask)."""
        return [FullKVCache() for _ in range(self.n_cached)]

    @torch.inference_mode()
    def run_plain(self, ids: Sequence[int], cache: list, aux_layers: Sequence[int] = ()) -> Forward:
        """Forward on :meth:`make_plain_cache` caches; sliding layers see ``sliding_window`` keys."""
        start = cache[0].offset if cache else 0
        n = len(ids)
        q = torch.arange(start, start + n, device=self.device)[:, None]
        k = torch.arange(start + n, device=self.device)[None, :]
        causal = k <= q
        masks = {FULL: causal, SLIDING: causal & (k > q - self.args.sliding_window)}
        return self.forward(self._ids(ids), cache, aux_layers, masks, self._positions(start, n))

    def warmup(self, aux_layers: Sequence[int], ctx: int = 1024, max_block: int = 16, policy=None) -> float:
        """Run a full-length prefill and one verify of every block size once (kernel selection,
        caching-allocator sizing, lazy CUDA init) before serving; returns the seconds it took."""
        import time

        from kakeya.core.contract import CachePolicy
        from kakeya.verifier.session import VerifierSession

        t0 = time.perf_counter()
        s = VerifierSession(self, aux_layers, policy or CachePolicy(slack=max(max_block, 16)))
        ids = [2] + [5 + (7 * i) % max(1, self.args.vocab_size - 5) for i in range(max(1, ctx) - 1)]
        s.prefill(ids)
        for L in range(1, max_block + 1):
            s.verify(ids[:L])
            s.commit(0)
        s.close()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def greedy_reference(self, prompt_ids: Sequence[int], max_tokens: int) -> list[int]:
        """Token-by-token greedy AR on plain full caches (no ring, no rollback): a test oracle."""
        cache = self.make_plain_cache()
        out = self.run_plain(prompt_ids, cache)
        tok = self.greedy(out.hidden[:, -1:])[0]
        toks = [tok]
        while len(toks) < max_tokens:
            out = self.run_plain([tok], cache)
            tok = self.greedy(out.hidden)[0]
            toks.append(tok)
        return toks


def torch_verifier(
    target_dir: str | Path,
    aux_layers: Sequence[int],
    policy=None,
    device: str | torch.device | None = "cpu",
    dtype: str | torch.dtype | None = "float32",
    cuda_graphs: bool | None = None,
    max_context: int | None = None,
    compile: bool = False,
):
    """The in-process torch verifier (what ``loader.local_verifier(..., backend="torch")`` returns).

    ``cuda_graphs``: capture the verify step per block-size bucket (default: on for CUDA);
    ``max_context``: full-attention positions preallocated per session (graphs on: 4096);
    ``compile``: ``torch.compile`` every layer's row-wise halves (``Gemma4Text.compile_layers``).
    """
    from kakeya.core.contract import CachePolicy
    from kakeya.verifier.session import LocalVerifier

    target = TargetTorch.load(target_dir, device, dtype, cuda_graphs=cuda_graphs, max_context=max_context)
    if compile:
        target.model.compile_layers()
    return LocalVerifier(target, target_dir, aux_layers, policy or CachePolicy())
