#!/usr/bin/env bash
# The whole test suite: lint, then pytest (kernels run under the Triton interpreter on a CPU).
#
# Without arguments it runs in two parts. First the CPU-bound files that start no service and time nothing (the
# kernel tests under the Triton interpreter, the statistical tests of sampling): one process runs them in Python on
# one core, so two processes take about half the time (2-core machine: kernels 74 -> 36 s, statistical 200 -> 100 s).
# Then everything else in one process: the service, calibration and timing tests gained nothing in two processes
# there (the whole suite took 26+ min in two against 21 in one; BENCHMARKS.md, "Test-suite time").
# With arguments, one pytest run of them. SPECINFER_TEST_WORKERS=N runs everything on N worker processes
# (pytest-xdist; whole test files per worker, so a file's services start once): for machines with more cores.
source "$(dirname "$0")/env.sh"
ruff check .
ruff format --check .
workers="${SPECINFER_TEST_WORKERS:-1}"
if [ "$workers" -gt 1 ]; then
    exec python -m pytest -n "$workers" --dist loadfile "$@"
fi
if [ "$#" -gt 0 ]; then
    exec python -m pytest "$@"
fi
parallel=(tests/kernels tests/test_stochastic_engine.py tests/test_verify.py tests/test_coupled.py tests/test_head_sampling.py)
# one thread each for the BLAS libraries too (numpy's, under the interpreter), not only torch's (tests/conftest.py)
OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1 python -m pytest -n 2 --dist load "${parallel[@]}"
exec python -m pytest "${parallel[@]/#/--ignore=}"
