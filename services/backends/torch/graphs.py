"""CUDA graphs for the static-shape steps: one captured graph per block-size bucket, replayed per block.

The gpt-fast / vLLM pattern: a step function whose inputs live in static
buffers (written in place before each call) and whose tensor shapes depend only
on the bucket, so ``torch.cuda.CUDAGraph`` can record its kernels once and
replay them with one launch. A verify of L tokens runs in the smallest bucket
``>= L`` (padded positions are masked out by causality and trimmed afterwards),
as vLLM pads a decode batch up to its captured batch size.

With ``capture=False`` the very same objects run the step eagerly: that is how
the bookkeeping (bucket choice, padding, static buffers, invalidation when a
cache grows) is exercised on a CPU, and what serves on devices without graphs.
Nothing here touches CUDA unless ``capture`` is True.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

BUCKETS = (1, 2, 4, 8, 16)  # block sizes captured on CUDA (a verify pads up to the next one)
# Fewest queued sessions worth one batched forward when single steps replay CUDA graphs: the
# batched forward runs eagerly, so below this the replays win (docs/cuda.md, "Batching on CUDA": on an
# H200 at the 26B shape the batch wins verifies from 4 sessions but loses drafts to graphed drafts).
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


def unpack(packed: torch.Tensor, fields: Sequence[tuple[str, int]]) -> dict[str, torch.Tensor]:
    """A batched step's one packed input (one host-to-device copy a step) cut back into its named fields."""
    out, at = {}, 0
    for name, size in fields:
        out[name] = packed[at : at + size]
        at += size
    return out


@dataclass(frozen=True)
class GraphOptions:
    """How the static steps of a model run.

    ``capture``: record CUDA graphs (only on a CUDA device). ``buckets``: block
    sizes to pad up to (None: run each length as is -- the CPU default, where
    padding would only add work). ``static_extent``: attend over whole buffers
    (fixed shapes, what capture needs) rather than just their filled prefix.
    """

    capture: bool = False
    buckets: tuple[int, ...] | None = None
    static_extent: bool = False
    min_batch: int = GRAPHED_MIN_BATCH  # with capture: fewest queued sessions run as one eager batch (0: never)

    @classmethod
    def for_device(
        cls, device: torch.device, cuda_graphs: bool | None = None, min_batch: int | None = None
    ) -> GraphOptions:
        """The default for ``device``: graphs on CUDA (unless ``cuda_graphs`` is False), eager elsewhere.
        ``min_batch``: see the field (``--graphed-min-batch``; default GRAPHED_MIN_BATCH)."""
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


# One capture at a time in the process. torch.cuda.graph shares one capture stream between its
# instances and starts by synchronising the device, and the caching allocator refuses a second
# recording into a pool: on the H200 (2026-11-28, split at 16 streams) the drafter server met
# cudaErrorStreamCaptureInvalidated, then "beginAllocateToPool: already recording to mempool_id"
# on every capture after it. Any thread that captures (a compute thread, a handler thread running
# a step inline) takes this lock for the warm-up and the capture.
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
    autotuning), then captured. ``thread_local``: only this thread's unsafe calls (a host sync, an
    allocation outside the pool) invalidate the capture, not another thread's work meanwhile (a
    replay, a tensor freed or made on a handler thread). Callers hold :func:`exclusive_capture`."""
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
    """One step function bound to static inputs: captured once and replayed, or run eagerly.

    ``fn(*inputs)`` must read its inputs only through the given tensors (write
    them in place before :meth:`__call__`) and return tensors; with ``capture``
    the returned tensors are static outputs, overwritten by the next replay.
    The capture holds :func:`exclusive_capture`: never two at once in a process.
    """

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
    """The graphed steps of one cache set, keyed by whatever fixes their shapes (bucket, extents).

    A key's step is built on first use (``make(key)`` returns ``(fn, inputs)``);
    :meth:`invalidate` drops them all -- call it whenever a buffer the steps
    write or read is reallocated (a graph holds raw device pointers).
    """

    def __init__(self, options: GraphOptions, pool=None):
        self.options = options
        self.pool = pool
        self.steps: dict[Hashable, GraphedStep] = {}
        self.captures = 0  # how many graphs were recorded (or, eagerly, steps built)

    def get(self, key: Hashable, make: Callable[[Hashable], tuple[Callable, Sequence[torch.Tensor]]]) -> GraphedStep:
        step = self.steps.get(key)
        if step is None:
            fn, inputs = make(key)
            step = GraphedStep(fn, inputs, self.options.capture, self.pool)
            self.steps[key] = step
            self.captures += 1
        return step

    def invalidate(self) -> None:
        self.steps.clear()
