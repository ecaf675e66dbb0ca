"""CUDA graphs for the static-shape steps: one captured graph per block-size bucket, replayed per block.

The gpt-fast / vLLM pattern: a step function whose inputs live in static buffers (written in place before
each call) and whose shapes depend only on the bucket, recorded once by ``torch.cuda.CUDAGraph`` and
replayed with one launch. A verify of L tokens runs in the smallest bucket ``>= L`` (padded positions are
masked by causality and trimmed), as vLLM pads a decode batch to its captured size. With ``capture=False``
the same objects run eagerly: how the bookkeeping is exercised on a CPU, and what serves without graphs.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

BUCKETS = (1, 2, 4, 8, 16)  # block sizes captured on CUDA (a verify pads up to the next one)
SESSION_BUCKETS = (1, 2, 4, 8, 16)  # table rows a captured batched step has (beyond 16: multiples of 16)
# Fewest queued sessions worth one (eager) batched forward when single steps replay CUDA graphs: below it
# the replays win (docs/cuda.md, "Batching on CUDA").
GRAPHED_MIN_BATCH = 4


def bucket_for(n: int, buckets: Sequence[int] | None, limit: int) -> int:
    """The padded length a block of ``n`` runs at: the smallest bucket ``>= n`` that is ``<= limit``
    (the ring's slack: a padded write must stay trimmable), else ``n`` itself; ``buckets=None``: ``n``."""
    if n < 1:
        raise ValueError(f"block length must be >= 1, got {n}")
    if n > limit:
        raise ValueError(f"block length {n} exceeds the limit {limit}")
    for b in sorted(buckets or ()):
        if n <= b <= limit:
            return b
    return n


def session_bucket(n: int) -> int:
    return next((b for b in SESSION_BUCKETS if b >= n), -(-n // SESSION_BUCKETS[-1]) * SESSION_BUCKETS[-1])


def unpack(packed: torch.Tensor, fields: Sequence[tuple[str, int]]) -> dict[str, torch.Tensor]:
    """A batched step's one packed input (one host-to-device copy a step) cut back into its named fields."""
    out, at = {}, 0
    for name, size in fields:
        out[name] = packed[at : at + size]
        at += size
    return out


@dataclass(frozen=True)
class GraphOptions:
    """How the static steps of a model run. ``capture``: record CUDA graphs (CUDA only). ``buckets``: block
    sizes to pad up to (None: each length as is, the CPU default). ``static_extent``: attend over whole
    buffers (fixed shapes, what capture needs) rather than their filled prefix."""

    capture: bool = False
    buckets: tuple[int, ...] | None = None
    static_extent: bool = False
    min_batch: int = GRAPHED_MIN_BATCH  # with capture: fewest queued sessions run as one eager batch (0: never)

    @classmethod
    def for_device(
        cls, device: torch.device, cuda_graphs: bool | None = None, min_batch: int | None = None
    ) -> GraphOptions:
        """The default for ``device``: graphs on CUDA (unless ``cuda_graphs`` is False), eager elsewhere."""
        on_cuda = torch.device(device).type == "cuda"
        if cuda_graphs and not on_cuda:
            raise ValueError("CUDA graphs need a CUDA device")
        if min_batch is not None and (min_batch < 0 or min_batch == 1):
            raise ValueError(f"min_batch must be 0 (never) or an integer >= 2, got {min_batch}")
        if on_cuda and cuda_graphs is not False:
            batch = GRAPHED_MIN_BATCH if min_batch is None else (min_batch or sys.maxsize)
            return cls(capture=True, buckets=BUCKETS, static_extent=True, min_batch=batch)
        return cls()

    @property
    def batch_from(self) -> int:
        """The fewest queued sessions a model run with these options batches (eager models: 2)."""
        return self.min_batch if self.capture else 2


# One capture at a time in the process: torch.cuda.graph shares one capture stream between its instances
# and synchronises the device, and the caching allocator refuses a second recording into a pool
# (cudaErrorStreamCaptureInvalidated, then "already recording to mempool_id" on every later capture).
# Any thread that captures takes this lock for the warm-up and the capture.
_CAPTURE_LOCK = threading.Lock()
_capturing = threading.local()


@contextmanager
def exclusive_capture() -> Iterator[None]:
    """Hold the process-wide capture lock (blocks while another thread captures). A capture started
    inside another on the same thread is refused: it would wait on itself."""
    if getattr(_capturing, "active", False):
        raise RuntimeError("a CUDA graph capture was started inside another one on the same thread")
    with _CAPTURE_LOCK:
        _capturing.active = True
        try:
            yield
        finally:
            _capturing.active = False


def record(fn: Callable, inputs: Sequence[torch.Tensor], pool, warmup: int):
    """``(graph, outputs)``: ``fn(*inputs)`` warmed up on a side stream (lazy inits, cuBLAS workspaces,
    autotuning), then captured; ``thread_local``: only this thread's unsafe calls invalidate the capture,
    not another thread's work meanwhile. Callers hold :func:`exclusive_capture`."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn(*inputs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        outputs = fn(*inputs)
    return graph, outputs


class GraphedStep:
    """One step function bound to static inputs: captured once and replayed, or run eagerly. ``fn(*inputs)``
    reads its inputs only through the given tensors (written in place before :meth:`__call__`); with
    ``capture`` its outputs are static, overwritten by the next replay."""

    def __init__(self, fn: Callable, inputs: Sequence[torch.Tensor], capture: bool, pool=None, warmup: int = 2):
        self.fn, self.inputs, self.graph = fn, tuple(inputs), None
        self.outputs = None
        if capture:
            with exclusive_capture():
                self.graph, self.outputs = record(fn, self.inputs, pool, warmup)

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def __call__(self):
        if self.graph is None:
            return self.fn(*self.inputs)
        self.graph.replay()
        return self.outputs


class StepGraphs:
    """The graphed steps of one cache set, keyed by what fixes their shapes (bucket, extents), each built
    on first use (``make(key)`` returns ``(fn, inputs)``) with its static packed input (:meth:`stage`).
    :meth:`invalidate` / :meth:`drop` forget them: call them whenever a buffer they read or write is
    reallocated (a graph holds raw device pointers)."""

    def __init__(self, options: GraphOptions, pool=None):
        self.options = options
        self.pool = pool
        self.steps: dict[Hashable, GraphedStep] = {}
        self.captures = 0  # how many graphs were recorded (or, eagerly, steps built)
        self.inputs: dict[Hashable, tuple] = {}  # key -> (device input, pinned staging, its numpy view)
        # A step that ends with no host sync may still be copying out of the pinned staging when the next
        # step of its key rewrites it: such a step leaves an event to wait on.
        self.unsynced: dict[Hashable, torch.cuda.Event] = {}

    def get(self, key: Hashable, make: Callable[[Hashable], tuple[Callable, Sequence[torch.Tensor]]]) -> GraphedStep:
        step = self.steps.get(key)
        if step is None:
            fn, inputs = make(key)
            step = GraphedStep(fn, inputs, self.options.capture, self.pool)
            self.steps[key] = step
            self.captures += 1
        return step

    def stage(self, key: Hashable, packed: np.ndarray, device: torch.device, syncs: bool) -> torch.Tensor:
        """``packed`` copied into ``key``'s static device input (made on first use) through pinned staging;
        ``syncs``: whether the step ends with a host sync."""
        if key not in self.inputs:
            staging = torch.zeros(len(packed), dtype=torch.long, pin_memory=device.type == "cuda")
            self.inputs[key] = (torch.zeros(len(packed), dtype=torch.long, device=device), staging, staging.numpy())
        static, staging, view = self.inputs[key]
        pending = self.unsynced.pop(key, None)
        if pending is not None:
            pending.synchronize()
        view[:] = packed
        static.copy_(staging, non_blocking=True)
        if not syncs and device.type == "cuda":
            self.unsynced[key] = torch.cuda.Event()
            self.unsynced[key].record()
        return static

    def drop(self, key: Hashable) -> None:
        self.steps.pop(key, None)
        self.inputs.pop(key, None)
        self.unsynced.pop(key, None)

    def invalidate(self) -> None:
        self.steps.clear()
        self.inputs.clear()
        self.unsynced.clear()


def eager_step(fn: Callable, packed: np.ndarray, device: torch.device) -> GraphedStep:
    """An uncaptured step ``fn(packed input)``, its input copied to ``device`` once (pinned, asynchronously)."""
    t = torch.from_numpy(packed)
    if device.type != "cpu":
        t = t.pin_memory().to(device, non_blocking=True)
    return GraphedStep(lambda: fn(t), (), capture=False)
