"""Single-Mac mode: run.sh's command is a real colocated `kakeya serve orchestrator` that serves
(started here through run.sh itself, MLX on CPU), the launchd plist runs it and outlasts its drain,
and docs/deploy.md's memory tables are `kakeya memory`'s numbers."""

from __future__ import annotations

import json
import os
import plistlib
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from kakeya.app.main import build_parser

from .manifests import ROOT

RUN = ROOT / "deploy" / "mac" / "run.sh"
PLIST = ROOT / "deploy" / "mac" / "com.kakeya.serve.plist"


def dry_run(env: dict, *extra: str) -> subprocess.CompletedProcess:
    full = (
        {k: v for k, v in os.environ.items() if not k.startswith("KAKEYA")}
        | {"KAKEYA": "kakeya", "KAKEYA_DRY_RUN": "1"}
        | env
    )
    return subprocess.run(["bash", str(RUN), *extra], env=full, check=False, capture_output=True, text=True, timeout=30)


def test_run_sh_is_a_colocated_mlx_orchestrator():
    out = dry_run({})
    assert out.returncode == 0, out.stderr
    argv = out.stdout.splitlines()
    args = build_parser().parse_args(argv[1:])
    assert (args.role, args.backend, args.verifier, args.drafter) == ("orchestrator", "mlx", None, None)  # colocated
    assert (args.host, args.port, args.target) == ("127.0.0.1", 50051, None)
    assert (args.http_port, args.prefix_cache_bytes) == (8000, "auto")  # sized when the server starts
    args = build_parser().parse_args(
        dry_run({"KAKEYA_HTTP_PORT": "off", "KAKEYA_PREFIX_CACHE_BYTES": "2G"}).stdout.splitlines()[1:]
    )
    assert (args.http_port, args.prefix_cache_bytes) == (None, 2 << 30)
    out = dry_run({"KAKEYA_TARGET": "/m/t", "KAKEYA_DRAFT": "/m/d", "KAKEYA_CACHE": "sink-window"}, "--window", "256")
    args = build_parser().parse_args(out.stdout.splitlines()[1:])
    assert (args.target, args.draft, args.cache, args.window) == ("/m/t", "/m/d", "sink-window", 256)
    half = dry_run({"KAKEYA_TARGET": "/m/t"})
    assert half.returncode == 2 and "both" in half.stderr


def test_launchd_plist_runs_run_sh_and_waits_for_the_drain():
    plist = plistlib.loads(PLIST.read_bytes())
    assert plist["Label"] == PLIST.stem
    assert plist["ProgramArguments"][-1].endswith("/deploy/mac/run.sh")
    env = plist["EnvironmentVariables"]
    read = set(re.findall(r"\$\{?(KAKEYA_[A-Z_]+)", RUN.read_text()))
    assert set(env) <= read, f"the plist sets variables run.sh never reads: {set(env) - read}"
    assert plist["ExitTimeOut"] > float(env["KAKEYA_GRACE"]), "launchd would SIGKILL before the drain ends"
    assert plist["KeepAlive"] == {"SuccessfulExit": False} and plist["RunAtLoad"] is True
    out = dry_run({k: v for k, v in env.items() if k not in ("KAKEYA_TARGET", "KAKEYA_DRAFT")})
    build_parser().parse_args(out.stdout.splitlines()[1:])


def test_run_sh_serves_and_drains(tmp_path):
    """run.sh itself, with `kakeya` = this checkout's CLI: SERVING, a health check, SIGTERM exits 0."""
    shim = tmp_path / "kakeya"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m kakeya.app.main "$@"\n')
    shim.chmod(0o755)
    ready = tmp_path / "ready.json"
    env = dict(os.environ, KAKEYA=str(shim), KAKEYA_PORT="0", KAKEYA_HTTP_PORT="0", KAKEYA_GRACE="5")
    proc = subprocess.Popen(
        ["bash", str(RUN), "--ready-file", str(ready)],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not ready.is_file():
            assert proc.poll() is None, proc.stdout.read().decode(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "run.sh not SERVING after 120 s"
            time.sleep(0.1)
        addr = json.loads(ready.read_text())["addr"]
        health = subprocess.run(
            [str(shim), "client", "--addr", addr, "health"],
            env=env,
            cwd=ROOT,
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert health.returncode == 0 and health.stdout.strip() == "SERVING", health.stderr
        http_port = json.loads(ready.read_text())["http_port"]
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=30) as r:  # the OpenAI API's
            assert r.status == 200
        proc.send_signal(signal.SIGTERM)  # run.sh exec'd the server: the signal reaches it
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


@pytest.mark.parametrize("preset", ["gemma-4-26b-a4b", "gemma-4-31b"])
def test_docs_memory_tables_are_kakeya_memory_numbers(preset):
    sys.path.insert(0, str(ROOT / "deploy" / "mac"))
    try:
        from memory_table import table
    finally:
        sys.path.pop(0)
    doc = (ROOT / "docs" / "deploy.md").read_text()
    m = re.search(rf"<!-- memory-table:{re.escape(preset)} -->\n(.*?)<!-- /memory-table -->", doc, re.DOTALL)
    assert m, f"docs/deploy.md has no memory table for {preset}"
    shown = [ln for ln in m.group(1).splitlines() if ln.startswith("|")]
    assert shown == table(preset).splitlines(), "regenerate with: .venv/bin/python deploy/mac/memory_table.py"
    # and the table really is `kakeya memory`: its JSON at 32K for the native policy
    out = subprocess.run(
        [sys.executable, "-m", "kakeya.app.main", "memory", "--preset", preset, "--context", "32768", "--json"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    native = json.loads(out.stdout.strip().splitlines()[-1])["native"]["total_bytes"] / 2**30
    row = next(ln for ln in shown if ln.startswith("| native |"))
    assert row.split("|")[3].strip() == f"{native:.2f} GiB"
