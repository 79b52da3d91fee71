"""What the README promises, the CLI does (issue 40), run as a user runs it (subprocesses of the
installed ``specinfer``): flags given are honoured (``--ssm`` without ``--llm``), SSMs are named by
one rule (folder name, ``NAME=PATH``, an error on a collision), the demo drafts with all its SSMs,
every subcommand's help shows its defaults, and ``generate`` prints the same headers in process and
through a server."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from services.harness import SPECINFER, SpecinferUp, processes_naming  # tests/services/harness.py

from specinfer.cli import SAYS_DEFAULT, _HelpFormatter, build_parser
from specinfer.client import Client

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "models/demo"
PROMPTS = ["def fibonacci(n):\n", "class Stack:\n"]


def specinfer(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "SPECINFER_DEMO_MODELS"}  # the bundled demo models
    env["COLUMNS"] = "200"  # --help: no line breaks inside a default
    return subprocess.run([str(SPECINFER), *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def up_with_ssms(tmp_path_factory):
    """``specinfer up --ssm fast=models/demo/ssm-1 --ssm models/demo/ssm-2``: no --llm."""
    state = tmp_path_factory.mktemp("up-ssms")
    env = {k: v for k, v in os.environ.items() if k != "SPECINFER_DEMO_MODELS"}
    up = SpecinferUp(
        [
            "--ssm",
            f"fast={DEMO / 'ssm-1'}",
            "--ssm",
            str(DEMO / "ssm-2"),
            "--port",
            "0",
            "--http-port",
            "0",
            "--state-dir",
            str(state),
        ],
        env,
    )
    try:
        yield up.wait_serving(), up
    finally:
        code = up.stop()
        assert code == 0, up.output
        assert processes_naming(str(state)) == []


def test_up_serves_the_given_ssms_with_the_demo_llm_named_by_folder_or_name(up_with_ssms):
    address, up = up_with_ssms
    with Client(address, timeout=60) as client:
        info = client.model_info()
    assert list(info.ssms) == ["fast", "ssm-2"]  # NAME=PATH, then the folder's name
    assert info.vocab_size == json.loads((DEMO / "llm/config.json").read_text())["vocab_size"]  # the demo LLM
    assert "ssm-worker-0" in up.members()


def test_generate_prints_the_same_headers_through_a_server_as_in_process(up_with_ssms):
    address, _ = up_with_ssms
    remote = specinfer("generate", "--server", address, "--max-new-tokens", "12", *PROMPTS)
    assert remote.returncode == 0, remote.stderr
    local = specinfer(
        "generate",
        "--llm",
        str(DEMO / "llm"),
        "--ssm",
        str(DEMO / "ssm-1"),
        "--dtype",
        "float32",
        "--max-new-tokens",
        "12",
        *PROMPTS,
    )
    assert local.returncode == 0, local.stderr
    for out in (remote.stdout, local.stdout):
        headers = re.findall(r"^--- (prompt|generated)\b.*$\n", out, re.M)
        assert headers == ["prompt", "generated"] * len(PROMPTS), out
        for prompt in PROMPTS:  # each prompt's text follows its header
            assert re.search(rf"^--- prompt.*\n{re.escape(prompt)}--- generated", out, re.M), out


def test_generate_prints_logprobs_through_a_server(up_with_ssms):
    """--logprobs N with --server: after the text, one line per output token (by ID: no tokenizer here), each with
    N alternatives."""
    address, _ = up_with_ssms
    remote = specinfer("generate", "--server", address, "--max-new-tokens", "6", "--logprobs", "2", PROMPTS[0])
    assert remote.returncode == 0, remote.stderr
    rows = remote.stdout.split("--- logprobs (position, token, logprob, alternatives)\n")[1].strip().splitlines()
    assert [row.split()[0] for row in rows] == [str(k) for k in range(6)], remote.stdout
    assert all(len(re.findall(r"#\d+ -?\d+\.\d{4}", row)) == 2 for row in rows), remote.stdout


def test_two_ssm_folders_of_one_name_are_an_error_saying_how_to_name_them(tmp_path):
    a, b = tmp_path / "a/ssm", tmp_path / "b/ssm"
    for args in (
        ["up", "--ssm", str(a), "--ssm", str(b)],
        ["generate", "--llm", str(DEMO / "llm"), "--ssm", str(a), "--ssm", str(b), "x"],
    ):
        out = specinfer(*args, timeout=120)
        assert out.returncode == 2, out
        assert (
            f"specinfer: error: --ssm: name 'ssm' is given twice ({a} and {b}): name them apart with NAME=PATH"
            in out.stderr
        ), out.stderr
    assert not list(tmp_path.glob("**/logs-*"))  # refused before anything started


def test_demo_drafts_with_all_three_ssms():
    out = specinfer("demo", "--in-process", "--max-new-tokens", "8", "--dtype", "float32")
    assert out.returncode == 0, out.stderr
    assert "drafting with ssm, ssm-1, ssm-2" in out.stdout and "adaptive trees over 3 SSM(s)" in out.stdout, out.stdout
    one = specinfer("demo", "--in-process", "--max-new-tokens", "8", "--dtype", "float32", "--one-ssm")
    assert re.search(r"drafting with ssm$", one.stdout, re.M) and "adaptive trees over 1 SSM(s)" in one.stdout, (
        one.stdout
    )


def test_every_subcommand_documents_its_flags_and_defaults():
    top = specinfer("--help", timeout=120).stdout
    parser = build_parser()
    (subcommands,) = [a for a in parser._actions if a.choices and isinstance(a.choices, dict)]
    for name, sub in subcommands.choices.items():
        assert re.search(rf"^\s+{re.escape(name)}\s+\S", top, re.M) or re.search(
            rf"^\s+{re.escape(name)}\n\s+\S", top, re.M
        ), f"{name} has no help line"
        formatter = _HelpFormatter(f"specinfer {name}")
        for action in sub._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, f"specinfer {name} {action.option_strings[0]} has no help"
                shown = formatter._get_help_string(action)
                assert action.required or SAYS_DEFAULT.search(shown) or "%(default)s" in shown, (
                    f"specinfer {name} {action.option_strings[0]} does not show its default: {shown!r}"
                )
    up = " ".join(specinfer("up", "--help", timeout=120).stdout.split())
    for flag, default in (
        ("--workers", "1"),
        ("--port", "50051"),
        ("--http-port", "8000"),
        ("--state-dir", "./specinfer-state"),
        ("--verifier-threads", "0"),
        ("--ssm-threads", "1"),
        ("--max-tree-nodes", "0"),
    ):
        assert re.search(rf"{flag} \S+ .*?\(default: {re.escape(default)}\)", up), (flag, up)
    gen = " ".join(specinfer("generate", "--help", timeout=120).stdout.split())
    assert "(default: 128)" in gen
    assert re.search(r"--expansion EXPANSION .*\[env SPECINFER_EXPANSION; default 'auto'\]", up), up
    tune = " ".join(specinfer("tune", "--help", timeout=120).stdout.split())
    assert re.search(r"--threads THREADS .*\(default: 0\)", tune), tune
    assert re.search(r"--out OUT where the result .*\(default: specinfer-tuning\.json\)", tune), tune


@pytest.mark.parametrize(
    "args, line",
    [
        (
            ["up", "--llm", "/nonexistent"],
            "--llm: '/nonexistent' is not a Hugging Face checkpoint folder (no such folder)",
        ),
        (["up", "--ssm", "/nonexistent/ssm"], "--ssm: '/nonexistent/ssm' is not a Hugging Face checkpoint folder"),
        (["up", "--expansion", "1,x"], "--expansion: expected comma-separated integers, got '1,x'"),
        (
            ["up", "--expansion", "2,2,2,1", "--max-tree-nodes", "60"],
            "--max-tree-nodes: the default tree (--expansion 2,2,2,1 with 3 SSMs) has up to 67 nodes, "
            "over --max-tree-nodes 60",
        ),
        (["up", "--request-managers", "0"], "--request-managers: must be at least 1, got 0"),
        (
            ["generate", "--llm", str(DEMO / "llm"), "--expansion", "1,x", "x"],
            "--expansion: expected comma-separated integers, got '1,x'",
        ),
        (
            ["tune", "--llm", str(DEMO / "llm"), "--ssm", str(DEMO / "ssm"), "--prompts", "/missing.jsonl"],
            "--prompts: cannot read '/missing.jsonl': No such file or directory",
        ),
    ],
)
def test_a_bad_setting_is_one_line_and_exit_2_before_anything_starts(args, line, tmp_path):
    """``up`` checks its folders, names and trees before it starts a process (it used to restart a member three
    times and print its traceback), ``generate`` its --expansion without SSMs, ``tune`` its prompts file."""
    extra = ["--state-dir", str(tmp_path / "state")] if args[0] == "up" else []
    out = specinfer(*args[:1], *extra, *args[1:], timeout=120)
    assert out.returncode == 2 and len(out.stderr.splitlines()) == 1, out
    assert out.stderr.startswith(f"specinfer: error: {line}"), out.stderr
    assert not (tmp_path / "state").exists()  # nothing started: no logs


def test_an_ssm_worker_refuses_a_missing_ssm_folder_in_one_line(tmp_path):
    """The SSM worker given --llm-dir (as ``up`` starts it) names the flag: no traceback from the vocabulary check."""
    out = subprocess.run(
        [sys.executable, "-m", "specinfer.ssm_worker", "--ssm", str(tmp_path / "ssm"), "--llm-dir", str(DEMO / "llm")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and len(out.stderr.splitlines()) == 1, out
    assert "--ssm (ssm.ssm)" in out.stderr and "is not a Hugging Face checkpoint folder" in out.stderr, out


def test_the_expansion_variable_chooses_generate_s_speculation(tmp_path):
    """``SPECINFER_EXPANSION`` is ``generate``'s --expansion default, as README says (it ran adaptive trees)."""
    (tmp_path / "tuning.json").write_text(json.dumps({"pick": {"expansion": "2,2,1"}}))
    env = {k: v for k, v in os.environ.items() if k != "SPECINFER_DEMO_MODELS"}
    env["SPECINFER_EXPANSION"] = f"@{tmp_path / 'tuning.json'}"
    args = ["generate", "--llm", str(DEMO / "llm"), "--ssm", str(DEMO / "ssm"), "--max-new-tokens", "4", "x"]
    out = subprocess.run(
        [str(SPECINFER), *args, "--dtype", "float32"], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr
    assert "tree <2,2,1> x 1 SSM(s)" in out.stdout, out.stdout


def _rss_gb(pid: int) -> float:
    kb = re.search(r"^VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)[1]
    return int(kb) / 1e6


def test_the_readme_memory_figures_are_what_the_demo_stack_uses(tmp_path):
    """README.md's RSS figures of ``specinfer up`` on the demo models, measured after a generation: each within
    0.7x-1.4x of what the processes use here (they were 2x too high once)."""
    readme = " ".join((REPO / "README.md").read_text().split())
    said = re.search(
        r"verifier (\d\.\d+) GB, SSM worker with three SSMs (\d\.\d+) GB, request manager (\d\.\d+) GB.*?"
        r"plus (\d\.\d+) GB for the `specinfer up` process",
        readme,
    )
    assert said, "README.md's memory figures moved: update this test"
    env = {k: v for k, v in os.environ.items() if k != "SPECINFER_DEMO_MODELS"}
    up = SpecinferUp(["--port", "0", "--http-port", "0", "--state-dir", str(tmp_path / "state")], env)
    try:
        address = up.wait_serving()
        with Client(address, timeout=300) as client:
            client.generate(Client.request(PROMPTS[0], 64))
        members = up.members()
        used = [_rss_gb(members[n][1]) for n in ("llm-verifier", "ssm-worker-0", "request-manager")]
        used.append(_rss_gb(up.popen.pid))
    finally:
        assert up.stop() == 0, up.output
    for name, figure, measured in zip(
        ("verifier", "SSM worker", "request manager", "up"), said.groups(), used, strict=True
    ):
        assert 0.7 <= measured / float(figure) <= 1.4, f"{name}: README says {figure} GB, it uses {measured:.2f} GB"
