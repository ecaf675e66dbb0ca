"""Engine assembly: backend choice, torch threads, the layering, and a node without MLX."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kakeya.orchestrator.assembly import resolve_backend, torch_threads

ROOT = Path(__file__).resolve().parents[2]


def has(*names):
    return lambda name: name in names


@pytest.mark.parametrize(
    "system,machine,installed,cuda,expected",
    [
        ("darwin", "arm64", ("mlx", "torch"), False, ("mlx", None)),  # Apple silicon: Metal through MLX
        ("linux", "x86_64", ("mlx", "torch"), False, ("torch", "cpu")),  # MLX on a Linux CPU is the slow one
        ("linux", "x86_64", ("mlx", "torch"), True, ("torch", "cuda")),
        ("linux", "aarch64", ("torch",), False, ("torch", "cpu")),
        ("darwin", "x86_64", ("mlx", "torch"), False, ("torch", "cpu")),  # an Intel Mac has no Metal MLX
        ("darwin", "arm64", ("torch",), False, ("torch", "cpu")),  # only what is installed
        ("linux", "x86_64", ("mlx",), False, ("mlx", None)),
    ],
)
def test_auto_picks_the_fastest_installed_backend(system, machine, installed, cuda, expected):
    got = resolve_backend(
        "auto", system=system, machine=machine, installed=has(*installed), cuda_available=lambda: cuda
    )
    assert got == expected


def test_explicit_choices_are_kept():
    never = lambda: pytest.fail("an explicit device must not probe CUDA")
    assert resolve_backend("torch", "cuda:1", cuda_available=never) == ("torch", "cuda:1")
    assert resolve_backend("torch", cuda_available=lambda: False) == ("torch", "cpu")
    assert resolve_backend("mlx", system="linux", installed=has()) == ("mlx", None)  # missing: said at load time
    assert resolve_backend("auto", "cpu", system="linux", machine="x86_64", installed=has("torch")) == ("torch", "cpu")


@pytest.mark.parametrize(
    "backend,device,fragment",
    [("metal", None, "unknown backend"), ("mlx", "cuda", "--device"), ("auto", None, "no backend installed")],
)
def test_bad_choices_raise_value_error(backend, device, fragment):
    with pytest.raises(ValueError, match=fragment):
        resolve_backend(backend, device, system="linux", machine="x86_64", installed=has())


def test_torch_threads_default_to_one_only_for_the_embedded_pair_on_cpu(monkeypatch):
    from kakeya.orchestrator import assembly

    monkeypatch.setattr(assembly.os, "cpu_count", lambda: 8)
    monkeypatch.setattr(assembly, "usable_cpus", lambda: 8)
    assert torch_threads(None, "cpu", embedded=True) == 1
    assert torch_threads(None, "cuda", embedded=True) == 0
    assert torch_threads(None, "cpu", embedded=False) == 0  # a real model: torch's own default
    assert torch_threads(4, "cpu", embedded=True) == 4
    assert torch_threads(0, "cpu", embedded=True) == 0
    monkeypatch.setattr(assembly, "usable_cpus", lambda: 3)  # pinned (`serve all --cpus`, a cpuset): its CPUs
    assert torch_threads(None, "cpu", embedded=False) == 3
    assert torch_threads(None, "cuda", embedded=False) == 0 and torch_threads(None, "cpu", embedded=True) == 1


# --------------------------------------------------------------------------- the layering

CLI_LAYER = {"cli", "cli_args", "serve", "client"}


def imports_of(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-level imports included), as dotted names."""
    pkg = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}
    return out


def test_cli_only_parses_and_prints():
    tree = ast.parse((ROOT / "services/app/main.py").read_text())
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert "build_local_engine" not in defined and "UsageError" not in defined
    assert "kakeya.orchestrator.assembly" in imports_of(ROOT / "services/app/main.py")


def test_nothing_below_the_cli_imports_it():
    """cli -> serve/client -> cli_args -> assembly -> engine...; never back up (no cycle through the CLI)."""
    cli_layer = {f"kakeya.orchestrator.{m}" for m in CLI_LAYER}
    allowed = {  # who may import which CLI-layer module
        "kakeya.app.main": cli_layer,
        "kakeya.app.serve": {"kakeya.app.options"},
        "kakeya.app.client": {"kakeya.app.options", "kakeya.app.serve"},
    }
    offenders = []
    for path in sorted((ROOT / "services").rglob("*.py")):
        mod = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        bad = (imports_of(path) & cli_layer) - allowed.get(mod, set()) - {mod}
        if bad:
            offenders.append(f"{mod} imports {sorted(bad)}")
    assert not offenders, offenders
    assembly = imports_of(ROOT / "services/orchestrator/assembly.py")
    assert not {m for m in assembly if m.startswith(("kakeya.training", "benchmarks"))}


# --------------------------------------------------------------------------- a node without MLX

