"""`kakeya serve all`: three processes that start together and stop together."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from .conftest import ROOT, TINY, TINY_ALL_MLX, assert_unauthenticated, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # real processes: bounded, never hanging


def pid_alive(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    if Path("/proc/self/stat").exists():  # Linux: a zombie (exited, not yet reaped) counts as gone
        try:
            return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
        except (FileNotFoundError, ProcessLookupError):
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _reap(s) -> None:
    """Stop ``s``; SIGKILL any of its children that outlived it (only while still ours: never a reused pid)."""
    s.stop()
    for pid in s.info.get("pids", {}).values():
        if pid_alive(pid):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                cmd = b""
            if b"kakeya.app.main" in cmd:
                os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def policy_all(server_factory):
    """`serve all` with a bounded default cache policy, shared: the policy flags' test uses it, then the SIGKILL test
    kills it (a stack of its own cost that test ~15-20 s of start-up, the other tests' stacks take flags it has no
    use for); afterwards none of its children survive."""
    s = server_factory(
        "all-policy",
        ["all", *TINY_ALL_MLX, "--grace", "5", "--cache", "sink-window", "--sink", "4", "--window", "16",
         "--full-kv-bits", "8"],
    ).start().wait_ready()  # fmt: skip
    yield s
    _reap(s)


@pytest.fixture(scope="module")
def http_all(server_factory):
    """`serve all --http-port` (and a prefix cache), shared: the OpenAI client's test uses it, then the SIGTERM test
    checks its processes and ends it (a stack of its own cost that test ~12-17 s of start-up)."""
    s = server_factory(
        "all-http", ["all", *TINY_ALL_MLX, "--grace", "5", "--http-port", "0", "--prefix-cache-bytes", "64M"],
    ).start().wait_ready()  # fmt: skip
    yield s
    _reap(s)


def client(addr, *args):
    return subprocess.run(
        [sys.executable, "-m", "kakeya.app.main", "client", "--addr", addr, *args],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.parametrize("verifier_backend,drafter_backend", [("torch", "mlx"), ("mlx", "torch")])
def test_mixed_backends_over_grpc_match_greedy_ar(server_factory, mlx_target, verifier_backend, drafter_backend):
    """A torch verifier with an MLX drafter (and the reverse), as separate processes: the AR tokens."""
    from kakeya.verifier.mlx_backend.reference import greedy_reference

    s = (
        server_factory(
            "all",
            [
                "all",
                *TINY,
                "--grace",
                "5",
                "--verifier-backend",
                verifier_backend,
                "--drafter-backend",
                drafter_backend,
            ],
        )
        .start()
        .wait_ready()
    )
    try:
        prompt = "0,".join(str(i) for i in range(2, 12))  # any text; compared as token ids below
        res = client(s.addr, "generate", "--json", "--max-tokens", "120", "--ignore-eos", "--block-size", "8",
                     "--prompt", prompt)  # fmt: skip
        assert res.returncode == 0, res.stderr
        out = json.loads(res.stdout.strip().splitlines()[-1])
        ref, _, _ = greedy_reference(mlx_target.model, out["prompt_token_ids"], 120)
        assert out["token_ids"] == ref  # 120 tokens: past three wraps of the 32-position window
        assert out["drafter_fallback"] is False
    finally:
        s.stop()


def test_cache_policy_flags_on_servers_and_client(policy_all, mlx_target, aux_layers):
    """The verifier's default policy comes from `serve ... --cache`; a client may ask for another."""
    from kakeya.core.request import CachePolicy
    from kakeya.orchestrator.decode.loop import run
    from kakeya.verifier.session import LocalVerifierSession

    s = policy_all
    outs = {}
    for extra in ([], ["--cache", "native"]):
        res = client(s.addr, "generate", "--json", "--max-tokens", "80", "--ignore-eos", *extra)
        assert res.returncode == 0, res.stderr
        outs[bool(extra)] = json.loads(res.stdout.strip().splitlines()[-1])
    server_default, asked_native = outs[False], outs[True]
    policy = CachePolicy("sink-window", sink=4, window=16, full_kv_bits=8)
    assert server_default["cache_policy"] == policy.label and asked_native["cache_policy"] == "native"
    expected = run(
        LocalVerifierSession(mlx_target, aux_layers, policy), None, server_default["prompt_token_ids"], 80, 1
    )
    assert server_default["token_ids"] == expected.token_ids
    assert server_default["verifier_kv_bytes"]["sliding"] < asked_native["verifier_kv_bytes"]["sliding"]


def test_children_die_with_the_parent(policy_all):
    """After the policy flags' test, on its stack (in file order; alone, on a fresh one): SIGKILLed, it takes its
    children with it."""
    s = policy_all
    pids = s.info["pids"]
    assert all(pid_alive(p) for p in pids.values())
    s.signal(signal.SIGKILL)
    s.wait(10)
    wait_until(lambda: not any(pid_alive(p) for p in pids.values()), what="orphaned children to exit")
    # killed outright, it could not remove its run directory (the children's token is in it): the next
    # `serve all` does, and this test does it the same way instead of leaving one per run
    from kakeya.app.supervisor import RUN_DIR_PREFIX, sweep_run_dirs

    left = list(Path(tempfile.gettempdir()).glob(f"{RUN_DIR_PREFIX}{s.info['pid']}-*"))
    assert len(left) == 1 and (left[0] / "backend.token").exists()
    assert left[0] in sweep_run_dirs()
    assert not left[0].exists()


