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
# Usage (repository root; on the device carry `.whl`, the jsonschema wheels the workflow config needs):
#   OUT=results/measure/families bash scripts/h200_family_tables.sh
# Commands run most important first (the cache rows of three families in one run, then gpt-oss-120b's, then the
# steps), each under `timeout` of at most its cap and the time left of
# BUDGET_S (default 530 s); RUNS="family:cache family:step ..." narrows what runs; one with under 45 s left is skipped
# (listed in skipped.txt). Each writes its
# JSON as it goes (<family>/decode_step.json, cache_bench.json, under W=/tmp/families), so a command cut
# short leaves the rows it finished. After every command $OUT gets families.tar.gz (every JSON and log)
# and summary.md (coldset.measure.render.family_summary), which is printed last: two files, as the
# device's $OUT takes few.
set -u
OUT=${OUT:-results/measure/families}
BUDGET_S=${BUDGET_S:-530}
W=${W:-/tmp/families}
mkdir -p "$OUT" "$W"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
if ! python3 -c "import jsonschema" 2>/dev/null; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && export PYTHONPATH=$PYTHONPATH:/tmp/site
  else
    echo "jsonschema is not importable and no .whl/ wheels were carried: the bench commands cannot read their config"
    exit 1
  fi
fi
start=$SECONDS

collect() {  # the results so far into $OUT: families.tar.gz and summary.md
  tar czf "$OUT/families.tar.gz" -C "$(dirname "$W")" "$(basename "$W")"
  python3 - "$W" >"$OUT/summary.md" <<'PY'
import json, sys
from pathlib import Path
from coldset.measure.render import family_summary
results = []
for p in sorted(Path(sys.argv[1]).glob("*/*.json")):
    try:
        results.append(json.loads(p.read_text()))
    except ValueError as exc:  # a file cut mid-write is named, not summarised
        print(f"{p}: unreadable ({exc})")
print(family_summary(results))
PY
}

run() {  # run FAMILY CAP_S bench ARGS...: one command, its log in $W/FAMILY/, then collect
  local family=$1 cap=$2
  shift 2
  local left=$((BUDGET_S - (SECONDS - start)))
  if [ "$left" -lt 45 ]; then
    echo "skipped (${left}s left): $*" | tee -a "$W/skipped.txt"
    return
  fi
  [ "$cap" -gt "$left" ] && cap=$left
  mkdir -p "$W/$family"
  echo "[$((SECONDS - start))s] $* (at most ${cap}s)"
  timeout --signal=TERM --kill-after=10 "$cap" python3 -m coldset "$@" >>"$W/$family/$2.log" 2>&1
  echo "[$((SECONDS - start))s] exit $? ($family $2)"
  collect
}

# On an 80 GB GPU a model's all-HBM reference and a placement of half or less of its experts do not fit
# together for Qwen3-30B-A3B (58 GB of experts) and gpt-oss-120b (61 GB): there their cache rows run on a
# subset of their layers (24 of 48, 18 of 36; the JSON's model_family says which).
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
qwen_cache_layers=() big_cache_layers=()
if [ -n "$mib" ] && [ "$mib" -lt 100000 ]; then qwen_cache_layers=(--moe-layers 24) big_cache_layers=(--moe-layers 18); fi

want() {  # want FAMILY KIND: RUNS (e.g. "qwen3-30b-a3b:cache gpt-oss-20b:step") narrows what runs; unset: all
  [ -z "${RUNS:-}" ] || [[ " $RUNS " == *" $1:$2 "* ]]
}

want qwen3-30b-a3b cache && run qwen3-30b-a3b 150 bench cache --model-family qwen3-30b-a3b "${qwen_cache_layers[@]}" --residencies 0.5 --batches 1 --policies lru,lookahead --depths 1 --steps 32 --repeats 1 --out "$W/qwen3-30b-a3b"
want gpt-oss-20b cache && run gpt-oss-20b 130 bench cache --model-family gpt-oss-20b --residencies 0.5 --batches 1 --policies lru,lookahead --depths 1 --steps 32 --repeats 1 --out "$W/gpt-oss-20b"
want deepseek-v3 cache && run deepseek-v3 130 bench cache --model-family deepseek-v3 --moe-layers 4 --residencies 0.5 --batches 1 --policies lru,lookahead --depths 1 --steps 32 --repeats 1 --out "$W/deepseek-v3"
want gpt-oss-120b cache && run gpt-oss-120b 130 bench cache --model-family gpt-oss-120b "${big_cache_layers[@]}" --residencies 0.4,0.25 --batches 1 --policies lru,lookahead --depths 1 --steps 32 --repeats 1 --out "$W/gpt-oss-120b"
want gpt-oss-120b step && run gpt-oss-120b 90 bench step --model-family gpt-oss-120b --engines eager,compiled --reps 20 --rounds 2 --float32-check --out "$W/gpt-oss-120b"
want gpt-oss-20b step && run gpt-oss-20b 90 bench step --model-family gpt-oss-20b --engines eager,compiled --reps 20 --rounds 2 --float32-check --out "$W/gpt-oss-20b"
want deepseek-v3 step && run deepseek-v3 90 bench step --model-family deepseek-v3 --moe-layers 4 --engines eager,compiled --reps 20 --rounds 2 --float32-check --out "$W/deepseek-v3"
want qwen3-30b-a3b step && run qwen3-30b-a3b 70 bench step --model-family qwen3-30b-a3b --engines eager,compiled --reps 20 --rounds 2 --float32-check --out "$W/qwen3-30b-a3b"
want glm-4.5-air step && run glm-4.5-air 70 bench step --model-family glm-4.5-air --moe-layers 12 --engines eager,compiled --reps 20 --rounds 2 --float32-check --out "$W/glm-4.5-air"

collect
cat "$OUT/summary.md"
