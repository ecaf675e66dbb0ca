"""The cpu-dev overlay's pods as local processes: the rendered containers' commands and arguments
(same flags, same ports' roles), started on loopback, serve real requests, no cluster needed.

Two verifier replicas stand behind the orchestrator's verifier target, the way the headless
Service's DNS lists every ready pod: the orchestrator must open its sessions on both (gRPC
round_robin), and every output must equal the colocated engine's and a single-verifier run's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest

from kakeya.checkpoints.tiny import embedded_pair
from kakeya.orchestrator.assembly import build_local_engine, split_engine
from kakeya.orchestrator.decode.engine import Request
from tests.services.conftest import (
    Server,
    assert_unauthenticated,
    generate,
    request,
    stop_all,
    verifier_info,
    wait_until,
)

from .manifests import DOCKER, ROOT, argv, config_env, flag, render

PROMPTS = ["def add(a, b):", "The quick brown fox", "for i in range(10):", "import os\n"]
MAX_TOKENS = 12


TOKEN = "cluster-internal-token-0123456789"
MOUNTED_TOKEN = "/etc/kakeya/internal/token"  # the kakeya-internal-token Secret's mount


def local_argv(role: str, services: dict[str, str], token_file: str) -> list[str]:
    """A cpu-dev container's `kakeya serve ...` arguments for a loopback process.

    Kept: every flag as rendered. Changed: listen on loopback (Server adds `--port 0` and a ready
    file: the last --port wins, as in argparse), a Service name resolves to local addresses,
    the mounted Secret's token file is ``token_file``, and metrics and HTTP take any free port (the pods'
    9464 and 8000 would collide on one host: two orchestrators run at once here).
    """
    cmd = argv(render("cpu-dev"), role)
    assert cmd[:2] == ["kakeya", "serve"]
    out = []
    for a in cmd[2:]:
        if a == "--host=0.0.0.0":
            a = "--host=127.0.0.1"
        for name, local in services.items():
            a = a.replace(f"dns:///{name}", local)
        if a.startswith(("--metrics-port=", "--http-port=")):
            a = a.split("=")[0] + "=0"
        out.append(a.replace(f"={MOUNTED_TOKEN}", f"={token_file}"))
    return out


@contextmanager
def local_cluster(tmp: Path, verifier_flags: tuple[str, ...] = (), orchestrator_flags: tuple[str, ...] = ()):
    """cpu-dev's pods as loopback processes: verifier-0, verifier-1, drafter-0 and the orchestrator over them (the
    rendered flags, then ``*_flags``: the last of a flag wins, as in argparse), stopped on the way out."""
    token_file = tmp / "token"
    token_file.write_text(TOKEN + "\n")
    started: list[Server] = []
    try:
        backends = [
            Server(n, [*local_argv(r, {}, str(token_file)), *(verifier_flags if r == "verifier" else ())], tmp)
            for n, r in (("verifier-0", "verifier"), ("verifier-1", "verifier"), ("drafter-0", "drafter"))
        ]
        started += backends
        for s in backends:
            s.start()
        for s in backends:
            s.wait_ready()
        v0, v1, d0 = backends
        # The headless Services' DNS answers: every ready replica, with the port the Service names.
        verifiers = "ipv4:" + ",".join(v.addr for v in (v0, v1))
        drafters = f"ipv4:{d0.addr}"
        services = {"kakeya-verifier-headless:50061": verifiers, "kakeya-drafter-headless:50062": drafters}
        orch_args = local_argv("orchestrator", services, str(token_file))
        assert flag(orch_args, "--verifier") == verifiers and flag(orch_args, "--drafter") == drafters
        orch = Server("orchestrator", [*orch_args, *orchestrator_flags], tmp)
        started.append(orch)
        orch.start().wait_ready()
        yield {"orchestrator": orch, "verifiers": [v0, v1], "drafter": d0}
    finally:
        stop_all(started)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with local_cluster(tmp_path_factory.mktemp("cpu-dev")) as pods:
        yield pods


def test_cpu_dev_pods_serve_on_loopback_and_balance_sessions(cluster):
    orch, (v0, v1), d0 = cluster["orchestrator"], cluster["verifiers"], cluster["drafter"]
    before = [verifier_info(v.addr, TOKEN).total_sessions for v in (v0, v1)]
    served = [generate(orch.addr, request(text=p, max_tokens=MAX_TOKENS)) for p in PROMPTS]
    after = [verifier_info(v.addr, TOKEN).total_sessions for v in (v0, v1)]
    per_replica = [a - b for a, b in zip(after, before)]
    assert sum(per_replica) == len(PROMPTS)
    assert min(per_replica) >= 1, f"sessions per verifier replica: {per_replica} (round_robin should use both)"

    pair = embedded_pair()  # what the cpu-dev servers load without --target/--draft
    colocated = build_local_engine(str(pair.target), str(pair.draft))
    single = split_engine(v0.addr, d0.addr, None, 30.0, token=TOKEN)  # one verifier: the pre-balancing path
    for prompt, (ids, _text, complete, _chunks) in zip(PROMPTS, served):
        prompt_ids = colocated.codec.encode(prompt)
        assert list(complete.prompt_token_ids) == prompt_ids
        req = Request(prompt_ids, max_tokens=MAX_TOKENS, ignore_eos=True)
        assert ids == colocated.generate(req).token_ids, f"split over two replicas != colocated for {prompt!r}"
        assert ids == single.generate(req).token_ids, f"two replicas != one verifier for {prompt!r}"
        assert len(ids) == MAX_TOKENS and not complete.stats.drafter_fallback


def test_a_pod_that_is_not_an_orchestrator_is_refused(cluster):
    """A client without the internal token (any pod the NetworkPolicy would let through by mistake):
    every verifier and drafter RPC is UNAUTHENTICATED; health stays open for the probes."""
    for v in cluster["verifiers"]:
        assert_unauthenticated("verifier", v.addr)
        assert_unauthenticated("verifier", v.addr, "a-guessed-token-0123456789")
    assert_unauthenticated("drafter", cluster["drafter"].addr)


def test_image_healthcheck_script_against_a_live_server(cluster):
    script = str(DOCKER / "healthcheck.py")
    env = dict(os.environ, KAKEYA_HEALTH_ADDR=cluster["orchestrator"].addr)
    ok = subprocess.run(
        [sys.executable, script], env=env, check=False, capture_output=True, text=True, timeout=30, cwd=ROOT
    )
    assert ok.returncode == 0 and "SERVING" in ok.stdout, ok.stderr
    env["KAKEYA_HEALTH_ADDR"] = "127.0.0.1:1"  # nothing listens there
    down = subprocess.run(
        [sys.executable, script], env=env, check=False, capture_output=True, text=True, timeout=30, cwd=ROOT
    )
    assert down.returncode == 1 and "UNAVAILABLE" in down.stderr


def test_a_rolling_update_at_full_load_fails_no_stream(tmp_path):
    """A rolling update (or a node drain) SIGTERMs a verifier pod while every replica is at its --max-sessions. Its
    sessions move to another SERVING replica at their next step (docs/operations.md, "Drains"); here the only other
    one is full, and the orchestrators may know no other: they re-resolve the headless Service only when a connection
    drops, so the surge pod maxSurge brought up is not among their replicas yet. A refused hand-off stays and finishes
    within --grace, as a drain with nowhere to go does (until 2026-12-07 it failed the stream: HTTP 500 / INTERNAL
    "generation failed: verifier: session limit reached")."""
    per_replica = 2
    # a grace the streams finish within on a loaded runner (a full suite beside it: 400 tokens took over the manifests'
    # 30 s); a grace that ends first ends its sessions UNAVAILABLE, as docs/operations.md says: not what this tests
    verifier_flags = (f"--max-sessions={per_replica}", "--grace=300")
    with local_cluster(tmp_path, verifier_flags, ("--max-sessions=4",)) as pods:
        orch, (v0, v1) = pods["orchestrator"], pods["verifiers"]
        max_tokens = 400  # long enough that the other replica's own streams still hold it when the hand-off comes
        with ThreadPoolExecutor(2 * per_replica) as pool:
            streams = [pool.submit(generate, orch.addr, request(text=p, max_tokens=max_tokens)) for p in PROMPTS]
            wait_until(lambda: all(verifier_info(v.addr, TOKEN).live_sessions == per_replica for v in (v0, v1)),
                       what="both verifier replicas full")  # fmt: skip
            v0.signal(15)  # SIGTERM, as the kubelet sends it
            finished = [f.result()[2] for f in streams]
        assert v0.wait(60) == 0
        assert [(c.error_message, c.completion_tokens) for c in finished] == [("", max_tokens)] * len(PROMPTS)


def test_the_http_api_lists_the_model_under_the_configmaps_name(cluster):
    """An OpenAI client reads the model id from /v1/models and sends it back: the ConfigMap's, as the pod serves it."""
    import json
    import urllib.request

    orch = cluster["orchestrator"]
    with urllib.request.urlopen(f"http://127.0.0.1:{orch.info['http_port']}/v1/models", timeout=30) as r:
        listed = [m["id"] for m in json.load(r)["data"]]
    assert listed == [config_env(render("cpu-dev"))["KAKEYA_SERVED_MODEL_NAME"]]