def test_client_help_documents_what_the_server_takes():
    """`kakeya client generate --help` documented --restore ftheta:DIR, which the server refuses: it takes a source NAME."""
    res = client("127.0.0.1:1", "generate", "--help")
    assert res.returncode == 0 and "--restore NAME" in res.stdout and "ftheta:DIR" not in res.stdout, res.stdout


def test_the_openai_client_through_serve_all_gets_the_grpc_clients_tokens(http_all):
    """`serve all --http-port`: the official client, completions and chat, streaming and not, gets the tokens
    `kakeya client generate` gets for the same greedy request; a second chat turn through HTTP resumes the
    first from both processes' prefix caches."""
    from openai import OpenAI

    s = http_all
    api = OpenAI(base_url=f"http://127.0.0.1:{s.info['http_port']}/v1", api_key="-", max_retries=0)
    model = api.models.list().data[0].id
    extra = {"ignore_eos": True}
    prompt = "def load(path):"
    for chat in (False, True):
        res = client(s.addr, "generate", "--json", "--max-tokens", "24", "--ignore-eos", "--prompt", prompt,
                     *(["--chat"] if chat else []))  # fmt: skip
        assert res.returncode == 0, res.stderr
        want = json.loads(res.stdout.strip().splitlines()[-1])["token_ids"]
        for stream in (False, True):
            if chat:
                out = api.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                  max_tokens=24, temperature=0, stream=stream, extra_body=extra)  # fmt: skip
            else:
                out = api.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0, stream=stream,
                                             extra_body=extra)  # fmt: skip
            last = list(out)[-1] if stream else out
            assert last.model_extra["kakeya"]["token_ids"] == want, (chat, stream)
    ids = [2] + list(range(100, 140))
    first = api.completions.create(model=model, prompt=ids, max_tokens=20, temperature=0, extra_body=extra)
    answer = first.model_extra["kakeya"]["token_ids"]
    second = api.completions.create(model=model, prompt=ids + answer + [50, 51], max_tokens=8, temperature=0,
                                    extra_body=extra)  # fmt: skip
    assert second.usage.prompt_tokens_details.cached_tokens == len(ids) + len(answer) - 1


def test_the_ready_line_says_where_the_http_api_listens(http_all):
    """Before the SIGTERM test, on its stack: with --http-port 0 serve all picks the port; its ready line names it."""
    s = http_all
    ready = next(line for line in s.log_file.read_text().splitlines() if "all SERVING" in line)  # log(): its tail
    assert f"HTTP (OpenAI API) http://127.0.0.1:{s.info['http_port']}/v1" in ready, ready


def test_serve_all_runs_three_processes_and_sigterm_stops_them_all(http_all):
    """After the OpenAI client's test, on its stack (in file order; alone, on a fresh one): SIGTERM ends it."""
    s = http_all
    pids = s.info["pids"]
    assert set(pids) == {"verifier", "drafter", "orchestrator"}
    assert len({s.proc.pid, *pids.values()}) == 4 and all(pid_alive(p) for p in pids.values())
    assert client(s.addr, "health").stdout.strip() == "SERVING"
    for service in ("verifier", "drafter"):  # loopback only, and only for the orchestrator: a run's own token
        assert s.info[service].startswith("127.0.0.1:")
        assert_unauthenticated(service, s.info[service])
    res = client(s.addr, "generate", "--json", "--max-tokens", "16", "--ignore-eos", "--block-size", "8")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(out["token_ids"]) == 16 and out["backend"] == "grpc"
    # the blocks' real sizes (the client used to rebuild them from the acceptance lengths)
    assert out["block_sizes"][0] == 8 and len(out["block_sizes"]) == len(out["acceptance_lengths"])
    assert all(a <= b <= 8 for a, b in zip(out["acceptance_lengths"], out["block_sizes"]))
    s.signal(signal.SIGTERM)
    assert s.wait(60) == 0
    wait_until(lambda: not any(pid_alive(p) for p in pids.values()), what="children gone")


