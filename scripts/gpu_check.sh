#!/usr/bin/env bash
# GPU bring-up (issue 39): one command on a bare GPU machine, from the source tree, with the machine's own
# torch and triton (no install: an import layout of symlinks, scripts/gpu_layout.py). Before the session run
# scripts/gpu_prepare.sh here: it fills .gpu/ (wheels the machine may lack, the pycode-a pair),
# which the device tool's `carry` ships.
#
#   scripts/gpu_check.sh [OUTDIR]             # default OUTDIR: $OUT (the device tool's output folder)
#   scripts/gpu_check.sh --dry-run OUTDIR     # on a CPU: the same steps, CUDA steps skipped, the plumbing run
#
# Steps run in order, most important first: correctness (kernel tests, native logits and greedy output vs
# transformers, the whole stack), then speed (tree-attention kernel, a 7B-class verify step, end-to-end
# comparison, offloading). Each has its own time box (`timeout`) and the whole run a deadline (480 s by default,
# SPECINFER_GPU_CHECK_SECONDS): a step that fails or times out is recorded (exit code, log file) and the next one
# runs. OUTDIR gets one log per step, the files the steps write, and summary.md / summary.json at the end.
#
# SPECINFER_GPU_CHECK_ONLY="step step ...": run only these steps (and layout and env), the others recorded as not
# selected: a rerun of what failed, when the device time left is short. The pytest steps run in
# SPECINFER_GPU_CHECK_WORKERS processes (default 8) where pytest-xdist is installed: the GPU machine has 16 cores,
# and Triton compiling each kernel variant is what costs there (one process passed 15 kernel tests in 70 s).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DRY=0
if [ "${1:-}" = "--dry-run" ]; then
    DRY=1
    shift
fi
OUTDIR="${1:-${OUT:-}}"
if [ -z "$OUTDIR" ]; then
    echo "usage: $0 [--dry-run] OUTDIR (or set OUT)" >&2
    exit 2
fi
mkdir -p "$OUTDIR"
OUTDIR="$(cd "$OUTDIR" && pwd)"
GPU_DIR="${SPECINFER_GPU_DIR:-$ROOT/.gpu}"
PY="${PYTHON:-python3}"
BUDGET="${SPECINFER_GPU_CHECK_SECONDS:-480}"
ONLY="${SPECINFER_GPU_CHECK_ONLY:-}"
WORKERS="${SPECINFER_GPU_CHECK_WORKERS:-8}"
START=$(date +%s)
DEADLINE=$((START + BUDGET - 10)) # 10 s for the summary
WORK="$(mktemp -d "${TMPDIR:-/tmp}/specinfer-gpu-check.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
STEPS="$OUTDIR/steps.tsv"
printf 'step\tstatus\texit_code\tseconds\tbox_seconds\tlog\n' >"$STEPS"
cd "$ROOT"

PAIR="$GPU_DIR/models/pycode-a"
INFLATE="$ROOT/bench/inflate_llm.py"
LLM7B="$WORK/llm-7b"
export SPECINFER_TEST_MODELS="$PAIR" # tests/conftest.py: the trained pair, since ../shared is not there
export PYTHONDONTWRITEBYTECODE=1     # nothing written into the tree

# run_step NAME BOX_SECONDS NEEDS_CUDA COMMAND...: COMMAND under `timeout` within the time box and the deadline,
# its output in OUTDIR/NAME.log, one line in steps.tsv. NEEDS_CUDA=1 steps are skipped without CUDA.
run_step() {
    local name="$1" box="$2" needs_cuda="$3"
    shift 3
    local log="$OUTDIR/$name.log" now left status rc=0
    # the boxes are sized for the GPU machine (16 cores, alone); a dry run shares a small CPU with other work
    [ "$DRY" = 1 ] && box=$((box * 3))
    now=$(date +%s)
    left=$((DEADLINE - now))
    [ "$box" -gt "$left" ] && box=$left
    if [ -n "$ONLY" ] && [ "$name" != layout ] && [ "$name" != env ] && [[ " $ONLY " != *" $name "* ]]; then
        status="skipped (not selected)"
        rc=""
        echo "skipped: not in SPECINFER_GPU_CHECK_ONLY" >"$log"
    elif [ "$needs_cuda" = 1 ] && [ "$HAS_CUDA" != 1 ]; then
        status="skipped (no CUDA)"
        rc=""
        echo "skipped: no CUDA device" >"$log"
    elif [ "$box" -lt 5 ]; then
        status="skipped (no time left)"
        rc=""
        echo "skipped: the run's deadline is near" >"$log"
    else
        echo "== $name (box ${box} s): $*" >&2
        # through bash -c: COMMAND may be one of the functions below (exported)
        timeout --kill-after=5 "$box" bash -c '"$@"' "$name" "$@" >"$log" 2>&1
        rc=$?
        case $rc in
            0) status=ok ;;
            124 | 137) status=timeout ;;
            *) status=failed ;;
        esac
    fi
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$(($(date +%s) - now))" "$box" "$name.log" >>"$STEPS"
    echo "== $name: $status${rc:+ (exit $rc)}" >&2
}

