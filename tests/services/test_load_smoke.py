"""benchmarks/load.py end to end, briefly: 2 clients for 3 s against its own `serve all`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_load_suite_smoke(tmp_path):
    out = tmp_path / "load.json"
    res = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/load.py"), "--clients", "2", "--seconds", "3", "--max-tokens", "24", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=220,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    r = json.loads(out.read_text())
    assert r["clients"] == 2 and r["requests"] >= 2
    assert r["failed"] == 0 and r["mismatched"] == 0 and r["identical_to_ar"] == r["requests"]
    assert r["tokens"] == 24 * r["requests"] and r["aggregate_tok_s"] > 0
    assert 0 < r["latency_s"]["p50"] <= r["latency_s"]["p99"]
    assert set(r["rss_bytes"]["before"]) == {"verifier", "drafter", "orchestrator"}
    assert all(v > 0 for v in r["rss_bytes"]["after"].values())
