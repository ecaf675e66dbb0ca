"""The split across hosts: verifier, drafter, orchestrator and client each on a test host of its own
(``tests/hosts.py``: network namespaces joined by veth links to one switch), over real links.

What must hold across hosts as it does on loopback: the output equals the colocated output token for
token, and a drafter host cut off mid-stream costs the stream its drafter, never its tokens (the
orchestrator's step deadline notices the silence and the verifier finishes alone).
"""

from __future__ import annotations

import collections
import json
import re
import signal
import subprocess
import sys
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ..hosts import Hosts, unavailable
from .conftest import ROOT, TINY_MLX, start_all, wait_until

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


def _colocated(tokens: int) -> list[int]:
    """The same request colocated (one process, MLX): the reference every host layout must equal."""
    cmd = [sys.executable, "-m", "kakeya.app.main", "generate", *TINY_MLX, "--json", "--ignore-eos",
           "--max-tokens", str(tokens), "--block-size", "8"]  # fmt: skip
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])["token_ids"]


@pytest.fixture(scope="module")
def rolling_reference():
    return _colocated(ROLLING)


@pytest.fixture(scope="module")
def long_reference(rolling_reference):
    """The first LONG of the rolling restart's reference: greedy output is AR's whatever the length asked
    (lossless), so one colocated run of ROLLING tokens serves every test (another ``kakeya generate`` process cost
    ~5-15 s)."""
    assert len(rolling_reference) == ROLLING > LONG
    return rolling_reference[:LONG]


@pytest.fixture(scope="module")
def colocated_tokens(rolling_reference):
    """The first TOKENS of the same reference."""
    assert ROLLING > TOKENS
    return rolling_reference[:TOKENS]


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


# --------------------------------------------------------------------------- replicas on hosts of their own

# 8 streams, each long enough to be mid-way when a host goes: the faults hit within their first ~50 tokens (the
# orchestrators' logs: "lost after N tokens"), and 160 tokens still run past the 32-token ring several times after
# (240 made each of these tests wait ~8 s longer for the streams' end).
STREAMS, LONG = 8, 160
# The rolling restart's streams: each set lives through one restart (its role's second backend is drained once
# the first serves again): ~2x what 8 streams get through in the longest restart seen (18 s) on the busy machine.
ROLLING = 400


@pytest.fixture(scope="module")
def replicas(server_factory, tmp_path_factory):
    """Two verifier hosts, two drafter hosts, two orchestrator hosts (each orchestrator over both replicas of
    each role, as a headless Service's DNS lists pods) and a client host."""
    token = tmp_path_factory.mktemp("replicas") / "token"
    token.write_text("replicas-test-token\n")
    names = ["v1", "v2", "d1", "d2", "o1", "o2", "client"]
    with Hosts(names) as hosts:
        a = hosts.addr
        common = ["--host", "0.0.0.0", "--auth-token-file", str(token)]
        auth = [*common, "--grace", "1"]
        servers = {}
        for name in ("v1", "v2", "d1", "d2"):
            role = "verifier" if name[0] == "v" else "drafter"
            # the deployments' grace: a SIGTERM'd backend's drain hands its sessions over long before it ends
            backend = [role, *TINY_MLX, *common, "--grace", "30"]
            servers[name] = server_factory(name, backend, PORT[role], hosts.prefix(name))
        start_all([servers[n] for n in ("v1", "v2", "d1", "d2")])
        for name in ("o1", "o2"):
            servers[name] = server_factory(
                name,
                ["orchestrator", "--verifier", f"ipv4:{a['v1']}:{PORT['verifier']},{a['v2']}:{PORT['verifier']}",
                 "--drafter", f"ipv4:{a['d1']}:{PORT['drafter']},{a['d2']}:{PORT['drafter']}",
                 "--backend-token-file", str(token), "--backend-timeout", "3", "--metrics-port", "9464", *auth],
                PORT["orchestrator"], hosts.prefix(name),
            )  # fmt: skip
        start_all([servers["o1"], servers["o2"]])
        yield hosts, token, servers


# The client host's read of an orchestrator's /metrics: a bare HTTP/1.0 GET over a socket, the text parsed here. A
# probe that imported urllib and prometheus_client's parser on the client host cost ~0.19 CPU-s a read (this one:
# ~0.04, Python's start-up), and the streams tests poll them every 0.05-0.2 s while they wait.
FETCH = (
    "import socket, sys; s = socket.create_connection((sys.argv[1], 9464), 5);"
    "s.sendall(b'GET /metrics HTTP/1.0\\r\\nHost: metrics\\r\\n\\r\\n');"
    "sys.stdout.buffer.write(b''.join(iter(lambda: s.recv(1 << 16), b'')))"
)


