#!/usr/bin/env bash
# Re-run every CPU figure the README and docs give as *current*, on the commit checked out now.
#
#   bash benchmarks/refresh.sh              # everything below, one job after the other (~38 min estimated, 2-core VM)
#   JOBS="first_request pair_cost" bash benchmarks/refresh.sh     # some jobs only
#
# Each job rewrites its JSON in benchmarks/results/ through benchmarks/record.py, whose `record` names the
# commit and the services/ tree it ran on: tests/test_records.py fails for a current figure whose JSON
# names another services/ tree than HEAD's (docs/benchmarks.md, "How to read a figure"). Commit first: a
# run on a dirty services/ tree records `dirty` and stays stale. After a run, the figures quoted in the
# docs from these files are the prose's to update (first_request.py --readme re-quotes README's line).
#
# The jobs, their JSON and the time each is expected to take on the shared 2-core VM with nothing else
# running (estimated from the runs' past sizes: the suite's 12 min for 4 prompts x 3 repeats x 5 sizes x 5
# loops, ~1 s a 128-token generation of the demo pair on torch CPU, ~1.5 s on MLX; each run prints its own
# time at the end, and a job past its limit is stopped and reported, not waited for):
#
#   first_request      README command 1 in 12 fresh processes (auto, 4, 8, 16 x 3), torch, each with
#                      transformers' generate too; re-quotes README's line     first_request.json      4 min
#   first_request_mlx  the same on MLX                                          first_request_mlx.json  4 min
#   pair_cost          draft(8) / verify(8) / AR step, torch and MLX; then the
#                      model card re-rendered from it (its cost table)          pair_cost.json          1 min
#   adaptive           auto vs fixed blocks warm, 4 prompts x 2 rounds, both    adaptive.json           3 min
#   ngram              n-gram copies on / off, 12 held-out prompts x 1 round    ngram.json              4 min
#   sampling           coupled vs rejection, T 0.7 / 1.0, 3 seeds; sampler cost sampling.json           3 min
#   chat               4-turn chat with the prefix cache, 16 concurrent chats   chat.json               2 min
#   concurrency        colocated torch, split, colocated MLX at 1 / 4 / 8 / 16
#                      streams, 2 passes; a newcomer's first token              concurrency.json        6 min
#   isolation          8 streams for 30 s per deployment, cancels, deadlines    isolation.json          3 min
#   structured         guided vs blind JSON decoding, 2 rounds                  structured.json         2 min
#   grammar_masks      llguidance vs xgrammar masks per token                   grammar_masks.json      1 min
#   files_crossed      the services/ files one greedy block and one streamed
#                      HTTP chat request run code in                            files_crossed.json      1 min
#   tool_schemas       ten pydantic models' forced tool calls, speculative vs
#                      --no-drafter, validity against their schemas             tool_schemas.json       3 min
#   niah_gemma         the recall pair's Gemma-shaped half: kakeya niah over
#                      3 contexts x 5 depths x 9 cache policies                 niah_recall_gemma.json  2 min
#   niah_slide         the same on its all-sliding half, 5 contexts x 7 depths
#                      (14 needles in the band only f_theta can restore)        niah_recall_slide.json  5 min
#   ftheta_oracle      the slide band's needles under sink-window + perfect
#                      (native) K/V in the restore path, and f_theta's K/V error ftheta_oracle_slide.json 2 min
#   split_block8       one stream at block 8, colocated vs both splits, 20 alternations split_block8.json  4 min
#
# Not here (their figures are History in the docs): GPU results (docs/cuda.md: benchmarks/gpu_session.sh),
# A/B runs between two checkouts (cpu_fastpath.py --before, the *_ab folders), runs that need a drafter not
# kept in the repository (History figures of scripts since removed: draft_refine.py, predraft.py), and runs too long for the budget
# (suite.py 12 min, acceptance_prompts.py's 128 prompts, split.py at its defaults, heap.py, rounds.py).
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
ALL="first_request first_request_mlx pair_cost adaptive ngram sampling chat concurrency isolation structured grammar_masks files_crossed tool_schemas niah_gemma niah_slide ftheta_oracle split_block8"
JOBS=${JOBS:-$ALL}
[ -n "$(git status --porcelain -- services)" ] && echo "refresh: services/ has uncommitted changes: every JSON will record dirty=true" >&2

