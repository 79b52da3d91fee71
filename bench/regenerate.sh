#!/usr/bin/env bash
# Regenerates the comparison of BENCHMARKS.md ("Side by side"): the tuner's pick on the inflated
# LLM, the small pair's tokens per step (all methods, greedy and temperature 1, batch 1/8/16), the
# inflated pair's tokens/s (greedy, batch 1, 50 prompts) and its batch scaling (batch 1/8).
# Needs ../shared/models/pycode-a; makes /tmp/pycode-a-llm-1b and /tmp/pycode-a-ssm2 when missing.
# Takes about an hour on 2 CPU cores; run it on an otherwise idle machine.
set -euo pipefail
source "$(dirname "$0")/../scripts/env.sh"
PAIR=${PAIR:-../shared/models/pycode-a}
BIG=${BIG:-/tmp/pycode-a-llm-1b}
SSM2=${SSM2:-/tmp/pycode-a-ssm2}
OUT=${OUT:-bench/results}
THREADS=${THREADS:-2}
[ -f "$BIG/config.json" ] || python bench/inflate_llm.py "$PAIR/llm" "$BIG" --params 1e9
if [ ! -f "$SSM2/config.json" ]; then  # a second SSM for merged trees: the LLM's first 2 layers
    python - "$PAIR/llm" "$SSM2" <<'PY'
import shutil, sys
from transformers import AutoModelForCausalLM
from specinfer.models.tiny import truncated_copy
truncated_copy(AutoModelForCausalLM.from_pretrained(sys.argv[1]), 2).save_pretrained(sys.argv[2])
shutil.copy(f"{sys.argv[1]}/tokenizer.json", sys.argv[2])
PY
fi
mkdir -p "$OUT"
specinfer tune --llm "$BIG" --acceptance-llm "$PAIR/llm" --ssm "$PAIR/ssm" --prompts "$PAIR/prompts.jsonl" \
    --count 30 --offset 100 --new-tokens 64 --max-nodes 64 --threads "$THREADS" --out "$OUT/tuning-pycode-a-1b.json"
python bench/compare.py --llm "$PAIR/llm" --ssm "$PAIR/ssm" --ssm "$SSM2" --prompts "$PAIR/prompts.jsonl" --count 50 \
    --new-tokens 64 --trees "1,1,3,1,1,1,1,1;2,2,2,1,1,1,1,1;4,2,2,1,1,1,1,1" --tuned "$OUT/tuning-pycode-a-1b.json" \
    --batch 1,8,16 --temperatures 0,1 --threads 1 --out "$OUT/small"
python bench/compare.py --llm "$BIG" --ssm "$PAIR/ssm" --ssm "$SSM2" --prompts "$PAIR/prompts.jsonl" --count 50 \
    --new-tokens 32 --max-prompt-tokens 64 --trees "1,1,3,1,1,1,1,1" --tuned "$OUT/tuning-pycode-a-1b.json" \
    --batch 1 --temperatures 0 --no-incremental --threads "$THREADS" --out "$OUT/inflated"
python bench/compare.py --llm "$BIG" --ssm "$PAIR/ssm" --prompts "$PAIR/prompts.jsonl" --count 8 --new-tokens 32 \
    --max-prompt-tokens 64 --trees "1,1,3,1,1,1,1,1" --tuned "$OUT/tuning-pycode-a-1b.json" --batch 1,8 --temperatures 0 \
    --skip-hf --threads "$THREADS" --out "$OUT/inflated-batch"
