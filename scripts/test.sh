#!/usr/bin/env bash
# The whole test suite: lint, then pytest (kernels run under the Triton interpreter on a CPU).
# SPECINFER_TEST_WORKERS=N runs it on N worker processes (pytest-xdist; whole test files per worker, so
# a file's services start once). The default is 1: on the 2-core development VM two workers made the
# suite slower (37 min against 27), and the statistical tests ran past their time limit beside the
# service tests.
source "$(dirname "$0")/env.sh"
ruff check .
ruff format --check .
workers="${SPECINFER_TEST_WORKERS:-1}"
if [ "$workers" -gt 1 ]; then
    exec python -m pytest -n "$workers" --dist loadfile "$@"
fi
exec python -m pytest "$@"
