#!/usr/bin/env bash
# The whole test suite: lint, then pytest (kernels run under the Triton interpreter on a CPU), on
# SPECINFER_TEST_WORKERS processes (default: one per CPU core, at most 4; 0: in this process alone).
# Each worker takes whole test files (--dist loadfile): a file's services start once, in one worker.
source "$(dirname "$0")/env.sh"
ruff check .
ruff format --check .
workers="${SPECINFER_TEST_WORKERS:-$(python -c 'import os; print(min(4, len(os.sched_getaffinity(0))))')}"
if [ "$workers" -gt 1 ]; then
    exec python -m pytest -n "$workers" --dist loadfile "$@"
fi
exec python -m pytest "$@"
