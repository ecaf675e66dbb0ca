"""`serve all`'s run directory: named by its pid, and swept when a killed `serve all` left it behind."""

from __future__ import annotations

import os
import subprocess
import sys

from kakeya.app.supervisor import RUN_DIR_PREFIX, run_dir, sweep_run_dirs


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid  # reaped: no process has it (until the system reuses it, which a test run won't)


def test_sweep_removes_only_dead_owners_dirs(tmp_path):
    dead = tmp_path / f"{RUN_DIR_PREFIX}{dead_pid()}-abc"
    dead.mkdir()
    (dead / "backend.token").write_text("secret\n")
    live = tmp_path / f"{RUN_DIR_PREFIX}{os.getpid()}-def"  # this process: alive
    live.mkdir()
    legacy = tmp_path / f"{RUN_DIR_PREFIX}xyz"  # no pid in the name: whose it is can't be told, so kept
    legacy.mkdir()
    other = tmp_path / "unrelated-123-abc"
    other.mkdir()
    target = tmp_path / "elsewhere"
    target.mkdir()
    link = tmp_path / f"{RUN_DIR_PREFIX}{dead_pid()}-lnk"
    link.symlink_to(target)  # a link is never followed nor removed
    assert sweep_run_dirs(tmp_path) == [dead]
    assert not dead.exists()
    assert live.is_dir() and legacy.is_dir() and other.is_dir() and link.is_symlink() and target.is_dir()


def test_run_dir_carries_the_pid_and_is_private(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    left = tmp_path / f"{RUN_DIR_PREFIX}{dead_pid()}-old"
    left.mkdir()
    with run_dir() as d:
        assert os.path.basename(d).startswith(f"{RUN_DIR_PREFIX}{os.getpid()}-")
        assert os.stat(d).st_mode & 0o777 == 0o700
        assert not left.exists()  # the start swept the killed one's leftover
    assert not os.path.exists(d)
