"""CUDA graph captures are exclusive in a process and tolerate other threads' work (``graphs.py``).

On the H200 (2026-11-28) the drafter server of a 16-stream split met two captures at once (
``cudaErrorStreamCaptureInvalidated``, then ``beginAllocateToPool: already recording to
mempool_id`` on every later capture). A CPU cannot capture, so the capture itself is a stand-in
here (``graphs.record``, or torch.cuda's pieces); what is checked is the contract around it.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import pytest
import torch

from kakeya.backends.torch import graphs


def test_two_threads_capturing_never_overlap(monkeypatch):
    """Thread a captures and waits there until b has asked to capture too; b must not get in
    before a is out (without the lock it does, at once)."""
    events: list[str] = []
    a_in, b_asking, b_in = threading.Event(), threading.Event(), threading.Event()

    def fake_record(fn, inputs, pool, warmup):
        name = fn()
        events.append(f"{name} in")
        if name == "a":
            a_in.set()
            b_asking.wait(10)
            b_in.wait(0.5)  # b cannot get in while a holds the lock: this wait runs out
        else:
            b_in.set()
        events.append(f"{name} out")
        return "graph", name

    def capture(name, asking=None):
        if asking is not None:
            asking.set()
        graphs.GraphedStep(lambda: name, (), capture=True)

    monkeypatch.setattr(graphs, "record", fake_record)
    a = threading.Thread(target=capture, args=("a",))
    a.start()
    assert a_in.wait(10)
    b = threading.Thread(target=capture, args=("b", b_asking))
    b.start()
    a.join(10)
    b.join(10)
    assert events == ["a in", "a out", "b in", "b out"]


def test_a_failed_capture_frees_the_lock_and_a_nested_one_is_refused(monkeypatch):
    def failing(fn, inputs, pool, warmup):
        raise RuntimeError("capture invalidated")

    monkeypatch.setattr(graphs, "record", failing)
    with pytest.raises(RuntimeError, match="invalidated"):
        graphs.GraphedStep(lambda: None, (), capture=True)

    def nested(fn, inputs, pool, warmup):
        graphs.GraphedStep(lambda: None, (), capture=True)  # a capture inside a capture: would wait on itself

    monkeypatch.setattr(graphs, "record", nested)
    with pytest.raises(RuntimeError, match="inside another one"):
        graphs.GraphedStep(lambda: None, (), capture=True)
    monkeypatch.setattr(graphs, "record", lambda fn, inputs, pool, warmup: ("graph", fn(*inputs)))
    step = graphs.GraphedStep(lambda x: x + 1, (torch.zeros(1),), capture=True)  # the lock is free again
    assert step.captured and float(step.outputs) == 1.0


def test_capture_mode_is_thread_local(monkeypatch):
    """Another thread's host sync or allocation must not invalidate this thread's capture: the capture
    runs in CUDA's thread-local mode, after the warm-up, into the given pool."""
    seen: dict = {}

    class FakeStream:
        def wait_stream(self, other):
            pass

    @contextmanager
    def fake_graph(graph, pool=None, capture_error_mode="global"):
        seen.update(graph=graph, pool=pool, mode=capture_error_mode, calls_before=calls[0])
        yield

    calls = [0]

    def fn():
        calls[0] += 1
        return calls[0]

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextmanager(lambda: (yield))())
    monkeypatch.setattr(torch.cuda, "current_stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: "graph")
    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    step = graphs.GraphedStep(fn, (), capture=True, pool="pool", warmup=2)
    assert seen == {"graph": "graph", "pool": "pool", "mode": "thread_local", "calls_before": 2}
    assert step.outputs == 3
