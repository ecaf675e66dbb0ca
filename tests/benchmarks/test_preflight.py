"""benchmarks/preflight.py: what a GPU session checks before spending a lent node's minutes."""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import preflight


def test_reads_the_runtime_dependencies_of_pyproject():
    names = {r.name for r in preflight.requirements()}
    assert {"grpcio", "grpcio-health-checking", "protobuf", "safetensors"} <= names


def test_names_what_is_missing_or_too_old():
    installed = {"grpcio": "1.84.0", "protobuf": "7.36.2"}

    def version_of(name):
        if name not in installed:
            raise metadata.PackageNotFoundError(name)
        return installed[name]

    reqs = [
        Requirement("grpcio>=1.85.1"),
        Requirement("grpcio-health-checking>=1.85.1"),
        Requirement("protobuf>=7.35.1"),
    ]
    found = preflight.problems(reqs, version_of)
    assert [(r.name, have) for r, have in found] == [("grpcio", "1.84.0"), ("grpcio-health-checking", None)]


def test_this_environment_passes_and_an_impossible_pin_fails(capsys):
    assert preflight.main([]) == 0
    assert preflight.main(["--also", "protobuf>=999"]) == 1
    assert "protobuf>=999 needed" in capsys.readouterr().out
