#!/usr/bin/env bash
# Kakeya on one Mac: verifier, drafter and orchestrator in ONE process (MLX on the GPU, nothing on
# the network between them), serving the public Generate API.
#
#   deploy/mac/run.sh                                   # embedded demo pair on 127.0.0.1:50051
#   KAKEYA_TARGET=~/models/gemma-4-26b-a4b KAKEYA_DRAFT=~/models/gemma-4-26b-a4b-dflash deploy/mac/run.sh
#   deploy/mac/run.sh --cache sink-window --window 1024  # extra flags go to `kakeya serve orchestrator`
#   kakeya client --addr 127.0.0.1:50051 generate --prompt "def f(x):"
#   curl 127.0.0.1:8000/v1/models                       # the OpenAI HTTP API (chat UIs, editor plugins)
#
# Environment: KAKEYA_TARGET / KAKEYA_DRAFT (checkpoint directories; both or neither),
# KAKEYA_HOST (127.0.0.1), KAKEYA_PORT (50051), KAKEYA_HTTP_PORT (8000; off: no HTTP API),
# KAKEYA_CACHE (native | sink-window), KAKEYA_PREFIX_CACHE_BYTES (chats' history: auto, a tenth of the
# memory free at start, at most 4G; e.g. 8G; 0: off),
# KAKEYA_MAX_SESSIONS (0 = no limit), KAKEYA_GRACE (30 s of draining on SIGTERM),
# KAKEYA (the kakeya executable; default: the repository's .venv, then PATH),
# KAKEYA_DRY_RUN=1 (print the command, one argument per line, instead of running it).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
kakeya=${KAKEYA:-}
if [[ -z $kakeya ]]; then
  if [[ -x $root/.venv/bin/kakeya ]]; then kakeya=$root/.venv/bin/kakeya; else kakeya=$(command -v kakeya || true); fi
fi
[[ -n $kakeya ]] || { echo "run.sh: no kakeya executable: run scripts/setup.sh first (or set KAKEYA)" >&2; exit 2; }
args=(serve orchestrator --backend mlx
      --host "${KAKEYA_HOST:-127.0.0.1}" --port "${KAKEYA_PORT:-50051}"
      --cache "${KAKEYA_CACHE:-native}" --max-sessions "${KAKEYA_MAX_SESSIONS:-0}" --grace "${KAKEYA_GRACE:-30}"
      --prefix-cache-bytes "${KAKEYA_PREFIX_CACHE_BYTES:-auto}")
http_port=${KAKEYA_HTTP_PORT:-8000}
[[ $http_port == off ]] || args+=(--http-port "$http_port")
if [[ -n ${KAKEYA_TARGET:-} || -n ${KAKEYA_DRAFT:-} ]]; then
  [[ -n ${KAKEYA_TARGET:-} && -n ${KAKEYA_DRAFT:-} ]] || { echo "run.sh: set both KAKEYA_TARGET and KAKEYA_DRAFT, or neither" >&2; exit 2; }
  args+=(--target "$KAKEYA_TARGET" --draft "$KAKEYA_DRAFT")
fi
if [[ ${KAKEYA_DRY_RUN:-} == 1 ]]; then
  printf '%s\n' "$kakeya" "${args[@]}" "$@"
  exit 0
fi
exec "$kakeya" "${args[@]}" "$@"