def test_serve_all_hands_each_child_both_branches_flags():
    """The prefix cache and the HTTP front's flags reach their children beside the internal token, the per-peer
    cap and the n-gram switch (no child is started: the argv alone)."""
    from kakeya.app import flags as serve_flags
    from kakeya.app.main import build_parser

    a = build_parser().parse_args(["serve", "all", "--prefix-cache-bytes", "64M", "--http-port", "8000",
                                   "--served-model-name", "m", "--max-sessions-per-peer", "3", "--ngram", "off",
                                   "--http-header-timeout", "2", "--http-body-timeout", "3",
                                   "--queue", "8", "--queue-timeout", "4"])  # fmt: skip

    def value(argv, flag):
        return argv[argv.index(flag) + 1]

    for role in ("verifier", "drafter"):
        argv = serve_flags.child_argv(a, role, "tok")
        assert value(argv, "--prefix-cache-bytes") == str(64 << 20) and value(argv, "--auth-token-file") == "tok"
    for role in ("all", "drafter", "orchestrator"):  # pre-drafting was removed: its flags are refused by name
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", role, "--predraft-blocks", "4"])
    argv = serve_flags.child_argv(a, "orchestrator", "tok")
    assert (value(argv, "--http-port"), value(argv, "--served-model-name")) == ("8000", "m")
    assert (value(argv, "--max-sessions-per-peer"), value(argv, "--backend-token-file"), value(argv, "--ngram")) == (
        "3",
        "tok",
        "off",
    )
    # the public front queues generations too (issue 58: its --max-sessions refused before the backends' queue)
    assert (value(argv, "--queue"), value(argv, "--queue-timeout")) == ("8", "4.0")
    o = build_parser().parse_args(["serve", "orchestrator", *argv])
    assert (o.queue, o.queue_timeout) == (8, 4.0)
    assert "--prefix-cache-bytes" not in argv  # a split orchestrator keeps no model state
    timeouts = [value(argv, f) for f in ("--http-header-timeout", "--http-body-timeout", "--http-keep-alive")]
    assert timeouts == ["2.0", "3.0", "5.0"]
    auto = build_parser().parse_args(["serve", "all"])  # each model server sizes its own cache when it starts
    assert value(serve_flags.child_argv(auto, "verifier", "tok"), "--prefix-cache-bytes") == "auto"


def test_every_serve_flag_with_a_default_says_it_in_its_help():
    """`kakeya serve all --help` read "--start-timeout: seconds to wait for each process to be SERVING" (600),
    "--max-tokens-limit: largest max_tokens accepted" (4096), "--default-max-tokens: what max_tokens = 0 means" (128)
    and "--sink: attention sinks kept forever" (4): what runs when the flag is left out was in the source alone; and
    --max-sessions never said that 0 lifts the limit (and the thread pool's) altogether."""
    import argparse

    from kakeya.app.main import build_parser

    serve = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    roles = next(a for a in serve._actions if isinstance(a, argparse._SubParsersAction)).choices
    silent = []
    for role, parser in roles.items():
        defaulted = [a for a in parser._actions if a.default not in (None, False, argparse.SUPPRESS) and not a.choices]
        silent += [f"serve {role} {a.option_strings[0]}" for a in defaulted if "default" not in (a.help or "")]
        sessions = next(a for a in parser._actions if "--max-sessions" in a.option_strings)
        assert "0: no limit" in sessions.help, (role, sessions.help)
    assert silent == []


def test_a_second_ctrl_c_stops_serve_all_without_waiting_out_the_drain(server_factory):
    """Ctrl-C drains in-flight streams for --grace (here longer than the test); a second one stops the children at
    once, as a user pressing it twice means: the open stream ends short of its tokens, every child is gone."""
    s = server_factory("all-twice", ["all", "--grace", "600"]).start().wait_ready()  # the demo pair: a long stream
    pids = s.info["pids"]
    argv = ["client", "--addr", s.addr, "--retries", "1", "generate", "--max-tokens", "4000", "--ignore-eos", "--json"]
    stream = subprocess.Popen([sys.executable, "-m", "kakeya.app.main", *argv], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    wait_until(lambda: "generate: " in s.log(), what="the stream begun")
    s.signal(signal.SIGINT)
    wait_until(lambda: "orchestrator, then verifier" in s.log(), what="the first Ctrl-C taken")
    s.signal(signal.SIGINT)
    assert s.wait(120) == 0
    out, err = stream.communicate(timeout=120)
    assert stream.returncode != 0 or len(json.loads(out.strip().splitlines()[-1])["token_ids"]) < 4000, err
    wait_until(lambda: not any(pid_alive(p) for p in pids.values()), what="children gone")


def test_serve_all_takes_backend_for_both_children_as_every_serve_role_does():
    """The README calls `--backend` the default "of `generate` and every `serve` role"; a Mac user typed
    `kakeya serve all --backend mlx` and got "unrecognized arguments: --backend mlx", and the refusal of an
    MLX-quantized target on a torch child told them to "use --backend mlx". It is both children's backend;
    `--verifier-backend` / `--drafter-backend` still choose one each (no child is started: the argv alone)."""
    from kakeya.app.main import build_parser
    from kakeya.app.supervisor import child_backend

    def backends(*flags):
        try:
            args = build_parser().parse_args(["serve", "all", *flags])
        except SystemExit:
            pytest.fail(f"serve all refused {flags}")
        return [(argv := child_backend(args, role))[argv.index("--backend") + 1] for role in ("verifier", "drafter")]

    assert backends("--backend", "mlx") == ["mlx", "mlx"]
    assert backends("--backend", "mlx", "--drafter-backend", "torch") == ["mlx", "torch"]
    assert backends("--verifier-backend", "torch", "--backend", "mlx") == ["torch", "mlx"]
    assert backends("--backend", "torch", "--device", "cpu") == ["torch", "torch"]
