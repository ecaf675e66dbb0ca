"""The Dockerfile's invariants, checked without Docker (none here): parsed, not built.

Non-root user, no weights copied in, every pip install pinned by constraints.txt (which pins what
the tests ran against), the CUDA image without MLX, and an ENTRYPOINT + CMD that the real
``kakeya`` parser accepts.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import json
import re
import shlex
import tomllib

import pytest

from kakeya.app.main import build_parser

from .manifests import DOCKER, ROOT, dockerfile_stages, inherited, lineage

TARGETS = ("cpu", "cuda")  # the images the manifests use: kakeya:<version>-<target>
STAGES = dockerfile_stages()
CONSTRAINTS = DOCKER / "constraints.txt"


def exec_form(text: str) -> list[str]:
    value = json.loads(text)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), f"not exec form: {text}"
    return value


def pins() -> dict[str, str]:
    out = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)==([A-Za-z0-9_.!]+)", line)
        assert m, f"constraints.txt: not an exact pin: {line!r}"
        out[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = m.group(2)
    return out


def test_targets_exist_and_run_as_non_root():
    for t in TARGETS:
        assert t in STAGES, f"no `FROM ... AS {t}` stage"
        user = inherited(STAGES, t, "USER")
        assert user, f"{t}: no USER (would run as root)"
        uid = user.split(":")[0]
        assert uid.isdigit() and int(uid) != 0, (
            f"{t}: USER {user!r} must be a numeric non-root uid (runAsNonRoot checks it)"
        )


def test_no_weights_copied_in():
    for st in STAGES.values():
        for instr, rest in st.instructions:
            if instr in ("COPY", "ADD"):
                assert instr == "COPY", "ADD can fetch URLs and unpack archives: use COPY"
                srcs = [w for w in shlex.split(rest) if not w.startswith("--")][:-1]
                for src in srcs:
                    assert not re.search(r"(^|/)models?(/|$)|\.(safetensors|bin|gguf|pt|pth|npz)$", src), (
                        f"{st.name}: COPY {src}"
                    )
    # `COPY services` brings the package, whose only weights in the image are the embedded tiny/demo pairs:
    # the recall pair (benchmarks and tests of the bounded cache) stays out of the build context.
    ignore = [
        ln.strip()
        for ln in (DOCKER / "Dockerfile.dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    assert ignore[0] == "*", "the build context must start from nothing (`*`), then name what the image needs"
    models = ROOT / "services" / "models"
    pairs = sorted(p.name for p in models.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert pairs == ["demo", "recall", "tiny"], pairs
    shipped = {
        f.relative_to(models).parts[0]: f
        for f in models.rglob("*")
        if f.is_file()
        and f.parent != models
        and "__pycache__" not in f.parts
        and not _dockerignored(f.relative_to(ROOT).as_posix(), ignore)
    }
    assert sorted(shipped) == ["demo", "tiny"], sorted(shipped)
    size = sum(f.stat().st_size for p in shipped for f in (models / p).rglob("*") if f.is_file())
    assert size < 32 * 2**20, f"embedded pairs are {size / 2**20:.0f} MiB: real weights belong on a volume"
    assert not any(ln.startswith("!") and "models" in ln for ln in ignore)


def test_every_pip_install_is_constrained():
    copied = [
        rest for st in STAGES.values() for i, rest in st.instructions if i == "COPY" and "constraints.txt" in rest
    ]
    assert copied and shlex.split(copied[0])[0] == "deploy/docker/constraints.txt"
    dest = shlex.split(copied[0])[-1]
    runs = [
        (st.name, rest) for st in STAGES.values() for i, rest in st.instructions if i == "RUN" and "pip install" in rest
    ]
    assert len(runs) >= 3
    for name, cmd in runs:
        for part in cmd.split("pip install")[1:]:
            assert f"-c {dest}" in part.split("&&")[0], f"{name}: a pip install without -c {dest}: {cmd}"


def test_constraints_pin_what_the_tests_ran_against():
    """The image installs the versions this suite ran with (lock.sh regenerates the file)."""
    pinned = pins()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = (
        project["dependencies"] + project["optional-dependencies"]["mlx"] + project["optional-dependencies"]["torch"]
    )
    names = {re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.-]+", r).group(0)).lower() for r in runtime}
    for name in sorted(names | {"pip", "setuptools"}):
        assert name in pinned, f"{name} is not pinned in constraints.txt (run deploy/docker/lock.sh)"
        installed = importlib.metadata.version(name).split("+")[0]
        assert pinned[name] == installed, (
            f"{name}: constraints.txt pins {pinned[name]}, the tests ran {installed} (lock.sh)"
        )


def test_cuda_image_is_torch_only_and_cpu_image_has_no_torch():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]

    def installs(stage: str) -> str:
        return " ".join(
            rest for st in [STAGES[stage]] for i, rest in st.instructions if i == "RUN" and "pip install" in rest
        )

    cuda_build = next(s.name for s in STAGES.values() if s.name == "build-cuda")
    assert '".[torch]"' in installs(cuda_build) and "mlx" not in installs(cuda_build).replace("import mlx", "")
    assert not any("mlx" in r for r in extras["torch"])
    assert "import mlx" in installs(cuda_build), "the CUDA build should prove MLX is absent"
    assert '".[mlx]"' in installs("build-cpu") and "torch" not in installs("build-cpu")
    copies = {t: [rest for i, rest in STAGES[t].instructions if i == "COPY" and "--from=" in rest] for t in TARGETS}
    assert any("--from=build-cuda" in c for c in copies["cuda"]) and not any("build-cpu" in c for c in copies["cuda"])
    assert any("--from=build-cpu" in c for c in copies["cpu"]) and not any("build-cuda" in c for c in copies["cpu"])


def test_the_cuda_image_has_the_c_compiler_triton_builds_its_launcher_with(monkeypatch):
    """On CUDA the torch servers' batched steps attend through a Triton kernel (``ops.attention_kernel_wanted``: on by
    default there), and Triton builds its CUDA driver module from C source, with gcc or clang (or $CC), the first time
    a process launches a kernel. python:3.11-slim has neither: a pod's first batched step (several sessions' steps
    queued together: under load) raised "Failed to find C compiler", failing the requests in that batch."""
    import triton.backends.nvidia.driver as nvidia
    from triton.runtime import build

    # the premise, read from the installed Triton: its CUDA driver compiles C, and with no compiler that fails
    assert "compile_module_from_file" in inspect.getsource(nvidia.CudaUtils.__init__)
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    build._find_compiler.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="C compiler"):
            build._find_compiler("c")
    finally:
        build._find_compiler.cache_clear()
    # the image: a compiler, and libc's development files that linking a shared object needs, in the cuda target
    runs = " ".join(rest for st in lineage(STAGES, "cuda") for i, rest in st.instructions if i == "RUN")
    assert re.search(r"apt-get install [^&]*\bgcc\b", runs) and re.search(r"apt-get install [^&]*\blibc6-dev\b", runs)
    assert not re.search(r"apt-get install [^&]*\b(gcc|libc6-dev)\b", " ".join(
        rest for st in lineage(STAGES, "cpu") for i, rest in st.instructions if i == "RUN"
    )), "the cpu image runs no Triton: it stays slim"  # fmt: skip


@pytest.mark.parametrize("target", TARGETS)
def test_entrypoint_and_cmd_are_a_real_kakeya_serve_command(target):
    entry = exec_form(inherited(STAGES, target, "ENTRYPOINT"))
    cmd = exec_form(inherited(STAGES, target, "CMD"))
    assert entry == ["kakeya", "serve"], entry  # the console script pyproject installs
    args = build_parser().parse_args(["serve", *cmd])
    assert args.command == "serve" and args.role in ("verifier", "drafter", "orchestrator", "all")
    assert args.host == "0.0.0.0", "a container must listen beyond its loopback"
    if target == "cuda":
        assert args.verifier_backend == args.drafter_backend == "torch" and args.device == "cuda"
        assert args.target.startswith("/models/") and args.draft.startswith("/models/")
    else:
        assert args.verifier_backend == args.drafter_backend == "mlx"


def _healthcheck_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("kakeya_healthcheck", DOCKER / "healthcheck.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_healthcheck_port_follows_the_command_line():
    from kakeya.app.serve import DEFAULT_PORTS

    hc = _healthcheck_module()
    assert {k: v for k, v in hc.DEFAULT_PORTS.items() if k != "all"} == DEFAULT_PORTS
    for target in TARGETS:
        cmd = ["kakeya", "serve", *exec_form(inherited(STAGES, target, "CMD"))]
        assert hc.port_from_argv(cmd) == DEFAULT_PORTS["orchestrator"]
    assert hc.port_from_argv(["kakeya", "serve", "verifier", "--port", "7000"]) == 7000
    assert hc.port_from_argv(["kakeya", "serve", "drafter", "--port=7001"]) == 7001
    assert hc.port_from_argv(["kakeya", "serve", "drafter"]) == DEFAULT_PORTS["drafter"]
    with pytest.raises(ValueError):
        hc.port_from_argv(["python", "x.py"])
    check = exec_form(inherited(STAGES, "runtime", "HEALTHCHECK").split("CMD", 1)[1].strip())
    assert check == ["python", "/opt/kakeya/healthcheck.py"]
    assert any(i == "COPY" and rest.split()[-1] == check[1] for i, rest in STAGES["runtime"].instructions)


def test_healthcheck_probes_the_plaintext_health_port_of_a_tls_server():
    """A server with --tls-cert answers plaintext health only on --health-port (components/mtls): the image's
    HEALTHCHECK speaks plaintext, so it must ask there, or the container is unhealthy forever."""
    hc = _healthcheck_module()
    tls = ["--tls-cert", "/tls/tls.crt", "--tls-key", "/tls/tls.key", "--tls-client-ca", "/tls/ca.crt"]
    assert hc.port_from_argv(["kakeya", "serve", "verifier", "--port", "50061", *tls, "--health-port", "8081"]) == 8081
    assert hc.port_from_argv(["kakeya", "serve", "drafter", "--health-port=8082", "--port=7001"]) == 8082


def _dockerignored(path: str, patterns: list[str]) -> bool:
    """Whether the Docker build context leaves ``path`` (relative, '/'-separated) out: the last pattern matching it or
    one of its parent folders decides, a ``!`` one lets it in (moby's patternmatcher: ``*`` within one folder,
    ``**`` across folders)."""
    out = False
    for pattern in patterns:
        keep = pattern.startswith("!")
        body = pattern.removeprefix("!").strip("/")
        rx = re.escape(body).replace(r"\*\*/", "(.*/)?").replace(r"\*\*", ".*").replace(r"\*", "[^/]*")
        rx = rx.replace(r"\?", "[^/]")
        parts = path.split("/")
        if any(re.fullmatch(rx, "/".join(parts[:n])) for n in range(1, len(parts) + 1)):
            out = not keep
    return out


def test_the_build_context_builds_the_package(tmp_path):
    """The image's `pip install ".[...]"` runs on what Dockerfile.dockerignore lets into the build context. Leaving the
    recall pair's folders out with its weights stopped both images' builds there ("error: package directory
    'services/models/recall' does not exist": pyproject.toml lists them as packages); its weights stay out."""
    import os
    import shutil
    import subprocess
    import sys

    patterns = [
        ln.strip()
        for ln in (DOCKER / "Dockerfile.dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    folders = {"/".join(f.split("/")[:n]) for f in files for n in range(1, f.count("/") + 1)}
    for folder in sorted(folders):  # a folder stays, even emptied, unless a pattern leaves it out
        if not _dockerignored(folder, patterns):
            (tmp_path / "ctx" / folder).mkdir(parents=True, exist_ok=True)
    for f in files:
        if not _dockerignored(f, patterns) and (ROOT / f).is_file():
            (tmp_path / "ctx" / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, tmp_path / "ctx" / f)
    out = subprocess.run(
        [sys.executable, "-c", "from setuptools import setup; setup()", "-q", "build_py", "--build-lib", str(tmp_path / "lib")],
        cwd=tmp_path / "ctx", capture_output=True, text=True, timeout=300, env=os.environ | {"PYTHONDONTWRITEBYTECODE": "1"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    models = tmp_path / "lib" / "kakeya" / "models"
    assert (models / "demo" / "target" / "model.safetensors").is_file()
    assert not list((models / "recall").rglob("*.safetensors")), "the recall pair's weights stay out of the image"


def test_the_dockerfiles_docker_run_examples_start():
    """The Dockerfile's header shows how to run each image. Its verifier example listened on 0.0.0.0 with neither a
    token nor mutual TLS, which a verifier refuses at start ("verifier on 0.0.0.0 without client authentication"):
    copied as written, the container exited at once. Every example's command line must parse, a model server's must
    authenticate its callers, and every file a flag names must be on a volume the example mounts."""
    from kakeya.runtime.security.auth import check_exposure

    runs, line = [], ""
    for raw in (DOCKER / "Dockerfile").read_text().splitlines()[1:]:
        if not raw.startswith("#"):
            break
        line += raw.removeprefix("#").split("  # ")[0].strip()
        if line.endswith("\\"):
            line = line[:-1]
            continue
        if line.startswith("docker run"):
            runs.append(line)
        line = ""
    assert len(runs) >= 2, runs
    for run in runs:
        words = shlex.split(run)
        (at,) = [i for i, w in enumerate(words) if re.fullmatch(r"kakeya:[\w.]+-(cpu|cuda)", w)]
        target = words[at].rsplit("-", 1)[1]
        cmd = words[at + 1 :] or exec_form(inherited(STAGES, target, "CMD"))
        args = build_parser().parse_args(["serve", *cmd])
        mounts = [w.split(":")[1] for i, w in enumerate(words[:at]) if i and words[i - 1] == "-v"]
        for w in cmd:
            value = w.split("=", 1)[-1]
            if value.startswith("/"):
                assert any(value == m or value.startswith(m + "/") for m in mounts), f"{run}: {value} is on no volume"
        if args.role in ("verifier", "drafter"):
            check_exposure(args.role, args.host, mutual_tls=bool(args.tls_client_ca),
                           token=bool(args.auth_token_file), insecure=args.insecure)  # fmt: skip
