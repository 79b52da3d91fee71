#!/usr/bin/env bash
# Regenerates BENCHMARKS.md's "Adaptive speculation" section (issue 21): our incremental decoding,
# static trees (the paper's, the depth-8 sequence, the tuner's pick) and `auto`, rows of one run
# per table, at batch 4/8/16, at batch 1 in fp32 (with transformers' incremental and assisted
# generation), through the services at batch 1 and 8, on a weak-SSM pair, a concurrency trace
# 1 -> 16 -> 1, and batch 1 in bf16.
# Needs ../shared/models/pycode-a; makes /tmp/llm-1b (real 1B shapes) and /tmp/weak-ssm (the LLM cut
# to one layer) when missing. About 70 minutes on 2 CPU cores; run it on an otherwise idle machine.
set -euo pipefail
source "$(dirname "$0")/../scripts/env.sh"
PAIR=${PAIR:-../shared/models/pycode-a}
BIG=${BIG:-/tmp/llm-1b}
WEAK=${WEAK:-/tmp/weak-ssm}
OUT=${OUT:-bench/results/adaptive}
TUNED=bench/results/tuning-pycode-a-1b.json
TREES="1,1,3,1,1,1,1,1;$(python -c "import json; print(json.load(open('$TUNED'))['pick']['expansion'])")"
[ -f "$BIG/config.json" ] || python bench/inflate_llm.py "$PAIR/llm" "$BIG" --params 1e9
[ -f "$WEAK/config.json" ] || python bench/cut_layers.py "$PAIR/llm" "$WEAK" --layers 1
mkdir -p "$OUT"
COMMON=(--llm "$BIG" --prompts "$PAIR/prompts.jsonl" --new-tokens 32 --max-prompt-tokens 64 --temperatures 0)
python bench/compare.py "${COMMON[@]}" --ssm "$PAIR/ssm" --tuned "$TUNED" --trees "1,1,3,1,1,1,1,1" --count 16 --batch 4,8,16 --skip-hf --dtype float32 --out "$OUT/batch-float32"
python bench/compare.py "${COMMON[@]}" --ssm "$PAIR/ssm" --tuned "$TUNED" --trees "$TREES" --count 6 --batch 1 --dtype float32 --out "$OUT/b1-float32"
python bench/bench_service.py --llm "$BIG" --ssm "$PAIR/ssm" --prompts "$PAIR/prompts.jsonl" --count 8 --batch 1,8 --new-tokens 32 --skip-in-process --methods "none;auto;1,1,1,1,1,1,1,1;1,1,3,1,1,1,1,1" | tee "$OUT/services.md"
python bench/compare.py "${COMMON[@]}" --ssm "$WEAK" --trees "1,1,3,1,1,1,1,1" --count 6 --batch 1 --skip-hf --dtype float32 --out "$OUT/weak-b1-float32"
python bench/adaptive_trace.py --llm "$BIG" --ssm "$PAIR/ssm" --prompts "$PAIR/prompts.jsonl" --dtype float32 --phase-seconds 40 --out "$OUT/trace"
python bench/compare.py "${COMMON[@]}" --ssm "$PAIR/ssm" --tuned "$TUNED" --trees "$TREES" --count 4 --batch 1 --dtype bfloat16 --out "$OUT/b1-bfloat16"
