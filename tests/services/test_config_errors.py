"""Configuration errors of the services and the CLI, run as processes: a bad flag or environment value, a
KV budget that holds no request, a model folder that is missing or unreadable, a port in use. Each exits
with status 2 and one line on stderr, ``prog: error: ...``, naming the setting and a value that works; no
traceback. Fast: each fails before any model loads (the bundled demo pair supplies the folders)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from specinfer.core import InvalidArgument

DEMO = Path(__file__).resolve().parents[2] / "models/demo"
LLM, SSM = str(DEMO / "llm"), str(DEMO / "ssm")
VERIFIER, WORKER, MANAGER, CLI = (
    "specinfer.llm_verifier",
    "specinfer.ssm_worker",
    "specinfer.request_manager",
    "specinfer.cli",
)


def one_line_error(module: str, *argv: str, env: dict[str, str] | None = None) -> str:
    """The error line of ``python -m module argv`` (asserting exit status 2, a single line, no traceback)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SPECINFER_") or k == "SPECINFER_DTYPE"}
    proc = subprocess.run(
        [sys.executable, "-m", module, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env={**environ, **(env or {})},
    )
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert re.match(r"specinfer[\w -]*: error: ", lines[0]), lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    """Model folders that cannot be read: none at all, one without config.json, one with a corrupt config.json."""
    tmp = tmp_path_factory.mktemp("folders")
    (tmp / "empty").mkdir()
    (tmp / "corrupt").mkdir()
    (tmp / "corrupt/config.json").write_text('{"model_type": "llama", ')
    return {"missing": str(tmp / "missing"), "empty": str(tmp / "empty"), "corrupt": str(tmp / "corrupt")}


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize(
    ("module", "argv", "env", "expected"),
    [
        (
            VERIFIER,
            ["--llm", LLM],
            {"SPECINFER_PORT": "abc"},
            "--port (from SPECINFER_PORT): 'abc' is not an integer, e.g. 0",
        ),
        (
            WORKER,
            ["--ssm", SSM],
            {"SPECINFER_PREFIX_CACHING": "maybe"},
            "--prefix-caching (from SPECINFER_PREFIX_CACHING): 'maybe' is not on or off, e.g. on",
        ),
        (
            MANAGER,
            [],
            {"SPECINFER_MAX_BATCH": "x"},
            "--max-batch (from SPECINFER_MAX_BATCH): 'x' is not an integer, e.g. 32",
        ),
        (
            VERIFIER,
            ["--llm", LLM, "--kv-cache-bytes", "1e9"],
            {},
            "--kv-cache-bytes: '1e9' is not an integer, e.g. 1073741824",
        ),
        (
            CLI,
            ["generate", "--llm", LLM, "--max-new-tokens", "many", "x"],
            {},
            "--max-new-tokens: invalid int value: 'many'; e.g. --max-new-tokens 128",
        ),
        (
            CLI,
            ["generate", "--llm", LLM, "--device", "tpu", "x"],
            {},
            "--device: must be cpu, cuda or cuda:N, got 'tpu'",
        ),
        # no such device: none at all on a CPU machine ("sees no CUDA device here, e.g. cpu"), or too few
        (VERIFIER, ["--llm", LLM], {"SPECINFER_DEVICE": "cuda:9"}, "--device: 'cuda:9': "),
    ],
)
def test_bad_flag_or_environment_value(module, argv, env, expected):
    assert expected in one_line_error(module, *argv, env=env)


def test_a_flag_wins_over_a_bad_environment_value(taken_port):
    # the flag's value is used, not the environment's: the error is the next one found (the port in use)
    line = one_line_error(VERIFIER, "--llm", LLM, "--port", str(taken_port), env={"SPECINFER_PORT": "abc"})
    assert "--port: cannot listen on" in line


@pytest.mark.parametrize(
    ("module", "flag", "path", "budget", "block_size"),
    [(VERIFIER, "--llm", LLM, 3 << 20, "16"), (WORKER, "--ssm", SSM, 300_000, "0")],  # the SSM's KV rows are 8x smaller
)
def test_kv_budget_too_small_says_what_fits(module, flag, path, budget, block_size):
    line = one_line_error(
        module, flag, path, "--kv-cache-bytes", str(budget), "--kv-block-size", block_size, "--max-seq-len", "2048"
    )
    got = re.search(r"--kv-cache-bytes: .* give --kv-cache-bytes (\d+) or more, or --max-seq-len (\d+) or less$", line)
    assert got, line
    assert int(got.group(1)) > budget and 0 < int(got.group(2)) < 2048


@pytest.mark.parametrize(
    ("module", "flag", "case"),
    [
        (VERIFIER, "--llm", "missing"),
        (VERIFIER, "--llm", "empty"),
        (VERIFIER, "--llm", "corrupt"),
        (WORKER, "--ssm", "empty"),
        (MANAGER, "--model-dir", "corrupt"),
        (CLI, "--llm", "missing"),
    ],
)
def test_missing_or_unreadable_model_folder(module, flag, case, folders):
    argv = ["generate", flag, folders[case], "x"] if module == CLI else [flag, folders[case]]
    line = one_line_error(module, *argv)
    assert f"error: {flag}" in line and folders[case] in line
    assert {"missing": "no such folder", "empty": "no config.json", "corrupt": "cannot be read"}[case] in line


@pytest.mark.parametrize(
    ("module", "argv", "flag"),
    [
        (VERIFIER, ["--llm", LLM, "--port"], "--port"),
        (WORKER, ["--ssm", SSM, "--metrics-port"], "--metrics-port"),
        (MANAGER, ["--port"], "--port"),
        (MANAGER, ["--port", "0", "--http-port"], "--http-port"),
    ],
)
def test_port_in_use(module, argv, flag, taken_port):
    line = one_line_error(module, *argv, str(taken_port))
    assert f"error: {flag}: cannot listen on 127.0.0.1:{taken_port}" in line and "pick a free port, or 0" in line


def test_the_smallest_budget_and_the_longest_sequence_fit():
    """The values the budget error names work, and one byte less (one position more) does not."""
    from specinfer.models.dtypes import DTYPES
    from specinfer.models.native import ModelSpec, NativeOptions
    from specinfer.models.native.backend import check_kv_budget

    spec = ModelSpec.from_dir(Path(LLM))
    for block_size in (16, 0):
        options = NativeOptions(DTYPES["float32"], kv_cache_bytes=3 << 20, max_seq_len=1000, kv_block_size=block_size)
        with pytest.raises(InvalidArgument) as err:
            check_kv_budget(spec, options)
        budget, longest = map(
            int,
            re.search(r"--kv-cache-bytes (\d+) or more, or --max-seq-len (\d+) or less", err.value.message).groups(),
        )
        check_kv_budget(
            spec, NativeOptions(DTYPES["float32"], kv_cache_bytes=budget, max_seq_len=1000, kv_block_size=block_size)
        )
        check_kv_budget(
            spec,
            NativeOptions(DTYPES["float32"], kv_cache_bytes=3 << 20, max_seq_len=longest, kv_block_size=block_size),
        )
        with pytest.raises(InvalidArgument):
            check_kv_budget(
                spec,
                NativeOptions(DTYPES["float32"], kv_cache_bytes=budget - 1, max_seq_len=1000, kv_block_size=block_size),
            )
        with pytest.raises(InvalidArgument):
            check_kv_budget(
                spec,
                NativeOptions(
                    DTYPES["float32"], kv_cache_bytes=3 << 20, max_seq_len=longest + 1, kv_block_size=block_size
                ),
            )
