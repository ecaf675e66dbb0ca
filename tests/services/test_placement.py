"""runtime/placement.py and `serve --cpus` / `serve all --placement`: which CPUs a split's processes run on."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kakeya.runtime import placement

from .conftest import ROOT, TINY

linux_pinning = pytest.mark.skipif(
    not placement.can_pin() or len(placement.available()) < 2, reason="pinning needs Linux and two CPUs or more"
)


def test_cpu_lists_parse_and_format_both_ways():
    assert placement.parse_cpus("0,2-3") == {0, 2, 3}
    assert placement.parse_cpus(" 5 ") == {5}
    assert placement.format_cpus({0, 2, 3, 7, 8, 9}) == "0,2-3,7-9"
    for cpus in ({0}, {1, 2}, {0, 3, 4, 5, 9}):
        assert placement.parse_cpus(placement.format_cpus(cpus)) == cpus
    for bad in ("", "a", "3-1", "-1", "0,,1"):
        with pytest.raises(ValueError, match="--cpus"):
            placement.parse_cpus(bad)


def test_the_verifier_gets_its_own_cpus_and_the_drafter_shares_with_the_orchestrator():
    assert placement.split_placement([0]) is None  # nothing to separate
    two = placement.split_placement([0, 1])
    assert two == {"verifier": {0}, "drafter": {1}, "orchestrator": {1}}
    eight = placement.split_placement(range(8))
    assert eight["verifier"] == set(range(6)) and eight["drafter"] == eight["orchestrator"] == {6, 7}
    assert placement.for_split("off", True) == {}
    assert placement.for_split("auto", False) == {}  # not torch on the CPU: never measured, never pinned


@linux_pinning
def test_a_pinned_process_runs_every_thread_there_old_and_new():
    """Threads started before the pin (as grpc and torch may have) move too; those started after inherit it."""
    cpu = placement.available()[-1]
    code = f"""
import os, threading
from kakeya.runtime import placement
stop = threading.Event()
early = threading.Thread(target=stop.wait); early.start()
placement.pin_process({{{cpu}}})
late = threading.Thread(target=stop.wait); late.start()  # start() returns once the thread runs: no wait needed
print(sorted({{tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir("/proc/self/task")}}))
stop.set()
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"[({cpu},)]"


@linux_pinning
def test_serve_refuses_cpus_it_may_not_use_and_says_which():
    res = subprocess.run([sys.executable, "-m", "kakeya.app.main", "serve", "verifier", *TINY, "--port", "0",
                          "--cpus", "0,100000"], cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode == 2
    assert "--cpus: CPUs 100000 are not available to this process" in res.stderr


@linux_pinning
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_serve_all_pins_torch_cpu_children_as_placed_and_still_generates(server_factory):
    """`serve all` (torch on the CPU): the verifier alone on its CPUs, the drafter and the orchestrator together,
    every thread of each; --placement off pins nothing."""
    from .test_serve_all import client

    torch_cpu = ["--verifier-backend", "torch", "--drafter-backend", "torch", "--device", "cpu"]
    want = {role: placement.format_cpus(c) for role, c in placement.split_placement(placement.available()).items()}
    s = server_factory("all-placed", ["all", *TINY, "--grace", "5", *torch_cpu]).start().wait_ready()
    try:
        assert s.info["cpus"] == want
        for role, pid in s.info["pids"].items():
            tasks = os.listdir(f"/proc/{pid}/task")
            assert {placement.format_cpus(os.sched_getaffinity(int(t))) for t in tasks} == {want[role]}, role
        res = client(s.addr, "generate", "--json", "--max-tokens", "16", "--ignore-eos", "--block-size", "4")
        assert res.returncode == 0, res.stderr
    finally:
        s.stop()
    s = (
        server_factory("all-unplaced", ["all", *TINY, "--grace", "5", *torch_cpu, "--placement", "off"])
        .start()
        .wait_ready()
    )
    try:
        assert s.info["cpus"] == {}
        everything = placement.format_cpus(placement.available())
        assert {placement.format_cpus(os.sched_getaffinity(p)) for p in s.info["pids"].values()} == {everything}
    finally:
        s.stop()
