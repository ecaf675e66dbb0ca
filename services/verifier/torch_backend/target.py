"""The Gemma-4 target on PyTorch: the verifier's backend (``backend.Target``) over ``Gemma4Text``.

The model is ``gemma4.py`` (weights: ``load.py``). Every session's K/V are pages of the target's pools (``pool.py``); a
forward of one or many sessions' blocks runs as one batched step over them (``batch_step.py``: graphs per shape on CUDA,
the same step eagerly elsewhere), except a prefill chunk longer than the ring's slack, which writes and reads the same
pages one segment at a time (:class:`SegmentAttention`, the ``Attend`` it hands ``Gemma4Text.forward``). What only torch
has (random weights) comes last; f_theta restoration is MLX-only. The plain reference decode the tests hold it to is
``tests/policy_reference.py``'s ``torch_greedy``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from kakeya.backends.torch import sampling as sampling_torch
from kakeya.backends.torch.graphs import GraphOptions, bucket_for
from kakeya.backends.torch.ops import attention_kernel_wanted, resolve_device, resolve_dtype
from kakeya.core.contract import FULL, SLIDING
from kakeya.core.request import MAX_BLOCK_SIZE, CachePolicy
from kakeya.verifier.backend import Forward, Segment, greedy_rows
from kakeya.verifier.layout import ForwardPlan, RingLayout
from kakeya.verifier.torch_backend import batch_step
from kakeya.verifier.torch_backend.batch_step import DEFAULT_MIN_EXTENT, PAD_ID, BatchSteps, poolable
from kakeya.verifier.torch_backend.gemma4 import Gemma4Args, Gemma4Text
from kakeya.verifier.torch_backend.load import load_gemma4
from kakeya.verifier.torch_backend.pool import CHUNK_PAGES, PAGE, KVPool, PooledCaches


class SegmentAttention:
    """Each segment's rows attend over its own session's caches, written as its plan says."""

    def __init__(self, segments: Sequence[Segment], masks: Sequence[dict]):
        self.segments, self.masks = segments, masks  # masks: per segment, layer type -> bool [L, keys] or None
        self.spans, at = [], 0
        for s in segments:
            self.spans.append((at, at + len(s.ids)))
            at += len(s.ids)

    def __call__(self, i: int, layer, q: torch.Tensor, k, v, shared):
        outs, kvs = [], []  # kvs: each segment's fetched (k, v), for the KV-shared layers after this one
        for j, (s, (lo, hi)) in enumerate(zip(self.segments, self.spans)):
            kv = shared[j] if shared is not None else s.caches.layers[i].fetch(k[:, :, lo:hi], v[:, :, lo:hi], s.plan)
            kvs.append(kv)
            outs.append(layer.attn.attend(q[:, :, lo:hi], *kv, self.masks[j][layer.layer_type], 1.0))
        return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)), kvs

    def split(self, hidden: torch.Tensor, saved: dict[int, torch.Tensor]) -> list[Forward]:
        """The body's outputs cut back into one :class:`Forward` per segment."""
        out = []
        for s, (lo, hi) in zip(self.segments, self.spans):
            aux = torch.cat([saved[i][0, lo:hi] for i in s.aux_layers], dim=-1) if s.aux_layers else None
            out.append(Forward(hidden[:, lo:hi], aux))
        return out


