#!/usr/bin/env bash
# Every CUDA check and GPU figure of the torch fast path, in one command (a lent GPU is short-lived).
#
#   bash benchmarks/gpu_session.sh OUT_DIR [quick]
#   PARTS="generate batching" bash benchmarks/gpu_session.sh OUT_DIR      # some parts only
#
# Parts (each step bounded in time and allowed to fail without stopping the rest):
#   tests       the CUDA tests (graph replay == eager token for token, one host sync per verify/draft, ...)
#   kernels     tests/kernels on CUDA: every Triton kernel (services/backends/torch/kernels) against the eager
#               path, at the small shapes and the real ones, each test at most KERNEL_TEST_S (90) s where
#               pytest-timeout is installed; the verdicts in OUT/kernel_tests_cuda.txt. Then each kernel's
#               achieved bandwidth beside its eager counterpart (benchmarks/kernels.py, OUT/kernels_cuda.json):
#               its own step, as the 2026-11-28 session ran it, so a kernel that fails loses no projection
#   projection  benchmarks/gpu_projection.py on the gemma-4-26B-A4B shape, bf16: CUDA graphs, graphs + --compile
#               (each layer's row-wise halves fused; its log names every recompile, TORCH_LOGS=recompiles),
#               no graphs (each with the top kernels)
#   demo        the same on the embedded demo pair (float32; also --compile): where a tiny model's step is
#               all overhead; benchmarks/small_gemm.py (few-row linears, each spelling of the product)
#   generate    `kakeya generate --backend torch --device cuda --compare-ar` on the embedded demo pair
#               (GEN_DTYPES "float32 bfloat16" x GEN_BLOCKS "8 0", 0: auto), JSON lines in OUT/generate.jsonl;
#               benchmarks/host_profile.py (PROFILE_DTYPE, bfloat16: the dtype of the issue's CUDA goal)
#   adaptive    benchmarks/adaptive.py on CUDA (auto vs fixed block sizes)
#   batching    benchmarks/batching.py: N sessions' verifies/drafts alone vs one batch (26B shape, demo pair)
#   concurrency benchmarks/concurrency.py on CUDA: colocated torch and `serve all`, 1..16 streams, a newcomer's first token
#   split       benchmarks/split.py on CUDA: split vs colocated, one stream at block sizes
#               1..16 and auto with each block's critical path as compute + wire, 1/4/8/16 streams;
#               SPLIT_VARIANTS="--graphed-min-batch=0 --graphed-min-batch=4": one run per variant, each a
#               comma-separated list of split.py flags (--graphed-min-batch: the drafters',
#               backends/torch/graphs.py), OUT/split_cuda_<variant>.json
#   compile     `kakeya generate --compile --compare-ar` in bf16 at block 8 (not in the default PARTS)
#   train       a next stage of the demo drafter (not in the default PARTS: ask for it): the shipped drafter
#               fine-tuned on CUDA on TRAIN_SEQUENCES (49,152) new target continuations for TRAIN_STEPS (6,000)
#               steps of TRAIN_BATCH (256) sequences, at most TRAIN_BUDGET_S (240) s of training, the whole
#               step under 10 min (one device call; a rerun on the same node reuses the data made); the data
#               (~240 KB a continuation) stays in TRAIN_DIR, the drafter and its report come back in
#               OUT/draft_next/ (docs/demo-pair.md: what to do with it). TRAIN_INIT=scratch trains
#               one from random weights instead, of TRAIN_LAYERS / TRAIN_INTERMEDIATE (2 / 384, the shipped shape) (then raise TRAIN_STEPS / TRAIN_BUDGET_S: stage 1 took 16,000 steps)
# First benchmarks/preflight.py checks pyproject's runtime dependencies (and, for train, transformers): a
# lent node's image may lack some (docs/cuda.md: carry them as wheels); PREFLIGHT=off runs anyway.
# SESSION_S bounds the whole session (a device call's limit): each step's time is cut to what is left,
# and a step with under 30 s left is skipped. SPLIT_ARGS replaces the split step's sizes and streams.
# Results land in OUT_DIR. Needs torch with CUDA, grpcio, protobuf, safetensors, tokenizers,
# prometheus-client, jinja2 (chat templates); no MLX.
set -u
OUT=${1:?usage: gpu_session.sh OUT_DIR [quick]}
QUICK=${2:-}
PARTS=${PARTS:-tests kernels projection demo generate adaptive batching concurrency split}
LOGS=${LOGS:-$OUT}  # each step's full log (LOGS=/tmp/x keeps OUT to the results alone)
mkdir -p "$OUT" "$LOGS"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
# A GPU node runs the checkout as it is (nothing installed): the source folder imports as `kakeya`
# (pyproject.toml's package-dir) through a link on PYTHONPATH.
if ! $PY -c "import kakeya" 2>/dev/null; then
  SHIM=$(mktemp -d); ln -s "$PWD/services" "$SHIM/kakeya"
  export PYTHONPATH="$SHIM:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
