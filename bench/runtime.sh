#!/usr/bin/env bash
# Regenerates BENCHMARKS.md's "Fast runtime" section: verify-step time by tree size (fp32 and bf16,
# our runtime with and without the measured matrix-product forms, transformers), then the
# side-by-side comparison in both dtypes at batch 1 and at batch 8 and 16.
# Needs ../shared/models/pycode-a; makes /tmp/llm-1b (an LLM with the shapes of a real 1B Llama:
# hidden 2048, 32/8 heads, MLP 8192, 16 layers) when missing. About 50 minutes on 2 CPU cores;
# run it on an otherwise idle machine.
set -euo pipefail
source "$(dirname "$0")/../scripts/env.sh"
PAIR=${PAIR:-../shared/models/pycode-a}
BIG=${BIG:-/tmp/llm-1b}
OUT=${OUT:-bench/results/runtime}
[ -f "$BIG/config.json" ] || python bench/inflate_llm.py "$PAIR/llm" "$BIG" --params 1e9
mkdir -p "$OUT"
python bench/bench_step.py --llm "$BIG" --dtype float32 --nodes 1,2,4,8,16,32,64 --steps 8 --warmup 2 | tee "$OUT/step-float32.md"
python bench/bench_step.py --llm "$BIG" --dtype bfloat16 --runtimes native,reference --nodes 1,2,4,8,16,32,64 --steps 5 --warmup 2 | tee "$OUT/step-bfloat16.md"
for dt in float32 bfloat16; do
    python bench/compare.py --llm "$BIG" --ssm "$PAIR/ssm" --prompts "$PAIR/prompts.jsonl" --count 10 --new-tokens 32 --max-prompt-tokens 64 \
        --trees "1,1,3,1,1,1,1,1;2,2,2,1,1,1,1,1" --batch 1 --temperatures 0 --dtype "$dt" --out "$OUT/b1-$dt"
done
for dt in bfloat16 float32; do
    python bench/compare.py --llm "$BIG" --ssm "$PAIR/ssm" --prompts "$PAIR/prompts.jsonl" --count 16 --new-tokens 32 --max-prompt-tokens 64 \
        --trees "1,1,3,1,1,1,1,1" --no-sequence --batch 8,16 --temperatures 0 --dtype "$dt" --out "$OUT/batch-$dt"
done
