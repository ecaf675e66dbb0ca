#!/usr/bin/env bash
# Every CUDA check and GPU figure of the torch fast path, in one command (a lent GPU is short-lived).
#
#   bash benchmarks/gpu_session.sh OUT_DIR [quick]
#
# Runs, each step bounded in time and allowed to fail without stopping the rest:
#   1. the CUDA tests (graph replay == eager token for token, one host sync per verify, codec on CUDA);
#   2. benchmarks/gpu_projection.py on the gemma-4-26B-A4B shape, bf16, with and without CUDA graphs;
#   3. `kakeya generate --backend torch --device cuda --compare-ar` on the embedded demo pair
#      (float32 and bfloat16, fixed block 8 and auto), JSON lines;
#   4. benchmarks/adaptive.py on CUDA (auto vs fixed block sizes) and benchmarks/host_profile.py.
# Results land in OUT_DIR (gpu_projection*.json, generate.jsonl, logs). Needs torch with CUDA,
# grpcio, protobuf, safetensors, tokenizers, prometheus-client; no MLX.
set -u
OUT=${1:?usage: gpu_session.sh OUT_DIR [quick]}
QUICK=${2:-}
LOGS=${LOGS:-$OUT}  # each step's full log (LOGS=/tmp/x keeps OUT to the results alone)
mkdir -p "$OUT" "$LOGS"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

step() {  # step NAME SECONDS CMD... : run, log to OUT/NAME.log, never abort the session
  local name=$1 secs=$2; shift 2
  echo "== $name"
  local t0=$SECONDS
  timeout "$secs" "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  tail -n 12 "$LOGS/$name.log"
  echo "== $name: rc=$rc, $((SECONDS - t0)) s"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import torch; print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))"

step cuda_tests 240 $PY -m pytest -q -x -p no:cacheprovider \
  tests/torch_backend/test_static_step.py tests/torch_backend/test_static_draft.py tests/torch_backend/test_torch_ops.py

REPS=${REPS:-20}; [ -n "$QUICK" ] && REPS=5
step projection_graphs 240 $PY benchmarks/gpu_projection.py --device cuda --reps $REPS --profile --out "$OUT/gpu_projection.json"
if [ -z "$QUICK" ]; then
  step projection_compiled 300 $PY benchmarks/gpu_projection.py --device cuda --reps $REPS --compile --profile \
    --out "$OUT/gpu_projection_compiled.json"
  step projection_eager 240 $PY benchmarks/gpu_projection.py --device cuda --reps $REPS --cuda-graphs off --profile \
    --out "$OUT/gpu_projection_eager.json"
fi

: >"$OUT/generate.jsonl"
for dtype in float32 bfloat16; do
  for block in 8 0; do
    step "generate_${dtype}_b${block}" 180 $PY -m services.orchestrator.cli generate --backend torch --device cuda \
      --dtype $dtype --block-size $block --max-tokens 256 --ignore-eos --compare-ar --json
    tail -n 1 "$LOGS/generate_${dtype}_b${block}.log" >>"$OUT/generate.jsonl"
  done
done
step adaptive_cuda 240 $PY benchmarks/adaptive.py --backends torch --device cuda --prompts 4 --rounds 2 \
  --out "$OUT/adaptive_cuda.json"
step host_profile 120 $PY benchmarks/host_profile.py --device cuda --block-size 8
cp "$LOGS/host_profile.log" "$OUT/" 2>/dev/null
echo "== done"