REPS=${REPS:-20}; [ -n "$QUICK" ] && REPS=5

step() {  # step NAME SECONDS CMD... : run, log to LOGS/NAME.log, never abort the session
  local name=$1 secs=$2; shift 2
  if [ -n "${SESSION_S:-}" ]; then
    local left=$((SESSION_S - SECONDS))
    if [ "$left" -lt 30 ]; then echo "== $name: skipped, ${left} s left of SESSION_S"; return 0; fi
    [ "$left" -lt "$secs" ] && secs=$left
  fi
  echo "== $name"
  local t0=$SECONDS
  timeout "$secs" "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  tail -n 12 "$LOGS/$name.log"
  echo "== $name: rc=$rc, $((SECONDS - t0)) s"
}
part() { [[ " $PARTS " == *" $1 "* ]]; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
$PY -c "import torch; print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))"
# Missing or old packages would fail every step, after the node's minutes were spent: stop here instead
if ! $PY benchmarks/preflight.py $(part train && echo --also "transformers>=5.23"); then
  [ "${PREFLIGHT:-on}" = off ] || { echo "== preflight failed: carry the packages above (PREFLIGHT=off runs anyway)"; exit 2; }
fi

# One GPU, one pytest process: `-o addopts=-ra` drops pyproject's two xdist workers (the node's image has no xdist).
PYTEST="$PY -m pytest -o addopts=-ra -q -p no:cacheprovider"
if part tests; then
  step cuda_tests 240 $PYTEST -x \
    tests/torch_backend/test_static_step.py tests/torch_backend/test_static_draft.py tests/torch_backend/test_torch_ops.py
  step cuda_compile_tests 300 $PYTEST tests/torch_backend/test_compile.py -k cuda
fi

if part kernels; then  # the interpreter's tests again, compiled; then the real shapes
  # A limit per test (pytest-timeout, which the lent node's image has): a kernel whose compile hangs fails
  # alone instead of taking the step's whole time, and the tests after it still run.
  KERNEL_TESTS="$PYTEST $($PY -c 'import pytest_timeout' 2>/dev/null && echo "--timeout ${KERNEL_TEST_S:-90}") tests/kernels"
  step kernel_tests 420 $KERNEL_TESTS
  {  # the verdicts, as benchmarks/results/kernel_tests_cuda.txt keeps them
    echo "# tests/kernels on CUDA, $(date -u +%F): $(cat "$OUT/device.txt") $($PY -c \
      'import torch, triton; print("triton", triton.__version__, "torch", torch.__version__)')"
    echo "# $KERNEL_TESTS"
    grep -E '^(FAILED|ERROR) |^[0-9]+ (passed|failed)|^=+ .*(passed|failed)' "$LOGS/kernel_tests.log"
    grep -E '^E +[A-Za-z.]*(Error|Exception)' "$LOGS/kernel_tests.log" | head -n 20
  } >"$OUT/kernel_tests_cuda.txt"
  step kernels 300 $PY benchmarks/kernels.py --reps $((REPS * 2)) --out "$OUT/kernels_cuda.json"
fi

if part projection; then
  step projection_graphs 360 $PY benchmarks/gpu_projection.py --device cuda --reps $REPS --profile \
    --out "$OUT/gpu_projection.json"
  if [ -z "$QUICK" ]; then
    step projection_compiled 300 env TORCH_LOGS=recompiles $PY benchmarks/gpu_projection.py --device cuda --reps $REPS \
      --compile --profile --out "$OUT/gpu_projection_compiled.json"
    step projection_eager 240 $PY benchmarks/gpu_projection.py --device cuda --reps $REPS --cuda-graphs off --profile \
      --out "$OUT/gpu_projection_eager.json"
  fi
fi

if part demo; then  # the demo pair's own step costs and kernels (float32, the lossless dtype)
  step projection_demo 180 $PY benchmarks/gpu_projection.py --device cuda --demo --dtype float32 --reps $REPS --profile \
    --out "$OUT/gpu_projection_demo.json"
fi

if part demo; then  # few-row linears in float32 / bf16: which spelling of the product is fastest
  step small_gemm 120 $PY benchmarks/small_gemm.py --device cuda --out "$OUT/small_gemm.json"
  step projection_demo_compiled 240 $PY benchmarks/gpu_projection.py --device cuda --demo --dtype float32 --reps $REPS \
    --compile --profile --out "$OUT/gpu_projection_demo_compiled.json"
fi

if part generate; then
  : >"$OUT/generate.jsonl"
  for dtype in ${GEN_DTYPES:-float32 bfloat16}; do
    for block in ${GEN_BLOCKS:-8 0}; do
      step "generate_${dtype}_b${block}" 180 $PY -m kakeya.app.main generate --backend torch --device cuda \
        --dtype $dtype --block-size $block --max-tokens 256 --ignore-eos --compare-ar --json
      tail -n 1 "$LOGS/generate_${dtype}_b${block}.log" | DTYPE=$dtype $PY -c \
        'import json, os, sys; print(json.dumps(json.loads(sys.stdin.read()) | {"dtype": os.environ["DTYPE"]}))' \
        >>"$OUT/generate.jsonl"
    done
  done
  # benchmarks/results/generate_cuda.json's shape: the runs, the card, the command
  $PY - "$OUT" <<'PY'
import json, sys
from pathlib import Path
sys.path.insert(0, "benchmarks")
from record import provenance, write_result  # every results JSON records its commit, tree, date, machine
out = Path(sys.argv[1])
runs = [json.loads(line) for line in (out / "generate.jsonl").read_text().splitlines() if line.startswith("{")]
keep = ("dtype", "block_size", "block_sizes", "mean_acceptance", "copied_blocks", "decode_tok_s", "ar_decode_tok_s",
        "speedup", "lossless", "device")
name = (out / "device.txt").read_text() if (out / "device.txt").is_file() else ""  # nvidia-smi's line: name, memory, driver
write_result(out / "generate_cuda.json", {
    "benchmark": "kakeya generate --backend torch --device cuda --compare-ar --max-tokens 256 --ignore-eos",
    "device_name": name.split(",")[0].strip() or None,
    "command": "bash benchmarks/gpu_session.sh OUT (part generate)",
    "runs": [{k: r.get(k) for k in keep} for r in runs]},
    record=provenance() | {"command": "PARTS=generate bash benchmarks/gpu_session.sh OUT"})
PY
  step host_profile 120 $PY benchmarks/host_profile.py --device cuda --dtype "${PROFILE_DTYPE:-bfloat16}" --block-size 8
  cp "$LOGS/host_profile.log" "$OUT/" 2>/dev/null
fi

if part adaptive; then
  step adaptive_cuda 240 $PY benchmarks/adaptive.py --backends torch --device cuda --prompts 4 --rounds 2 \
    --out "$OUT/adaptive_cuda.json"
fi

if part batching; then
  step batching_26b 300 $PY benchmarks/batching.py --device cuda --shape 26b --dtype bfloat16 --ctx 1238 \
    --out "$OUT/batching_cuda_26b.json"
  step batching_demo 120 $PY benchmarks/batching.py --device cuda --shape demo --out "$OUT/batching_cuda_demo.json"
fi

if part concurrency; then
  step concurrency_cuda 300 $PY benchmarks/concurrency.py --deployments colocated-torch split --serve-args "--device cuda" \
    --repeats 1 --out "$OUT/concurrency_cuda.json"
fi
if part train; then  # the stage-2 command's shape (services/models/demo/draft/report.json), GPU-sized
  TRAIN_DIR=${TRAIN_DIR:-/tmp/kakeya-train}
  step train_drafter $((${TRAIN_BUDGET_S:-240} + 320)) $PY -m kakeya.app.main train-drafter \
    --target services/models/demo/target $([ "${TRAIN_INIT:-shipped}" = scratch ] || echo --init-from services/models/demo/draft) \
    --out "$TRAIN_DIR/draft" \
    --device "${TRAIN_DEVICE:-cuda}" --seed "${TRAIN_SEED:-2}" --sequences "${TRAIN_SEQUENCES:-49152}" \
    --gen-batch "${TRAIN_GEN_BATCH:-2048}" --batch "${TRAIN_BATCH:-256}" --steps "${TRAIN_STEPS:-6000}" \
    --time-budget "${TRAIN_BUDGET_S:-240}" --resume --lr 0.001 --warmup 100 --save-every 500 --eval-every 1000 \
    --layers "${TRAIN_LAYERS:-2}" --intermediate "${TRAIN_INTERMEDIATE:-384}" --heads 4 --kv-heads 2 --head-dim 32 --target-layer-ids 1,6,11,16 \
    --block-size 8 --train-block-sizes 8,16 --anchors 16 --prompt-len 64 --gen-len 128 --bos-prompts \
    --temperatures 0,0,0.7,1 --soft-weight 1 --eval-backend torch ${TRAIN_EVAL_PROMPTS:+--eval-prompts $TRAIN_EVAL_PROMPTS}
  mkdir -p "$OUT/draft_next"
  cp "$TRAIN_DIR"/draft/{config.json,model.safetensors,report.json} "$OUT/draft_next/" 2>/dev/null
fi
if part split; then
  if [ -z "${SPLIT_VARIANTS:-}" ]; then
    step split_cuda 480 $PY benchmarks/split.py --backend torch --device cuda --repeats $([ -n "$QUICK" ] && echo 2 || echo 5) \
      ${SPLIT_ARGS:-} --out "$OUT/split_cuda.json"
  else  # one run per variant: its comma-separated split.py flags (--graphed-min-batch=0,--dtype=bfloat16)
    for variant in $SPLIT_VARIANTS; do
      name=split_cuda_$(echo "$variant" | tr -c 'A-Za-z0-9_\n' '_' | tr -s '_')
      step "$name" 300 $PY benchmarks/split.py --backend torch --device cuda $(echo "$variant" | tr ',' ' ') \
        --repeats $([ -n "$QUICK" ] && echo 2 || echo 5) ${SPLIT_ARGS:-} --out "$OUT/$name.json"
    done
  fi
fi
if part compile; then  # --compile on CUDA end to end (on a CPU it is refused: the compiled attention met torch's recompile limit)
  step generate_compile 240 $PY -m kakeya.app.main generate --backend torch --device cuda --dtype bfloat16 --compile \
    --block-size 8 --max-tokens 256 --ignore-eos --compare-ar --json
  tail -n 1 "$LOGS/generate_compile.log" | $PY -c 'import json, sys; sys.path.insert(0, "benchmarks")
from record import provenance, write_result
write_result(sys.argv[1], json.loads(sys.stdin.read()), record=provenance() | {"command": "PARTS=compile bash benchmarks/gpu_session.sh OUT"})' \
    "$OUT/generate_compile.json"
fi
# Every step's whole log in one file (a device call brings back few files)
[ "$LOGS" != "$OUT" ] && tar czf "$OUT/logs.tgz" -C "$LOGS" . 2>/dev/null
echo "== done"