def _metrics(hosts: Hosts, host: str) -> dict[tuple[str, str], float]:
    """Every sample of ``host``'s orchestrator as ``(name, label values joined by ",") -> value``, in one read from
    the client host."""
    res = subprocess.run([*hosts.prefix("client"), sys.executable, "-c", FETCH, hosts.addr[host]], capture_output=True)
    assert res.returncode == 0, res.stderr[-1000:]
    head, _, body = res.stdout.partition(b"\r\n\r\n")
    assert head.split(b"\r\n", 1)[0].split()[1] == b"200", head
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            key = (s.name, ",".join(s.labels.values()))
            out[key] = out.get(key, 0.0) + s.value
    return out


def _metric(hosts: Hosts, host: str, name: str, label: str | None = None) -> float:
    """The sum of a metric's samples (with ``label`` among their label values) on ``host``'s orchestrator."""
    return _total(_metrics(hosts, host), name, label)


def _total(samples: dict, name: str, label: str | None = None) -> float:
    return sum(v for (n, labels), v in samples.items() if n == name and (label is None or label in labels.split(",")))


def _start_streams(hosts: Hosts, token, orchestrators: list[str], tokens: int = LONG) -> list[subprocess.Popen]:
    addrs = ",".join(f"{hosts.addr[o]}:{PORT['orchestrator']}" for o in orchestrators)
    cmd = [*hosts.prefix("client"), sys.executable, "-m", "kakeya.app.main", "client", "--addr", addrs,
           "--auth-token-file", str(token), "--timeout", "300", "generate", "--json", "--ignore-eos",
           "--max-tokens", str(tokens), "--block-size", "8"]  # fmt: skip
    return [
        subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(STREAMS)
    ]


def _when_running(hosts: Hosts, host: str, n, timeout: float = 120) -> None:
    """Until ``host``'s orchestrator runs ``n`` streams at once (``n``: a number, or a function giving it)."""
    deadline = time.monotonic() + timeout
    while _metric(hosts, host, "kakeya_num_requests_running") < (n() if callable(n) else n):
        assert time.monotonic() < deadline, f"{n} streams never ran at once on {host}"
        time.sleep(0.2)


def _outputs(procs: list[subprocess.Popen]) -> list[list[int]]:
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr[-2000:]
        out.append(json.loads(stdout.strip().splitlines()[-1])["token_ids"])
    return out


def test_a_verifier_host_killed_under_8_streams_fails_none_and_restarts(replicas, long_reference):
    """The host is restarted at once, as its supervisor would, while the streams finish on the other replica. That
    the restarted host serves again is what the next tests stand on: with v2 cut off, every stream of the next one
    finishes on this host, and the rolling restart's first drain (this host) must hand sessions over, which its
    streams, balanced over both verifiers, reach only if it serves. (A second round of 8 streams here checked it
    once more, for ~30 s.)"""
    hosts, token, servers = replicas
    before = _metric(hosts, "o1", "kakeya_takeovers_total", "verifier")
    procs = _start_streams(hosts, token, ["o1"])
    _when_running(hosts, "o1", STREAMS)
    servers["v1"].signal(signal.SIGKILL)  # the host's process dies; the other replica lives
    servers["v1"].wait(10)
    servers["v1"].start()  # the host restarts (it loads while the streams run on the other replica)
    assert _outputs(procs) == [long_reference] * STREAMS
    assert _metric(hosts, "o1", "kakeya_takeovers_total", "verifier") > before  # the streams on it moved
    servers["v1"].wait_ready()  # and is SERVING again


def test_a_verifier_host_cut_off_under_8_streams_fails_none(replicas, long_reference):
    """A cut (no FIN, no RST: the peer just goes silent) is found by the backend channels' 1 s keepalive within ~2 s,
    so each stream on the cut-off host is taken over once, onto the live replica: none goes back to the cut-off
    host and waits out another step deadline there (with 60 s keepalives one request lost its verifier 3 times)."""
    hosts, token, servers = replicas
    before = _metric(hosts, "o2", "kakeya_takeovers_total", "verifier")
    log_from = len(servers["o2"].log_file.read_bytes())
    procs = _start_streams(hosts, token, ["o2"])
    _when_running(hosts, "o2", STREAMS)
    hosts.cut("v2")
    try:
        assert _outputs(procs) == [long_reference] * STREAMS
    finally:
        hosts.mend("v2")
    assert _metric(hosts, "o2", "kakeya_takeovers_total", "verifier") > before
    log = servers["o2"].log_file.read_bytes()[log_from:].decode(errors="replace")
    losses = collections.Counter(re.findall(r"request (\S+): verifier lost", log))
    assert losses and max(losses.values()) == 1, losses


def test_a_drafter_host_cut_off_under_8_streams_changes_no_token(replicas, long_reference):
    hosts, token, _ = replicas
    procs = _start_streams(hosts, token, ["o1"])
    _when_running(hosts, "o1", STREAMS)
    hosts.cut("d1")
    try:
        assert _outputs(procs) == [long_reference] * STREAMS
    finally:
        hosts.mend("d1")