declare -A LIMIT=([first_request]=480 [first_request_mlx]=480 [pair_cost]=180 [adaptive]=360 [ngram]=480
  [sampling]=360 [chat]=240 [concurrency]=900 [isolation]=360 [structured]=300 [grammar_masks]=180
  [files_crossed]=240 [tool_schemas]=480 [niah_gemma]=300 [niah_slide]=600 [ftheta_oracle]=300
  [split_block8]=600)
cmd() {
  case $1 in
    first_request) echo "benchmarks/first_request.py --rounds 3 --readme --out benchmarks/results/first_request.json" ;;
    first_request_mlx) echo "benchmarks/first_request.py --backend mlx --rounds 3 --out benchmarks/results/first_request_mlx.json" ;;
    pair_cost) echo "benchmarks/pair_cost.py --out benchmarks/results/pair_cost.json" ;;
    adaptive) echo "benchmarks/adaptive.py --prompts 4 --rounds 2 --out benchmarks/results/adaptive.json" ;;
    ngram) echo "benchmarks/ngram.py --prompts 12 --rounds 1 --out benchmarks/results/ngram.json" ;;
    sampling) echo "benchmarks/sampling.py --repeats 3 --out benchmarks/results/sampling.json" ;;
    chat) echo "benchmarks/chat.py --out benchmarks/results/chat.json" ;;
    concurrency) echo "benchmarks/concurrency.py --deployments colocated-torch split colocated-mlx --streams 1 4 8 16 --repeats 2 --requests 2 --busy 8 --out benchmarks/results/concurrency.json" ;;
    isolation) echo "benchmarks/isolation.py --deployments colocated-torch split colocated-mlx --seconds 30 --out benchmarks/results/isolation.json" ;;
    structured) echo "benchmarks/structured.py --rounds 2 --out benchmarks/results/structured.json" ;;
    grammar_masks) echo "benchmarks/grammar_masks.py --out benchmarks/results/grammar_masks.json" ;;
    files_crossed) echo "benchmarks/files_crossed.py --out benchmarks/results/files_crossed.json" ;;
    tool_schemas) echo "benchmarks/tool_schemas.py --max-tokens 96 --out benchmarks/results/tool_schemas.json" ;;
    niah_gemma) echo "benchmarks/niah_recall.py --pairs services/models/recall/gemma --contexts 96 128 256 --depths 0 0.25 0.5 0.75 1.0 --out benchmarks/results/niah_recall_gemma.json --plot benchmarks/results/niah_recall_gemma.png" ;;
    niah_slide) echo "benchmarks/niah_recall.py --pairs services/models/recall/slide --contexts 128 160 192 224 256 --depths 0 0.25 0.5 0.6 0.75 0.9 1.0 --out benchmarks/results/niah_recall_slide.json --plot benchmarks/results/niah_recall_slide.png" ;;
    ftheta_oracle) echo "benchmarks/ftheta_oracle.py --pair services/models/recall/slide --out benchmarks/results/ftheta_oracle_slide.json" ;;
    split_block8) echo "benchmarks/split.py --block-sizes 8 --streams --repeats 20 --no-floor --out benchmarks/results/split_block8.json" ;;
    *) return 1 ;;
  esac
}

start=$SECONDS
failed=""
for job in $JOBS; do
  c=$(cmd "$job") || { echo "refresh: no job $job (jobs: $ALL)" >&2; exit 2; }
  t0=$SECONDS
  echo "refresh: $job: python $c" >&2
  # shellcheck disable=SC2086  # the command's words
  timeout "${LIMIT[$job]}" nice -n 5 $PY $c >"/tmp/refresh_$job.log" 2>&1
  rc=$?
  echo "refresh: $job: rc $rc, $((SECONDS - t0)) s (log /tmp/refresh_$job.log)" >&2
  [ $rc -ne 0 ] && failed="$failed $job"
  if [ "$job" = pair_cost ] && [ $rc -eq 0 ]; then  # the model card renders the cost table (tests/training/test_card.py)
    $PY -m kakeya.training.card services/models/demo --pair-cost benchmarks/results/pair_cost.json || failed="$failed card"
  fi
done
echo "refresh: done in $((SECONDS - start)) s;${failed:+ FAILED:$failed;} now: pytest -n 0 tests/test_records.py tests/test_readme_figures.py" >&2
[ -z "$failed" ]