class TargetTorch:
    """A loaded Gemma-4 target and the forward the verifier needs (torch backend)."""

    backend = "torch"
    sampler = sampling_torch
    static_verify = True  # backend.StaticVerify
    restores = False

    def __init__(
        self,
        model: Gemma4Text,
        path: Path | None = None,
        *,
        cuda_graphs: bool | None = None,
        max_context: int | None = None,
        graph_options: GraphOptions | None = None,
        page: int = PAGE,
        chunk_pages: int = CHUNK_PAGES,
        attention_kernel: bool | None = None,
    ):
        """``max_context``: the fewest full-attention positions a captured step attends over (longer
        contexts take the next doubling; default 256 with graphs); ``page``, ``chunk_pages``: the K/V
        pools' rows per page and pages per growth; ``attention_kernel``: the Triton decode-attention
        kernel for the batched step's attention (default: on CUDA where triton imports)."""
        self.model = model
        self.path = path
        self.args = model.args
        self.layer_types = list(self.args.layer_types)
        self.n_cached = self.args.n_cached
        self.device = model.embed.device
        self.dtype = model.embed.dtype
        model.inv_freq = {t: f.to(self.device) for t, f in model.inv_freq.items()}
        # graphs on CUDA, eager elsewhere (tests run the graph bookkeeping eagerly with capture=False)
        self.graph_options = graph_options or GraphOptions.for_device(self.device, cuda_graphs)
        if self.graph_options.capture and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        if max_context is not None and max_context < 1:
            raise ValueError(f"max_context must be >= 1, got {max_context}")
        self.min_extent = max_context or DEFAULT_MIN_EXTENT
        self.pool = KVPool(self.args, self.device, self.dtype, page, chunk_pages)
        self.attention_kernel = attention_kernel_wanted(self.device, attention_kernel)
        self.steps = BatchSteps(self, torch.cuda.graph_pool_handle() if self.graph_options.capture else None)

    @classmethod
    def load(
        cls,
        path: str | Path,
        device: str | torch.device | None = "cpu",
        dtype: str | torch.dtype | None = "float32",
        **options,
    ) -> TargetTorch:
        path = Path(path)
        return cls(load_gemma4(path, resolve_device(device), resolve_dtype(dtype)), path, **options)

    # -- the backend protocol (verifier/backend.py) ----------------------------------------

    min_batch = 2  # the batched step is the lone step too (captured alike): two queued sessions share one

    @property
    def device_name(self) -> str:
        return str(self.device)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).rsplit(".", 1)[-1]

    def make_cache(self, layout: RingLayout, policy: CachePolicy) -> PooledCaches:
        """Pages of the pools: the rings' now, the full layers' as the context grows (affine-quantized
        full K/V, ``policy.full_kv_bits``, in a pool of their own)."""
        return PooledCaches(self.pool, layout, policy.full_kv_bits, policy.full_kv_group_size)

    def release_cache(self, caches: PooledCaches) -> None:
        """A closed session's pages, back to the pools for the next session."""
        caches.release()

    def materialize(self, out: Forward, caches) -> None:
        """Nothing to evaluate: torch runs eagerly."""

    @torch.inference_mode()
    def forward(self, segments: Sequence[Segment]) -> list[Forward]:
        if poolable(segments):
            return batch_step.run(self, segments, choices=False)[0]
        return self._segment_forward(segments)

    @torch.inference_mode()
    def verify_segments(self, segments: Sequence[Segment], greedy: Sequence[bool]):
        """``StaticVerify.verify_segments``: one batched step (a step that cannot take them: one by one)."""
        if not poolable(segments):
            outs = self._segment_forward(segments)
            return outs, greedy_rows(self, outs, greedy)
        outs, picks, _ = batch_step.run(self, segments, choices=any(greedy))
        return outs, [p if g else None for p, g in zip(picks, greedy)]

    def _segment_forward(self, segments: Sequence[Segment]) -> list[Forward]:
        """Each segment's attention over its own session's pages, one after another (a step cannot take it)."""
        with self.pool.stepping():
            for s in segments:
                s.caches.reserve(s.plan.start + s.plan.n_new)
            ids = [[t for s in segments for t in s.ids]]
            ids = torch.tensor(ids, dtype=torch.long).to(self.device, non_blocking=True)
            pos = [torch.arange(s.plan.start, s.plan.start + len(s.ids), device=self.device) for s in segments]
            attention = SegmentAttention(segments, [self._masks(s.plan) for s in segments])
            aux_layers = {i for s in segments for i in s.aux_layers}
            hidden, saved = self.model(ids, pos[0] if len(pos) == 1 else torch.cat(pos), attention, aux_layers)
        return attention.split(hidden, saved)

    def static_length(self, n: int, slack: int) -> int:
        return bucket_for(n, self.graph_options.buckets, min(slack, MAX_BLOCK_SIZE))

    @torch.inference_mode()
    def verify_static(self, ids: Sequence[int], caches: PooledCaches, aux_layers: tuple[int, ...], plan: ForwardPlan):
        """A greedy block alone: the batched step with one segment (padding planned like draft tokens)."""
        L = len(ids)
        segment = Segment(list(ids) + [PAD_ID] * (plan.n_new - L), caches, tuple(aux_layers), plan)
        (out,), (choices,), logits = batch_step.run(self, [segment], choices=True)
        caches.last_logits = logits[:L]  # the rows the choices came from (tests read them)
        return choices[:L], (out.aux[:L] if out.aux is not None else None)

    @torch.inference_mode()
    def greedy(self, hidden: torch.Tensor) -> list[int]:
        return torch.argmax(self.model.logits(hidden)[0], dim=-1).tolist()

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden)

    @staticmethod
    def concat(arrays: Sequence[torch.Tensor], axis: int) -> torch.Tensor:
        return torch.cat(list(arrays), dim=axis)

    @torch.inference_mode()
    def copy_caches(self, caches: PooledCaches, positions: int) -> list[list]:
        return caches.copy(positions)

    @torch.inference_mode()
    def load_caches(self, caches: PooledCaches, saved: list[list], positions: int) -> None:
        """Into the session's own pages: a ring's every slot, the full layers' first ``positions``."""
        with self.pool.stepping():
            caches.load(saved, positions)

    def _masks(self, plan: ForwardPlan) -> dict:
        """Per layer type, what a dynamic forward's queries attend to (None: everything fetched)."""
        masks = {FULL: self._full_mask(plan.start, plan.n_new)}
        if SLIDING in self.layer_types:
            m = plan.mask
            masks[SLIDING] = None if m.all() else torch.from_numpy(m).to(self.device, non_blocking=True)
        return masks

    def _full_mask(self, start: int, n: int) -> torch.Tensor | None:
        if n == 1:
            return None
        q = torch.arange(start, start + n, device=self.device)[:, None]
        k = torch.arange(start + n, device=self.device)[None, :]
        return k <= q

    @classmethod
    def random(
        cls,
        args: Gemma4Args,
        device: str | torch.device | None = "cpu",
        dtype: str | torch.dtype | None = "bfloat16",
        seed: int = 0,
        **options,
    ) -> TargetTorch:
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
        model.fuse_norms()
        model.eval()
        return cls(model, None, **options)


def torch_verifier(
    target_dir: str | Path,
    aux_layers: Sequence[int],
    policy=None,
    device: str | torch.device | None = "cpu",
    dtype: str | torch.dtype | None = "float32",
    cuda_graphs: bool | None = None,
    max_context: int | None = None,
    compile: bool = False,
    prefixes=None,
):
    """The in-process torch verifier (``loader.local_verifier(..., backend="torch")``): ``cuda_graphs``, capture
    the verify step per bucket (default: on for CUDA); ``max_context``: see :class:`TargetTorch`; ``compile``:
    ``Gemma4Text.compile_layers``; ``prefixes``: the prefix cache its sessions resume from and save to."""
    from kakeya.verifier.local import LocalVerifier

    target = TargetTorch.load(target_dir, device, dtype, cuda_graphs=cuda_graphs, max_context=max_context)
    if compile:
        target.model.compile_layers()
    return LocalVerifier(target, target_dir, aux_layers, policy or CachePolicy(), prefixes)