def test_an_orchestrator_host_killed_mid_stream_its_clients_resume_on_the_other(replicas, long_reference):
    hosts, token, servers = replicas
    procs = _start_streams(hosts, token, ["o1", "o2"])  # each client: o1 first, o2 when o1 is gone
    _when_running(hosts, "o1", STREAMS)
    servers["o1"].signal(signal.SIGKILL)
    servers["o1"].wait(10)
    servers["o1"].start()  # restarted at once: it loads while its clients finish on o2
    assert _outputs(procs) == [long_reference] * STREAMS  # 0 tokens lost or repeated
    servers["o1"].wait_ready()


HANDOFFS, BACKENDS = "kakeya_drain_handoffs_total", ("v1", "v2", "d1", "d2")


def _connected(hosts: Hosts, frm: str, to: str, port: int) -> bool:
    """Whether ``frm`` holds an established TCP connection to ``to``'s ``port`` (read on ``to``: its sockets)."""
    cmd = [*hosts.prefix(to), "ss", "-Htn", "state", "established", "sport", "=", f":{port}", "dst", hosts.addr[frm]]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    return bool(res.stdout.strip())


def _wait_connected(hosts: Hosts, frm: str, backends, timeout: float = 60) -> None:
    """Until ``frm``'s orchestrator is connected to every one of ``backends`` (its channel's round-robin reconnects
    to a restarted replica within its backoff, at most ~2 s)."""
    for name in backends:
        port = PORT["verifier" if name[0] == "v" else "drafter"]
        wait_until(lambda n=name, p=port: _connected(hosts, frm, n, p), timeout, 0.1, f"{frm} to reconnect to {name}")


def test_a_rolling_restart_of_every_backend_under_8_streams_fails_none(replicas, rolling_reference):
    """The issue's goal: each backend in turn (verifier A, B, drafter A, B) SIGTERMed while 8 streams run, then
    restarted and SERVING again (and reconnected to by the orchestrator) before the next. Its sessions move at their
    next step (drain hand-offs, never a loss or an AR fallback), 0 requests fail, every output equals the
    uninterrupted run, and each backend is out of service -- SIGTERM to its process's exit, long before the streams
    it served end -- within 10 s.

    Two sets of 8 streams, each living through two drains and the restart between them, as a rolling update's
    clients would: the first through the verifiers', the second (started once verifier B serves again, beside what
    is left of the first) through the drafters'. Each drain is checked on its own: its set's streams still run when
    its process exits, and the hand-offs of its role moved in its turn. A fresh set per backend checked the same in
    more time (each waited out its clients' start-up, its streams' end and a fixed 2.5 s for the reconnection); one
    set through all four needed streams long enough for three restarts on a busy machine (7-18 s each there), and
    their end cost more than it saved."""
    hosts, token, servers = replicas
    _wait_connected(hosts, "o1", BACKENDS)  # each new session is balanced over both replicas of its role
    before = _metrics(hosts, "o1")
    t_start = time.monotonic()
    sets = {"verifiers": _start_streams(hosts, token, ["o1"], ROLLING)}
    _when_running(hosts, "o1", STREAMS)
    out_of_service, back, running = {}, {}, {}
    for name in BACKENDS:
        role = "verifier" if name[0] == "v" else "drafter"
        if name == "d1":  # the second set, beside what is left of the first
            first = sets["verifiers"]
            sets["drafters"] = _start_streams(hosts, token, ["o1"], ROLLING)
            _when_running(hosts, "o1", lambda first=first: STREAMS + sum(p.poll() is None for p in first))
        procs = sets[role + "s"]
        handed = _total(_metrics(hosts, "o1"), HANDOFFS, role)
        t0 = time.monotonic()
        servers[name].signal(signal.SIGTERM)
        assert servers[name].wait(30) == 0, servers[name].log()
        out_of_service[name] = time.monotonic() - t0
        running[name] = sum(p.poll() is None for p in procs)
        assert running[name], f"{name}: the streams ended before the drain: nothing was handed over"
        servers[name].start()
        wait_until(lambda role=role, handed=handed: _total(_metrics(hosts, "o1"), HANDOFFS, role) > handed,
                   timeout=30, what=f"{name}: a session handed over")  # fmt: skip
        if name != BACKENDS[-1]:  # the last one comes back while the streams finish
            servers[name].wait_ready()
            _wait_connected(hosts, "o1", [name])
            back[name] = time.monotonic() - t0
    print(f"out of service (SIGTERM to exit, s): {out_of_service}; SERVING again after (s): {back};"
          f" streams running at each exit: {running}; all four done {time.monotonic() - t_start:.1f} s in")  # fmt: skip
    assert _outputs(sets["verifiers"]) == [rolling_reference] * STREAMS
    assert _outputs(sets["drafters"]) == [rolling_reference] * STREAMS
    after = _metrics(hosts, "o1")
    for lost in ("kakeya_takeovers_total", "kakeya_ar_fallbacks_total", "kakeya_errors_total"):
        assert _total(after, lost) == _total(before, lost), f"{lost} moved"
    assert _total(after, "kakeya_request_success_total", "error") == _total(
        before, "kakeya_request_success_total", "error")  # fmt: skip
    assert max(out_of_service.values()) <= 10.0, out_of_service
    servers[BACKENDS[-1]].wait_ready()
