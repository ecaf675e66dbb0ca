"""``runtime/heap.py``: freed temporaries stay mapped for the next step (glibc), and the opt-out keeps glibc's
defaults. Each case runs in a fresh process: the thresholds are process-wide and set once."""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not hasattr(ctypes.CDLL(None), "gnu_get_libc_version"),
    reason="the thresholds are glibc's (Linux); elsewhere keep_freed_memory changes nothing",
)

# A step's pattern: a thread (not the main one: its own arena) allocates temporaries of 0.2-1.2 MB, frees them
# all, again and again; the minor page faults it costs are printed.
STEPS = """
import resource, sys, threading
import torch
from kakeya.runtime import heap
kept = heap.keep_freed_memory() if sys.argv[1] == "keep" else None

def steps():
    for _ in range(100):
        temporaries = [torch.ones((200 + 50 * j) * 256) for j in range(20)]
        del temporaries

before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
t = threading.Thread(target=steps)
t.start()
t.join()
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str, **env) -> tuple[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", STEPS, mode],
        capture_output=True,
        text=True,
        check=True,
        env={k: v for k, v in os.environ.items() if k != "KAKEYA_MALLOC"} | env,
        timeout=120,
    ).stdout.split()
    return out[0], int(out[1])


def test_freed_temporaries_are_reused_instead_of_faulted_in_again():
    kept, with_thresholds = _faults("keep")
    _, defaults = _faults("defaults")
    assert kept == "True"
    # glibc's defaults give the arena's free top back after every step, so every step faults its pages in again
    assert with_thresholds * 3 < defaults, (with_thresholds, defaults)


def test_the_opt_out_keeps_glibc_defaults():
    kept, opted_out = _faults("keep", KAKEYA_MALLOC="system")
    _, defaults = _faults("defaults")
    assert kept == "False"
    assert opted_out > defaults / 2, (opted_out, defaults)


def test_every_kakeya_command_sets_them_before_it_runs(monkeypatch):
    from kakeya.app import main as cli
    from kakeya.runtime import heap

    seen = []
    monkeypatch.setattr(heap, "keep_freed_memory", lambda: seen.append("thresholds") or True)
    parser = argparse.ArgumentParser()
    parser.set_defaults(func=lambda args: seen.append("command") or 0)
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    assert cli.main([]) == 0
    assert seen == ["thresholds", "command"]


def test_an_unknown_setting_is_refused_by_name(monkeypatch, capsys):
    from kakeya.app import main as cli
    from kakeya.runtime import heap

    heap.keep_freed_memory.cache_clear()  # set once per process: ask again
    monkeypatch.setenv("KAKEYA_MALLOC", "sytem")
    with pytest.raises(ValueError, match="KAKEYA_MALLOC must be 'system'.*'sytem'"):
        heap.keep_freed_memory()
    parser = argparse.ArgumentParser()
    parser.set_defaults(func=lambda args: 0)
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    assert cli.main([]) == 2  # the CLI's one line and exit status for what a user can fix
    assert "KAKEYA_MALLOC" in capsys.readouterr().err