export PY WORK GPU_DIR PAIR INFLATE LLM7B OUTDIR

# 1. the import layout: the tree importable as `specinfer` (and the wheels the machine lacks unpacked beside it)
layout() {
    "$PY" scripts/gpu_layout.py "$WORK/layout" --wheels "$GPU_DIR/wheels" --check >"$WORK/pythonpath" || return 1
    echo "PYTHONPATH=$(tail -n1 "$WORK/pythonpath")"
}
export -f layout
HAS_CUDA=0
run_step layout 60 0 layout
if [ -s "$WORK/pythonpath" ]; then
    export PYTHONPATH="$(tail -n1 "$WORK/pythonpath")"
fi
[ "$DRY" = 0 ] && "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null && HAS_CUDA=1

# 2. the machine: versions, the device, its copy bandwidths
run_step env 30 0 "$PY" - "$OUTDIR/env.json" <<'EOF'
import json, platform, statistics, sys
import numpy, torch, transformers
info = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "numpy": numpy.__version__, "cuda": torch.cuda.is_available()}
try:
    import triton
    info["triton"] = triton.__version__
except ImportError:
    info["triton"] = None
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info |= {"device": p.name, "capability": f"{p.major}.{p.minor}", "memory_gib": round(p.total_memory / 2**30, 1), "torch_cuda": torch.version.cuda}
    def gbs(dst, src, nbytes, reads_and_writes):
        for _ in range(3):
            dst.copy_(src)
        times = []
        for _ in range(10):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); dst.copy_(src, non_blocking=True); b.record(); b.synchronize()
            times.append(a.elapsed_time(b) * 1e-3)
        return round(reads_and_writes * nbytes / statistics.median(times) / 1e9, 1)
    n = 1 << 30
    d1, d2 = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, device="cuda")
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    info["copy_gbs"] = {"device_to_device (read + write)": gbs(d2, d1, n, 2), "host_to_device (pinned)": gbs(d1, host, n, 1),
                        "device_to_host (pinned)": gbs(host, d1, n, 1)}
json.dump(info, open(sys.argv[1], "w"), indent=1)
print(json.dumps(info, indent=1))
EOF

# pytest_step NAME BOX NEEDS_CUDA TEST_DEVICE PYTEST_ARGS...: the models of tests/devices.py on TEST_DEVICE, a JUnit file
# (in WORKERS processes where pytest-xdist is there; PARALLEL=0 before the call keeps one, for tests that start services)
XDIST=0
"$PY" -c 'import xdist' 2>/dev/null && [ "$WORKERS" -gt 1 ] && XDIST=1
pytest_step() {
    local name="$1" box="$2" cuda="$3" device="$4" parallel=()
    shift 4
    [ "$XDIST" = 1 ] && [ "${PARALLEL:-1}" = 1 ] && parallel=(-n "$WORKERS")
    run_step "$name" "$box" "$cuda" env SPECINFER_TEST_DEVICE="$device" "$PY" -m pytest -q -rfEs -p no:cacheprovider \
        "${parallel[@]}" --junitxml="$OUTDIR/$name.xml" "$@"
}

# 3. correctness on CUDA
if [ "$HAS_CUDA" != 1 ]; then # what the CUDA steps would run, collected: the layout, the markers, the imports
    run_step collect-gpu-tests 60 0 "$PY" -m pytest -q --collect-only -p no:cacheprovider -m gpu tests/kernels tests/e2e/test_stack_gpu.py \
        tests/test_native.py tests/test_model_families.py tests/test_greedy_equivalence.py
fi
pytest_step kernel-tests 60 1 cuda -m gpu tests/kernels
# CUDA graphs (on by default on CUDA, so the steps below replay them too): captured steps against eager ones
pytest_step graphs 60 1 cuda tests/test_graphs.py
pytest_step native-vs-transformers 75 1 cuda tests/test_native.py tests/test_model_families.py \
    -k "transformers or incremental_expansion or packed_step_runs"
# fp32 error of each path (transformers and ours, CPU and device, PyTorch attention and the kernel) against fp64
precision_models=()
[ "$DRY" = 1 ] && precision_models=(--models gemma2-capped) # the plumbing: one model is enough on a CPU
run_step precision 40 0 "$PY" scripts/gpu_precision.py "${precision_models[@]}"
pytest_step greedy-equivalence 75 1 cuda tests/test_greedy_equivalence.py
# the services start and calibrate on the device (40 s was not enough on the H100)
PARALLEL=0 pytest_step stack 90 1 cuda -m gpu tests/e2e/test_stack_gpu.py

