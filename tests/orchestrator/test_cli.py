"""The `kakeya` command as a user runs it: JSON output, lossless check, one-line errors."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kakeya.app.main import main
from kakeya.orchestrator.assembly import resolve_backend


def kakeya(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "kakeya.app.main", *args], capture_output=True, text=True, timeout=timeout
    )


def test_generate_json_on_the_embedded_models_is_lossless_and_names_the_resolved_backend():
    res = kakeya("generate", "--json", "--compare-ar", "--max-tokens", "120", "--block-size", "4", "--ignore-eos")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    for key in (
        "target",
        "draft",
        "prompt_token_ids",
        "token_ids",
        "text",
        "acceptance_lengths",
        "mean_acceptance",
        "decode_tok_s",
        "prefill_s",
        "ar_token_ids",
        "ar_decode_tok_s",
        "lossless",
        "quality",
        "verifier_kv_bytes",
    ):
        assert key in out, key
    assert out["lossless"] is True and out["token_ids"] == out["ar_token_ids"]
    assert len(out["token_ids"]) == 120 and out["finish_reason"] == "length"
    assert sum(out["acceptance_lengths"]) == 119 and max(out["acceptance_lengths"]) <= 4
    assert out["quality"]["degenerate"] is False
    # the JSON names the backend and device `auto` resolved to (a run of its own, 4 tokens, checked it for ~6 CPU-s)
    assert (out["backend"], out["device"]) == resolve_backend("auto")
    if out["backend"] == "torch":  # transformers' own generate on the same weights, 120 tokens, ignoring EOS too
        assert out["hf_identical"] is True and out["hf_token_ids"] == out["token_ids"]
        assert out["hf_decode_tok_s"] > 0 and out["speedup_over_hf"] > 0
    from kakeya.checkpoints.tiny import embedded_pair  # the trained demo pair when shipped

    assert out["target"] == str(embedded_pair().target) and out["draft"] == str(embedded_pair().draft)


def test_plain_output_streams_text_and_a_summary(capsys):
    assert main(["generate", "--max-tokens", "12", "--prompt", "x = 1"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() and "mean acceptance" in captured.err


@pytest.fixture
def bad_dirs(tmp_path, tiny_pair):
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    misfit = tmp_path / "misfit"
    shutil.copytree(tiny_pair.draft, misfit)
    cfg = json.loads((misfit / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [1, 40]
    (misfit / "config.json").write_text(json.dumps(cfg))
    return {"llama": str(llama), "misfit": str(misfit), "target": str(tiny_pair.target), "draft": str(tiny_pair.draft)}


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--target", "/no/such/dir", "--draft", "{draft}"], "/no/such/dir"),
        (["--target", "{llama}", "--draft", "{draft}"], "model_type"),
        (["--target", "{target}", "--draft", "{target}"], "dflash_config"),
        (["--target", "{target}", "--draft", "{misfit}"], "target_layer_ids"),
        (["--target", "{target}"], "--draft"),
        (["--block-size", "-1"], "--block-size"),
        (["--block-size", "17"], "--block-size"),
        (["--prompt", ""], "empty"),
        (["--max-tokens", "0"], "--max-tokens"),
        (["--temperature", "-1"], "temperature"),
        (["--temperature", "nan"], "temperature"),
        (["--temperature", "1e-39"], "temperature"),
        (["--temperature", "1", "--top-p", "0"], "--top-p"),
        (["--temperature", "1", "--top-k", "-2"], "--top-k"),
        (["--temperature", "1", "--min-p", "1.5"], "--min-p"),
        (["--backend", "torch", "--device", "cpu", "--compile"], "--compile applies to --device cuda"),
    ],
)
def test_bad_input_is_one_clear_line(bad_dirs, args, fragment, capsys):
    args = [a.format(**bad_dirs) for a in args]
    assert main(["generate", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kakeya: error:") and "\n" not in err and fragment in err, err


def test_sampled_generate_reports_its_seed_and_reproduces(tiny_pair, capsys):
    pair = ["--target", str(tiny_pair.target), "--draft", str(tiny_pair.draft), "--backend", "mlx"]
    args = [
        "generate",
        *pair,
        "--json",
        "--max-tokens",
        "24",
        "--block-size",
        "4",
        "--ignore-eos",
        "--sampling-rule",
        "rejection",
        "--temperature",
        "0.8",
        "--top-k",
        "40",
        "--top-p",
        "0.9",
        "--min-p",
        "0.01",
    ]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["sampling"] == {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "min_p": 0.01, "rule": "rejection"}
    assert isinstance(out["seed"], int) and len(out["token_ids"]) == 24
    assert main([*args, "--seed", str(out["seed"]), "--compare-ar"]) == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again["token_ids"] == out["token_ids"] and again["seed"] == out["seed"]
    assert "lossless" not in again and len(again["ar_token_ids"]) == 24  # rejection rule: AR sampling, speed only
    assert (
        main(
            [
                *args[: 1 + len(pair)],
                "--max-tokens",
                "4",
                "--temperature",
                "1",
                "--seed",
                "5",
                "--compare-ar",
                "--sampling-rule",
                "rejection",
            ]
        )
        == 0
    )
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "sampling seed 5, rejection rule" in line and "no token-identity claim" in line, line


def test_seeded_coupled_sampling_is_one_text_at_every_block_size_and_compare_ar_checks_it(capsys):
    """The issue's request on the demo pair: the default (auto), fixed sizes and AR give the same tokens."""
    args = ["generate", "--json", "--prompt", "x =", "--max-tokens", "64", "--temperature", "0.8", "--seed", "42"]
    runs = {}
    for block in (None, "0", "1", "8", "16"):
        assert main([*args, *(["--block-size", block] if block else [])]) == 0
        runs[block] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert runs[None]["sampling"]["rule"] == "coupled" and runs[None]["block_size"] == 0
    assert all(r["token_ids"] == runs["1"]["token_ids"] for r in runs.values())
    assert max(runs["8"]["block_sizes"]) == 8 and max(runs["16"]["block_sizes"]) == 16  # other schedules, same tokens
    assert main([*args, "--block-size", "8", "--compare-ar"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["lossless"] is True and out["ar_token_ids"] == out["token_ids"] == runs["1"]["token_ids"]
    assert (
        main(
            ["generate", "--prompt", "x =", "--max-tokens", "8", "--temperature", "0.8", "--seed", "42", "--compare-ar"]
        )
        == 0
    )
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "sampling seed 42, coupled rule" in line and "vs autoregressive sampling" in line and "lossless" in line, (
        line
    )


def test_a_rejection_rule_request_for_auto_runs_one_fixed_schedule(tiny_pair, capsys):
    pair = ["--target", str(tiny_pair.target), "--draft", str(tiny_pair.draft), "--backend", "mlx"]
    args = [
        "generate",
        *pair,
        "--json",
        "--max-tokens",
        "40",
        "--ignore-eos",
        "--temperature",
        "0.9",
        "--seed",
        "3",
        "--sampling-rule",
        "rejection",
    ]
    assert main(args) == 0
    auto = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main([*args, "--block-size", "8"]) == 0  # the tiny drafter's trained block size
    fixed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert auto["block_size"] == 8 and auto["block_sizes"] == fixed["block_sizes"] and auto["block_sizes"][0] == 8
    assert auto["token_ids"] == fixed["token_ids"]


def test_bad_input_from_the_real_command_has_no_traceback():
    res = kakeya("generate", "--block-size", "99")
    assert res.returncode == 2
    assert "Traceback" not in res.stderr and res.stderr.startswith("kakeya: error:")


def test_make_tiny_writes_a_loadable_pair(tmp_path):
    assert main(["make-tiny", "--out", str(tmp_path / "p"), "--seed", "3", "--sliding-window", "16"]) == 0
    assert (
        main(
            [
                "generate",
                "--target",
                str(tmp_path / "p/target"),
                "--draft",
                str(tmp_path / "p/draft"),
                "--max-tokens",
                "5",
            ]
        )
        == 0
    )


def test_generate_on_the_torch_backend_is_lossless_and_matches_mlx():
    runs = {}
    for backend in ("mlx", "torch"):
        res = kakeya(
            "generate",
            "--backend",
            backend,
            "--json",
            "--compare-ar",
            "--max-tokens",
            "60",
            "--block-size",
            "8",
            "--ignore-eos",
        )
        assert res.returncode == 0, res.stderr
        runs[backend] = json.loads(res.stdout.strip().splitlines()[-1])
        assert runs[backend]["lossless"] is True
    assert runs["torch"]["backend"] == "torch"
    assert runs["torch"]["token_ids"] == runs["mlx"]["token_ids"]


def test_device_flags_need_the_torch_backend(capsys):
    assert main(["generate", "--backend", "mlx", "--dtype", "bfloat16", "--max-tokens", "2"]) == 2
    assert "--backend torch" in capsys.readouterr().err


def test_the_first_run_says_what_was_compared():
    """The README's first command: default backend, default prompt, one summary line that names both sides."""
    res = kakeya("generate", "--compare-ar")
    assert res.returncode == 0, res.stderr
    line = res.stderr.strip().splitlines()[-1]
    backend, device = resolve_backend("auto")  # torch/cpu on a Linux CPU, mlx on Apple silicon
    where = backend + (f"/{device}" if device else "")
    assert line.startswith("speculative (DFlash, auto blocks, mean "), line
    assert f", {where}): " in line, line
    assert " tok/s vs autoregressive " in line and "x, lossless (128/128 tokens identical)" in line, line
    if backend == "torch":  # the independent baseline: transformers' own generate on the same weights
        assert "; vs transformers' generate " in line and "x, the same tokens; " in line, line
    assert "runaway repetition" not in line and res.stdout.strip()


def test_policy_block_size_limits_are_checked_up_front(tiny_pair, capsys):
    args = [
        "generate",
        "--cache",
        "sink-window",
        "--sink",
        "2",
        "--window",
        "4",
        "--block-size",
        "8",
        "--max-tokens",
        "4",
    ]
    assert main([*args, "--restore", "/no/such/ftheta"]) == 2
    assert "restoring window" in capsys.readouterr().err


@pytest.mark.parametrize("role", ["verifier", "drafter", "orchestrator"])
@pytest.mark.parametrize("flag", [["--compile"], ["--cuda-graphs", "on"], ["--graphed-min-batch", "4"]])
def test_mlx_servers_refuse_torch_only_flags_by_name(role, flag, capsys, monkeypatch):
    """deploy/mac/run.sh hands its extra flags to a colocated MLX orchestrator: a torch-only one is refused
    by its name before loading, never dropped."""
    monkeypatch.setattr("kakeya.app.serve._run", lambda spec, args: 0)  # a server that got this far started
    assert main(["serve", role, "--backend", "mlx", *flag, "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert f"{flag[0]}: for --backend torch only" in err, err


@pytest.mark.parametrize("flag", [["--device", "cuda"], ["--dtype", "bfloat16"]])
def test_serve_all_refuses_torch_flags_when_no_child_runs_torch(flag, capsys, monkeypatch):
    monkeypatch.setattr("kakeya.app.supervisor.Supervisor", None)  # starting the children fails the test
    monkeypatch.setattr("signal.signal", lambda *a: None)
    both_mlx = ["--verifier-backend", "mlx", "--drafter-backend", "mlx", "--port", "0"]
    assert main(["serve", "all", *both_mlx, *flag]) == 2
    err = capsys.readouterr().err
    assert f"{flag[0]}: for --backend torch only" in err, err


MODELS = Path(__file__).resolve().parents[2] / "services" / "models"


@pytest.mark.parametrize(
    "pair, says",
    [
        (["/no/such/target", "/no/such/draft"], "/no/such/target: directory does not exist"),
        ([MODELS / "demo" / "target", MODELS / "tiny" / "draft"], "field 'hidden_size' is 64"),  # the target's: 128
    ],
)
def test_serve_all_refuses_a_pair_that_cannot_load_before_starting_children(pair, says, capsys, monkeypatch):
    """A missing checkpoint or a drafter that does not fit: the verifier child printed its error and exited 2, then
    serve all printed a second line ("verifier exited with status 2 before it was ready") and exited 1."""
    monkeypatch.setattr("kakeya.app.supervisor.Supervisor", None)  # starting the children fails the test
    monkeypatch.setattr("signal.signal", lambda *a: None)
    argv = ["serve", "all", "--port", "0", "--target", str(pair[0]), "--draft", str(pair[1])]
    assert main([*argv, "--verifier-backend", "mlx", "--drafter-backend", "mlx"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kakeya: error:") and "\n" not in err and says in err, err


def test_a_path_that_cannot_be_written_is_one_error_line(tmp_path, capsys):
    """`make-tiny --out FILE` (a file where a directory goes) ended in a NotADirectoryError traceback."""
    (tmp_path / "a_file").write_text("")
    assert main(["make-tiny", "--out", str(tmp_path / "a_file")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kakeya: error:") and "\n" not in err and "a_file" in err, err


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--addr", "", "generate"], "--addr"),  # was: ZeroDivisionError: integer modulo by zero
        (["--addr", " , ", "generate"], "--addr"),
        (["--timeout", "0", "generate"], "--timeout"),  # was: DEADLINE_EXCEEDED, the call failed at once
        (["--timeout", "-1", "info"], "--timeout"),
    ],
)
def test_the_client_refuses_an_address_list_or_deadline_it_cannot_use(argv, named, capsys):
    assert main(["client", "--retries", "1", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"kakeya: error: {named}") and "\n" not in err, err


@pytest.mark.parametrize("command", [["generate"], ["serve", "verifier", "--port", "0"]])
def test_a_negative_torch_threads_is_refused_by_name(command, capsys, monkeypatch):
    """`--torch-threads -1` ran on torch's default team (every core: 6 tok/s on the shared 2-core VM, 186 with 1), the
    value silently read as 0."""
    monkeypatch.setattr("kakeya.app.serve._run", lambda spec, args: 0)  # a server that got this far started
    assert main([*command, "--backend", "torch", "--device", "cpu", "--torch-threads", "-1"]) == 2
    assert "--torch-threads" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["generate"], ["serve", "drafter", "--port", "0"]])
def test_an_unknown_device_is_refused_by_name(command, capsys, monkeypatch):
    """`--device nope` ended in torch's RuntimeError traceback ("Expected one of cpu, cuda, ipu, xpu, ...")."""
    monkeypatch.setattr("kakeya.app.serve._run", lambda spec, args: 0)  # a server that got this far started
    assert main([*command, "--backend", "torch", "--device", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kakeya: error: --device") and "\n" not in err, err


def test_ctrl_c_while_the_commands_load_exits_130_without_a_traceback(monkeypatch):
    """Building the parser imports every sub-command's module (half a second here): a Ctrl-C then printed a
    KeyboardInterrupt traceback, where one a moment later exits 130 quietly."""

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr("kakeya.app.main.build_parser", interrupted)
    try:
        rc = main(["generate"])
    except KeyboardInterrupt:  # what reached the interpreter: its traceback (caught here, or it stops pytest)
        rc = "traceback"
    assert rc == 130


@pytest.mark.parametrize("flags, named", [(["--window", "0"], "--window"), (["--sink", "-3"], "--sink")])
def test_memory_names_the_cache_flag_it_refuses(flags, named, capsys):
    """`kakeya memory --window 0` said "cache_policy.window: ...", a field of the gRPC API, not the flag typed."""
    assert main(["memory", "--preset", "gemma-4-26b-a4b", "--context", "4096", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kakeya: error: --") and named in err and "cache_policy" not in err, err


def test_generate_names_the_torch_only_flag_it_refuses(capsys):
    assert main(["generate", "--backend", "mlx", "--graphed-min-batch", "4", "--max-tokens", "2"]) == 2
    assert "--graphed-min-batch: for --backend torch only" in capsys.readouterr().err


@pytest.mark.parametrize("role", ["verifier", "drafter"])
def test_servers_refuse_compile_on_a_cpu_before_loading(role, capsys):
    """--compile is for CUDA (on a CPU the compiled attention recompiles until torch gives up, blocks in)."""
    assert main(["serve", role, "--backend", "torch", "--device", "cpu", "--compile", "--port", "0"]) == 2
    assert "--compile applies to --device cuda, not cpu" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--draft", "/d"], "it needs --target"),  # the in-process drafter shares the target's embeddings and head
        (["--draft", "/d", "--target", "/t", "--drafter", "localhost:1"], "neither --drafter nor --no-drafter"),
        (["--draft", "/d", "--target", "/t", "--no-drafter"], "neither --drafter nor --no-drafter"),
        (["--target", "/t"], "give --draft too"),
    ],
)
def test_a_split_orchestrator_refuses_an_in_process_drafter_it_cannot_load(flags, says, capsys):
    """``--verifier`` with ``--draft``: the drafter in this process; the flags that contradict it are refused by name
    before anything loads or connects."""
    assert main(["serve", "orchestrator", "--verifier", "localhost:1", "--port", "0", *flags]) == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags",
    [["--cache", "sink-window"], ["--window", "64"], ["--sink", "8"], ["--full-kv-bits", "8"], ["--restore", "d"]],
)
def test_a_split_orchestrator_refuses_the_verifiers_cache_policy_flags(flags):
    """The sessions' default policy is the verifier's (its own --cache & co.): a split orchestrator went SERVING with
    them, its sessions under whatever the verifier had, the flags silently dropped."""
    argv = ["serve", "orchestrator", "--verifier", "localhost:1", "--no-drafter", "--backend-wait", "0", "--port", "0"]
    cmd = [sys.executable, "-m", "kakeya.app.main", *argv, *flags]  # a server that starts ends its process: not ours
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and f"{flags[0]} is the verifier's" in out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize(
    "split, flags",
    [(True, ["--device", "cpu"]), (True, ["--dtype", "bfloat16"]), (True, ["--backend", "torch"]),
     (True, ["--torch-threads", "2"]), (True, ["--compile"]), (True, ["--cuda-graphs", "off"]),
     (False, ["--tokenizer", "/t"]), (False, ["--backend-wait", "5"])],
)  # fmt: skip
def test_an_orchestrator_refuses_the_flags_its_layout_has_no_use_for(split, flags):
    """Split with no model here (no ``--draft``), the backend's flags went nowhere; colocated, the split's
    ``--tokenizer`` and ``--backend-wait`` did: each started SERVING with the flag dropped. Refused by name now."""
    where = ["--verifier", "localhost:1", "--no-drafter", "--backend-wait", "0"] if split else []
    cmd = [sys.executable, "-m", "kakeya.app.main", "serve", "orchestrator", *where, "--port", "0", *flags]
    try:  # a server that starts (the flag dropped) serves until the timeout: in a process of its own
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{flags[0]}: the orchestrator started serving with it")
    assert out.returncode == 2 and flags[0] in out.stderr, out.stderr[-2000:]


def test_a_16_bit_mismatch_says_why_and_a_float32_one_does_not():
    from kakeya.app.options import summary_line

    out = {"backend": "torch", "device": "cpu", "block_size": 8, "block_sizes": [8], "decode_tok_s": 200.0,
           "token_ids": [1, 2, 3, 9], "ar_token_ids": [1, 2, 3, 4], "ar_decode_tok_s": 150.0, "lossless": False,
           "speedup": 1.33, "finish_reason": "length", "mean_acceptance": 2.0, "prefill_s": 0.01,
           "drafter_fallback": False, "quality": {"degenerate": False}}  # fmt: skip
    assert "NOT lossless (first 3 of 4 tokens identical)" in summary_line(out)
    assert "near-ties" not in summary_line(out)  # float32 (no dtype given): a real mismatch, no excuse offered
    assert "bfloat16 rounds near-ties apart" in summary_line(out | {"dtype": "bfloat16"})
    assert "near-ties" not in summary_line(out | {"dtype": "bfloat16", "lossless": True, "ar_token_ids": [1, 2, 3, 9]})


def test_transformers_baseline_runs_where_it_measures_the_same_thing_and_says_when_it_cannot(monkeypatch):
    """Only torch on a CPU, float32, greedy, native cache, no constraint gets transformers' generate beside it;
    without transformers installed the JSON says it was not run rather than failing the command."""
    import importlib.util
    from types import SimpleNamespace as NS

    from kakeya.app.main import _compare_transformers

    engine = NS(verifier=NS(info=NS(backend="torch")), device="cpu")
    req = NS(cache_policy=None, sampling=NS(greedy=True), constraint=None)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "transformers" else find_spec(n, *a))
    assert _compare_transformers(engine, req, None, NS(dtype=None)) == {
        "hf_reference": "not run: transformers is not installed"
    }
    for other in (
        (NS(verifier=NS(info=NS(backend="mlx")), device=None), req, NS(dtype=None)),
        (NS(verifier=NS(info=NS(backend="torch")), device="cuda"), req, NS(dtype=None)),
        (engine, req, NS(dtype="bfloat16")),
        (engine, NS(cache_policy=None, sampling=NS(greedy=False), constraint=None), NS(dtype=None)),
        (engine, NS(cache_policy=None, sampling=NS(greedy=True), constraint=object()), NS(dtype=None)),
    ):
        assert _compare_transformers(other[0], other[1], None, other[2]) == {}


def test_generate_refuses_logprobs_it_would_not_show(capsys):
    """The logprobs are listed in the JSON only: without --json the run computed them and printed the text and the
    summary line, the flag silently without effect."""
    assert main(["generate", "--backend", "mlx", "--max-tokens", "2", "--logprobs", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kakeya: error: --logprobs") and "--json" in err, err


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--cache", "native", "--window", "16"], "--window"),
        (["--cache", "native", "--sink", "8"], "--sink"),
        (["--cache", "sink-window", "--window", "0"], "--window"),
        (["--cache", "sink-window", "--sink", "-1"], "--sink"),
    ],
)
def test_generate_refuses_a_cache_flag_by_its_name(flags, named, capsys):
    """`--cache native --window 16` ran the model's own window with the flag dropped; the policy's own refusals
    named --cache for a --window or --sink the user typed."""
    assert main(["generate", "--backend", "mlx", "--max-tokens", "2", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"kakeya: error: {named}") and "\n" not in err, err


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "all", "--metrics", "9090"],  # not --metrics-port 9090 (`serve all --backend` is now its own flag)
        ["serve", "orchestrator", "--max-tokens", "64"],  # was --max-tokens-limit 64, not a default
        ["serve", "all", "--verifier", "localhost:1"],  # was --verifier-backend's "invalid choice"
        ["memory", "--context", "64", "--restore", "d"],  # was --restore-rank's "invalid int value"
    ],
)
def test_a_flag_another_command_has_is_not_read_as_a_longer_one(argv, capsys):
    """`serve all --backend mlx` (serve all has --verifier-backend and --drafter-backend) failed as "argument
    --backend-timeout: invalid float value: 'mlx'", and `--backend 5` ran with a 5 s backend timeout."""
    from kakeya.app.main import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    assert f"unrecognized arguments: {' '.join(argv[-2:])}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--temperature", "1", "--top-p", "0"], "--top-p"),
        (["--chat", "--prompt-ids", "2,3"], "--chat"),
        (["--temperature", "1", "--seed", str(2**64)], "--seed"),
        (["--cache", "sink-window", "--window", "0"], "--window"),  # wire 0: unset
        (["--sink", "8"], "--sink"),  # no --cache: the server's policy
        (["--cache", "native", "--window", "16"], "--window"),
        (["--max-tokens", "0"], "--max-tokens"),  # wire 0: the default
        (["--block-size", "17"], "--block-size"),
        (["--logprobs", "3"], "--logprobs"),  # no --json: nowhere to list them
        # float32 on the wire: top_p 1e-50 reads as 0, which is off (the full distribution, not the top token)
        (["--temperature", "1", "--top-p", "1e-50"], "--top-p"),
        (["--temperature", "1", "--min-p", "1e-50"], "--min-p"),
        (["--temperature", "1e40"], "--temperature"),  # inf, refused as the wire's
        # int32 on the wire: protobuf's "Value out of range: 3000000000" named no flag
        (["--temperature", "1", "--top-k", "3000000000"], "--top-k"),
        (["--max-tokens", "99999999999"], "--max-tokens"),
    ],
)
def test_client_generate_refuses_what_it_would_silently_drop(args, fragment, capsys):
    """`kakeya client generate` takes "the same options as `kakeya generate`": a value generate refuses (--top-p 0,
    README: "top_p outside (0, 1]" is refused) or a flag it cannot apply (--chat with token ids, which no template
    renders) is refused before connecting, in one line naming it -- not run as top_p 1 or as a plain prompt. (No
    server listens on port 1: a request that got through fails to connect, exit 1.)"""
    assert main(["client", "--addr", "127.0.0.1:1", "--retries", "0", "--timeout", "5", "generate", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kakeya: error:") and "\n" not in err and fragment in err, err


def test_prompt_dash_reads_standard_input():
    """`echo TEXT | kakeya generate --prompt -` generates from TEXT, as `--prompt TEXT` does."""
    text = "def add(a, b):\n"
    argv = [sys.executable, "-m", "kakeya.app.main", "generate", "--max-tokens", "4", "--json", "--prompt"]
    piped = subprocess.run([*argv, "-"], input=text, capture_output=True, text=True, timeout=300)
    given = subprocess.run([*argv, text], capture_output=True, text=True, timeout=300)
    assert piped.returncode == given.returncode == 0, piped.stderr + given.stderr
    piped_out, given_out = (json.loads(r.stdout.strip().splitlines()[-1]) for r in (piped, given))
    assert piped_out["prompt_token_ids"] == given_out["prompt_token_ids"]
    assert piped_out["token_ids"] == given_out["token_ids"]


@pytest.mark.parametrize("argv_prompt, stdin", [(b"abc\xff\xfe", b""), (b"-", b"abc\xff\xfe")])
def test_a_prompt_that_is_not_utf8_is_one_clear_line(argv_prompt, stdin):
    argv = [sys.executable.encode(), b"-m", b"kakeya.app.main", b"generate", b"--max-tokens", b"2", b"--prompt"]
    r = subprocess.run([*argv, argv_prompt], input=stdin, capture_output=True, timeout=300)
    err = r.stderr.decode(errors="replace").strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr.decode(errors="replace"), err
    assert "--prompt" in err[-1] and "UTF-8" in err[-1], err


def test_generate_takes_a_prompt_up_to_the_models_context_and_names_no_server_flag(capsys, monkeypatch):
    """`kakeya generate` is no server: its prompt may fill the model's context, and one that overflows it is refused
    by that context, not by `serve`'s --max-prompt-tokens (a flag this command has not)."""
    from kakeya.runtime import bounds

    monkeypatch.setattr(bounds, "DEFAULT_MAX_PROMPT_TOKENS", 64)  # serve's default cap (8192), made cheap to pass
    assert main(["generate", "--prompt", "x = 1\n" * 40, "--max-tokens", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(out["prompt_token_ids"]) > 64 and len(out["token_ids"]) == 1
    assert main(["generate", "--prompt", "x = 1\n" * 200_000, "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kakeya: error: --prompt:") and "context" in err and "--max-prompt-tokens" not in err, err


def test_every_flag_of_the_commands_a_user_runs_says_what_it_does():
    """`kakeya CMD --help` explains each flag of generate, serve, client and the tools a user runs (the train-*
    hyper-parameters are the report's open item); a flag with a default that is not off names it."""
    import argparse

    from kakeya.app.main import build_parser

    def flags(parser, path):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    if not name.startswith("train-"):
                        yield from flags(sub, [*path, name])
            elif action.option_strings and action.dest != "help":
                yield " ".join([*path, action.option_strings[0]]), action

    silent = [name for name, action in flags(build_parser(), ["kakeya"]) if not action.help]
    assert silent == [], silent
    helps = dict(flags(build_parser(), ["kakeya"]))
    for name in ("kakeya generate --max-tokens", "kakeya client --retries", "kakeya client --timeout"):
        assert "default" in helps[name].help, name
