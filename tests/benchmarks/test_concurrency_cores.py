"""benchmarks/concurrency.py counts the CPU each server process used during a run."""

from __future__ import annotations

import os
import sys

import pytest


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_cpu_seconds_grow_with_work_and_a_gone_process_gives_none(benchmark_script):
    mod = benchmark_script("concurrency")
    before = mod.servers_cpu_seconds({"me": os.getpid()})
    x = 0
    for i in range(3_000_000):  # ~0.1 s of this process's CPU
        x += i
    after = mod.servers_cpu_seconds({"me": os.getpid()})
    assert after["me"] > before["me"]
    assert mod.servers_cpu_seconds({"gone": 2**22 + 12345}) is None
    assert sys.platform != "linux" or before["me"] > 0
