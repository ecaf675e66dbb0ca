"""The split across hosts: verifier, drafter, orchestrator and client each on a test host of its own
(``tests/hosts.py``: network namespaces joined by veth links to one switch), over real links.

What must hold across hosts as it does on loopback: the output equals the colocated output token for
token, and a drafter host cut off mid-stream costs the stream its drafter, never its tokens (the
orchestrator's step deadline notices the silence and the verifier finishes alone).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from ..hosts import Hosts, unavailable
from .conftest import ROOT, TINY_MLX, start_all

WHY = unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no test hosts here: {WHY}")

TOKENS = 200  # past the tiny target's 32-token ring several times
PORT = {"verifier": 50061, "drafter": 50071, "orchestrator": 50051}


@pytest.fixture(scope="module")
def split(server_factory, tmp_path_factory):
    token = tmp_path_factory.mktemp("hosts") / "token"
    token.write_text("hosts-test-token\n")
    with Hosts(["verifier", "drafter", "orchestrator", "client"]) as hosts:
        a = hosts.addr
        auth = ["--host", "0.0.0.0", "--auth-token-file", str(token), "--grace", "1"]
        verifier = server_factory(
            "verifier", ["verifier", *TINY_MLX, *auth], PORT["verifier"], hosts.prefix("verifier")
        )
        drafter = server_factory("drafter", ["drafter", *TINY_MLX, *auth], PORT["drafter"], hosts.prefix("drafter"))
        orch = server_factory(
            "orchestrator",
            ["orchestrator", "--verifier", f"{a['verifier']}:{PORT['verifier']}",
             "--drafter", f"{a['drafter']}:{PORT['drafter']}", "--backend-token-file", str(token),
             "--backend-timeout", "3", *auth],
            PORT["orchestrator"], hosts.prefix("orchestrator"),
        )  # fmt: skip
        start_all([verifier, drafter])
        start_all([orch])
        yield hosts, token, {"verifier": verifier, "drafter": drafter, "orchestrator": orch}


def _client(hosts: Hosts, token, *args: str, timeout: float = 300) -> dict:
    """`kakeya client generate ... --json` on the client host, against the orchestrator's host."""
    cmd = [*hosts.prefix("client"), sys.executable, "-m", "kakeya.app.main", "client",
           "--addr", f"{hosts.addr['orchestrator']}:{PORT['orchestrator']}", "--auth-token-file", str(token),
           "generate", "--json", "--ignore-eos", *args]  # fmt: skip
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def colocated_tokens():
    """The same request colocated (one process, MLX): the reference every host layout must equal."""
    cmd = [sys.executable, "-m", "kakeya.app.main", "generate", *TINY_MLX, "--json", "--ignore-eos",
           "--max-tokens", str(TOKENS), "--block-size", "8"]  # fmt: skip
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])["token_ids"]


def _reaches(hosts: Hosts, frm: str, to: str, port: int) -> bool:
    """Whether host ``frm`` opens a TCP connection to ``to``'s port within a second."""
    probe = f"import socket; socket.create_connection(('{hosts.addr[to]}', {port}), 1).close()"
    return subprocess.run([*hosts.prefix(frm), sys.executable, "-c", probe], capture_output=True).returncode == 0


def test_hosts_are_reachable_only_through_their_links(split):
    hosts, _, _ = split
    assert _reaches(hosts, "client", "verifier", PORT["verifier"])
    hosts.cut("verifier")
    try:
        assert not _reaches(hosts, "client", "verifier", PORT["verifier"])  # nothing else carries the packets
    finally:
        hosts.mend("verifier")
    assert _reaches(hosts, "client", "verifier", PORT["verifier"])


def test_the_split_across_hosts_equals_colocated(split, colocated_tokens):
    hosts, token, _ = split
    out = _client(hosts, token, "--max-tokens", str(TOKENS), "--block-size", "8")
    assert out["token_ids"] == colocated_tokens
    assert out["drafter_fallback"] is False  # the drafter, across its link, drafted every block


def test_a_drafter_host_cut_off_mid_stream_costs_the_drafter_not_the_tokens(split, colocated_tokens):
    hosts, token, servers = split
    cmd = [*hosts.prefix("client"), sys.executable, "-m", "kakeya.app.main", "client",
           "--addr", f"{hosts.addr['orchestrator']}:{PORT['orchestrator']}", "--auth-token-file", str(token),
           "generate", "--json", "--ignore-eos", "--max-tokens", str(TOKENS), "--block-size", "8"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1.0)  # the stream is under way (the client's start-up included)
        hosts.cut("drafter")
        out, err = proc.communicate(timeout=300)
    finally:
        hosts.mend("drafter")
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-2000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["token_ids"] == colocated_tokens
    assert result["drafter_fallback"] is True  # the verifier finished alone
    assert servers["drafter"].alive()  # a partition, not a crash: the drafter process lived through it