# 4. speed: the tree-attention kernel against masked SDPA and the copy bandwidth
if [ "$HAS_CUDA" = 1 ]; then
    run_step bench-tree-attention 35 1 "$PY" bench/bench_tree_attention.py --trees 16 64 256 --prefixes 512 4096 8192 \
        --batches 1 16 --impl triton --impl sdpa --dtype bf16 --warmup 3 --iters 10
else # the same script on the CPU, one small case (PyTorch SDPA)
    run_step bench-tree-attention 35 0 "$PY" bench/bench_tree_attention.py --trees 16 --prefixes 64 --batches 1 --impl sdpa \
        --warmup 0 --iters 1
fi

# 5. a 7B-class LLM (the pair's LLM inflated: same logits, real shapes), made on the device in bf16
inflate() {
    local args=("$PAIR/llm" "$LLM7B" --params 7e9 --hidden 4096 --heads 32 --kv-heads 8 --mlp-dim 14336 --dtype bfloat16)
    # parameters made on the GPU (fast random init); save_pretrained copies them to the host
    "$PY" -c 'import runpy, sys, torch; torch.set_default_device("cuda"); sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name="__main__")' \
        "$INFLATE" "${args[@]}" && return 0
    echo "inflating on the GPU failed; on the CPU instead" >&2
    rm -rf "$LLM7B"
    "$PY" "$INFLATE" "${args[@]}"
}
export -f inflate
run_step inflate-7b 75 1 inflate
have_7b() { [ -f "$LLM7B/config.json" ] || { echo "no 7B checkpoint (inflate-7b failed)" >&2; return 1; }; }
# native replays CUDA graphs, native-eager does not
verify_step() { have_7b && "$PY" bench/bench_step.py --llm "$LLM7B" --runtimes native,native-eager --device cuda --dtype bfloat16 \
    --batch 1 --prefix 512 --nodes 1,2,4,8,16,32,64,128 --steps 5 --warmup 2 --kv-cache-bytes 4e9 --profile; }
export -f have_7b verify_step
run_step verify-step-7b 60 1 verify_step  # 32 s on the H200 for native alone, with --profile
# our rows only (transformers' are in BENCHMARKS.md): incremental, the best static tree of the H200 run and the
# default (auto), 64 new tokens, after the load's CUDA-graph warm-up; it prints the load time and the captures after it
compare() { have_7b && "$PY" bench/compare.py --llm "$LLM7B" --ssm "$PAIR/ssm" --prompts "$PAIR/prompts.jsonl" --count 8 \
    --new-tokens 64 --max-prompt-tokens 256 --batch 1,8 --temperatures 0 --trees "2,2,2,1" --no-sequence --skip-hf \
    --dtype bfloat16 --device cuda --threads 4 --out "$OUTDIR/compare"; }
export -f compare
run_step compare-7b 180 1 compare
# offloading: the 7B model (about 14 GB in bf16) within 6 GB of device memory, beside the resident one
offload() { have_7b && "$PY" bench/offload.py --llm "$LLM7B" --ssm "$PAIR/ssm" --prompts "$PAIR/prompts.jsonl" --device cuda \
    --dtype bfloat16 --offload-reserve-bytes 6000000000 --requests 1 --new-tokens 16 --repeats 1 --expansion 1,1,3,1 \
    --json "$OUTDIR/offload.json"; }
export -f offload
run_step offload 45 1 offload

# 6. what time is left: the rest of the kernel tests (those that run on the `device` fixture) on CUDA
pytest_step kernel-tests-rest 60 1 cuda -m "not gpu" tests/kernels

# summary: steps.tsv as markdown and JSON
"$PY" - "$OUTDIR" "$DRY" "$START" <<'EOF'
import csv, json, sys, time
from pathlib import Path
out, dry, start = Path(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[3])
steps = list(csv.DictReader(open(out / "steps.tsv"), delimiter="\t"))
env = json.loads((out / "env.json").read_text()) if (out / "env.json").is_file() else {}
summary = {"dry_run": dry, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "seconds": int(time.time()) - start, "env": env, "steps": steps,
           "failed": [s["step"] for s in steps if s["status"] in ("failed", "timeout")]}
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
lines = [f"# GPU check{' (dry run)' if dry else ''}: {env.get('device', 'no CUDA device')}, {summary['date']}, {summary['seconds']} s", "",
         f"torch {env.get('torch')}, triton {env.get('triton')}, transformers {env.get('transformers')}, python {env.get('python')}",
         f"copy bandwidth (GB/s): {env.get('copy_gbs', '-')}", "",
         "| step | status | exit | seconds | box | log |", "| --- | --- | ---: | ---: | ---: | --- |"]
lines += [f"| {s['step']} | {s['status']} | {s['exit_code']} | {s['seconds']} | {s['box_seconds']} | {s['log']} |" for s in steps]
(out / "summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
exit 0
