"""Waiting on observable state instead of sleeping: tests order events by what they can see.

``wait_until`` polls a condition until it holds; its timeout is generous on purpose (a busy shared
machine may be slow), so only a real failure reaches it. ``holds_for`` is the one way to check that
something does NOT happen: it polls the condition for the whole window and fails the moment it breaks.
"""

from __future__ import annotations

import time

PATIENCE_S = 60.0  # the default wait: far beyond what a slow machine needs, reached only when it never happens


def wait_until(pred, timeout: float = PATIENCE_S, interval: float = 0.05, what: str = "condition"):
    """``pred()``'s first truthy value, polled every ``interval`` s; AssertionError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {value!r})")
        time.sleep(interval)


def holds_for(pred, seconds: float, interval: float = 0.1, what: str = "condition") -> None:
    """``pred()`` stays truthy for ``seconds`` (polled every ``interval`` s): AssertionError the first time it is not."""
    deadline = time.monotonic() + seconds
    while True:
        value = pred()
        assert value, f"{what} stopped holding (got {value!r})"
        if time.monotonic() > deadline:
            return
        time.sleep(interval)
