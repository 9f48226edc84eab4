#!/usr/bin/env bash
# The real-shape family tables on one H200 in one call of under 9 minutes: `bench step` (decode step
# all-HBM at b1 and b8 against its bytes floor, the step without routed experts as a share of it) and
# `bench cache` (lru, lookahead and the static usage set x all-HBM, with the time columns) on random
# models of the published configs (coldset.engine.random_weights; --model-family in
# src/coldset/measure/harness.py): gpt-oss-20b bf16, gpt-oss-120b MXFP4, DeepSeek-V3 block FP8 on 4 of
# its 58 MoE layers (its 3 dense layers kept), GLM-4.5-Air bf16 on 12 of its 45 MoE layers, and
# Qwen3-30B-A3B bf16, the same-run reference. Random routers route without a trained model's
# locality: the cache rows' hit rates are a random router's, their step times the real shape's.
#
# Usage (repository root): OUT=results/measure/families bash scripts/h200_family_tables.sh
# Commands run most important first, each under `timeout` of at most its cap and the time left of
# BUDGET_S (default 530 s); one with under 45 s left is skipped (listed in $OUT/skipped.txt). Each writes
# its JSON as it goes ($OUT/<family>/decode_step.json, cache_bench.json), so a command cut short leaves
# the rows it finished. The summary table is printed last and written to $OUT/summary.md.
set -u
OUT=${OUT:-results/measure/families}
BUDGET_S=${BUDGET_S:-530}
mkdir -p "$OUT"
start=$SECONDS

run() {  # run FAMILY CAP_S bench ARGS...: one command, its log in $OUT/FAMILY/
  local family=$1 cap=$2
  shift 2
  local left=$((BUDGET_S - (SECONDS - start)))
  if [ "$left" -lt 45 ]; then
    echo "skipped (${left}s left): $*" | tee -a "$OUT/skipped.txt"
    return
  fi
  [ "$cap" -gt "$left" ] && cap=$left
  mkdir -p "$OUT/$family"
  echo "[$((SECONDS - start))s] $* (at most ${cap}s)"
  timeout --signal=TERM --kill-after=10 "$cap" python -m coldset "$@" >>"$OUT/$family/$2.log" 2>&1
  echo "[$((SECONDS - start))s] exit $? ($family $2)"
}

run gpt-oss-20b 80 bench step --model-family gpt-oss-20b --engines compiled --reps 20 --rounds 2 --out "$OUT/gpt-oss-20b"
run deepseek-v3 80 bench step --model-family deepseek-v3 --moe-layers 4 --engines compiled --reps 20 --rounds 2 --out "$OUT/deepseek-v3"
run gpt-oss-120b 130 bench cache --model-family gpt-oss-120b --residencies 0.25,0.4,0.5,0.75 --batches 1 --policies lru,lookahead --depths 1 --steps 32 --repeats 1 --out "$OUT/gpt-oss-120b"
run gpt-oss-120b 80 bench step --model-family gpt-oss-120b --engines compiled --reps 20 --rounds 2 --out "$OUT/gpt-oss-120b"
run qwen3-30b-a3b 70 bench cache --model-family qwen3-30b-a3b --residencies 0.5 --batches 1 --policies lru,lookahead --depths 1 --steps 32 --repeats 1 --out "$OUT/qwen3-30b-a3b"
run gpt-oss-20b 70 bench cache --model-family gpt-oss-20b --residencies 0.5 --batches 1 --policies lru,lookahead --depths 1 --steps 32 --repeats 1 --out "$OUT/gpt-oss-20b"
run deepseek-v3 70 bench cache --model-family deepseek-v3 --moe-layers 4 --residencies 0.5 --batches 1 --policies lru,lookahead --depths 1 --steps 32 --repeats 1 --out "$OUT/deepseek-v3"
run qwen3-30b-a3b 70 bench step --model-family qwen3-30b-a3b --engines compiled --reps 20 --rounds 2 --out "$OUT/qwen3-30b-a3b"
run glm-4.5-air 70 bench step --model-family glm-4.5-air --moe-layers 12 --engines compiled --reps 20 --rounds 2 --out "$OUT/glm-4.5-air"

python - "$OUT" <<'PY' | tee "$OUT/summary.md"
import json, sys
from pathlib import Path
from coldset.measure.harness import family_summary
files = sorted(Path(sys.argv[1]).glob("*/*.json"))
print(family_summary([json.loads(p.read_text()) for p in files]))
PY
