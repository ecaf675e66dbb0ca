#!/usr/bin/env bash
# One-time (and idempotent) set-up: a virtual environment in .venv with Kakeya,
# its MLX and PyTorch backends and the test tools. Re-runs are fast: it only
# reinstalls when pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Kakeya needs Python >= 3.11")'
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.kakeya-installed
want=$("$PY" -c 'import hashlib; print(hashlib.sha256(open("pyproject.toml","rb").read() + open("scripts/setup.sh","rb").read() + open("deploy/docker/constraints.txt","rb").read()).hexdigest()[:16])')
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing Kakeya and its dependencies into .venv (first run takes a few minutes)" >&2
  .venv/bin/python -m pip install --quiet --upgrade pip
  # The versions the suite was last run and locked against (deploy/docker/lock.sh), as the images use.
  .venv/bin/python -m pip install --quiet -c deploy/docker/constraints.txt -e ".[mlx,torch,dev]"
  # The reference DFlash package, used only as a test oracle; its pinned
  # dependencies serve its own benchmark CLI, which we do not use.
  .venv/bin/python -m pip install --quiet --no-deps "dflash==0.1.0"
  echo "$want" > "$stamp"
fi