NO_MLX = """
import runpy, sys

class NoMLX:
    def find_spec(self, name, path=None, target=None):
        if name == "mlx" or name.startswith(("mlx.", "mlx_lm")):
            raise ImportError(f"{name} is blocked in this test")

sys.meta_path.insert(0, NoMLX())
# As on a node without MLX, importlib.util.find_spec("mlx") answers None (transformers asks it that way when
# --compare-ar loads its baseline) while an import still fails.
sys.modules.update({"mlx": None, "mlx_lm": None})
sys.argv = ["kakeya", *sys.argv[1:]]
try:
    runpy.run_module("kakeya.app.main", run_name="__main__")
finally:
    assert not [m for m, mod in sys.modules.items() if mod is not None and (m == "mlx" or m.startswith(("mlx.", "mlx_lm")))]
"""


def kakeya_without_mlx(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-c", NO_MLX, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def test_the_parser_needs_neither_backend():
    code = (
        "import sys; from kakeya.app.main import build_parser; build_parser(); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm', 'torch')))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"
    res = kakeya_without_mlx("--help")
    assert res.returncode == 0 and "generate" in res.stdout and "train-ftheta" in res.stdout, res.stderr


def test_torch_generate_runs_without_mlx():
    res = kakeya_without_mlx("generate", "--backend", "torch", "--json", "--compare-ar", "--max-tokens", "12")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["backend"] == "torch" and out["lossless"] is True and len(out["token_ids"]) == 12
    assert out["hf_identical"] is True  # transformers' baseline needs no MLX either


@pytest.mark.parametrize(
    "args",
    [
        ["generate", "--backend", "mlx", "--max-tokens", "2"],
        ["train-ftheta", "--out", "/tmp/kakeya-never-written", "--steps", "1"],
    ],
)
def test_an_mlx_command_without_mlx_is_one_clear_line(args):
    res = kakeya_without_mlx(*args)
    assert res.returncode == 2, res.stderr
    err = res.stderr.strip()
    assert err.startswith("kakeya: error:") and "\n" not in err and "needs MLX" in err, err


# `serve all` starts its services as child processes: the blocker goes in a sitecustomize on their PYTHONPATH
NO_MLX_SITE = """
import sys

class NoMLX:
    def find_spec(self, name, path=None, target=None):
        if name == "mlx" or name.startswith(("mlx.", "mlx_lm")):
            raise ImportError(f"{name} is blocked in this test")

sys.meta_path.insert(0, NoMLX())
"""


def _env_without_mlx(tmp_path):
    import os

    site = tmp_path / "nomlx"
    site.mkdir()
    (site / "sitecustomize.py").write_text(NO_MLX_SITE)
    inherited = [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), *inherited]))


def test_memory_runs_without_mlx():
    res = kakeya_without_mlx("memory", "--preset", "gemma-4-26b-a4b", "--context", "4096", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)


def test_torch_serve_all_and_client_run_without_mlx(tmp_path):
    import signal
    import time

    env = _env_without_mlx(tmp_path)
    ready = tmp_path / "ready.json"
    cli = [sys.executable, "-m", "kakeya.app.main"]
    probe = subprocess.run([sys.executable, "-c", "import mlx"], env=env, capture_output=True, text=True)
    assert probe.returncode != 0 and "blocked" in probe.stderr  # the blocker reaches every child process
    proc = subprocess.Popen(
        [
            *cli,
            "serve",
            "all",
            "--port",
            "0",
            "--verifier-backend",
            "torch",
            "--drafter-backend",
            "torch",
            "--ready-file",
            str(ready),
        ],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "serve.log").open("w"),
    )  # a file: a full pipe would block the children
    try:
        deadline = time.time() + 240
        while not ready.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.5)
        assert ready.exists(), (tmp_path / "serve.log").read_text()[-2000:]
        addr = json.loads(ready.read_text())["addr"]
        res = subprocess.run(
            [*cli, "client", "--addr", addr, "generate", "--json", "--max-tokens", "8"],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert res.returncode == 0, res.stderr
        assert len(json.loads(res.stdout.strip().splitlines()[-1])["token_ids"]) == 8
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    log = (tmp_path / "serve.log").read_text()
    assert rc == 0, log[-2000:]
    assert "blocked" not in log  # no child tried to import MLX


def test_an_explicit_mlx_backend_refuses_a_device_by_name():
    """`kakeya generate --backend mlx --device cpu` on a Mac ran MLX on its default device, the GPU: the flag
    was accepted and ignored, where `--device mps`, `--dtype` and `--compile` are refused by name."""
    with pytest.raises(ValueError, match="--device"):
        resolve_backend("mlx", "cpu", system="darwin", machine="arm64", installed=has("mlx"))
    assert resolve_backend("mlx", system="darwin", machine="arm64", installed=has("mlx")) == ("mlx", None)
