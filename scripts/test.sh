#!/usr/bin/env bash
# The whole test suite: lint, then pytest (kernels run under the Triton interpreter on a CPU).
source "$(dirname "$0")/env.sh"
ruff check .
ruff format --check .
exec python -m pytest "$@"
