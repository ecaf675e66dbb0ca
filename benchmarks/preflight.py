"""Before a GPU session: are the runtime dependencies of pyproject.toml installed, at their pinned versions?

A lent node runs the checkout with the Python packages its image has, and nothing can be fetched
there; a missing or older package (the image had grpcio 1.84 and no grpcio-health-checking) only
shows as an import error in every step, after the node's minutes were spent. This checks in a
second and names what to carry:

    python benchmarks/preflight.py                  # the [project] dependencies
    python benchmarks/preflight.py --also "transformers>=5.23"   # what a part needs besides (train)

Exit status 1 and one line per problem, then the ``pip download`` line that fetches them (see
docs/cuda.md: wheels travel in the ignored ``.whl/`` folder and install with ``--target``).
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[Requirement]:
    """The [project] dependencies that apply to this interpreter and platform."""
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return [r for r in map(Requirement, deps) if r.marker is None or r.marker.evaluate()]


def problems(reqs: list[Requirement], version_of=metadata.version) -> list[tuple[Requirement, str | None]]:
    """``(requirement, the installed version or None)`` for each one not met."""
    out = []
    for req in reqs:
        try:
            have = version_of(req.name)
        except metadata.PackageNotFoundError:
            out.append((req, None))
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            out.append((req, have))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--also", action="append", default=[], help="another requirement to check (repeatable)")
    args = ap.parse_args(argv)
    found = problems(requirements() + [Requirement(r) for r in args.also])
    if not found:
        print("preflight: every runtime dependency is installed at its pinned version")
        return 0
    for req, have in found:
        print(f"preflight: {req} needed, {'not installed' if have is None else f'{have} installed'}")
    names = " ".join(f"'{req.name}{req.specifier}'" for req, _ in found)
    print(
        "preflight: fetch them where pip works (docs/cuda.md), e.g. python3 -m pip download --no-deps "
        f"--only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .whl {names}"
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
