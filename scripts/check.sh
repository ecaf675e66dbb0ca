#!/usr/bin/env bash
# The README's test command and CI's (.ci/run): set up .venv if needed, lint, check the format, run the tests.
# Extra arguments go to pytest (e.g. `./scripts/check.sh tests/orchestrator -x`).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/ruff check --quiet .
.venv/bin/ruff format --check --quiet .
exec .venv/bin/python -m pytest -q "$@"
