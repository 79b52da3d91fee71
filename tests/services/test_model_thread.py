"""Each model of a service does all its torch work in one thread (specinfer.serving.runner.ModelThread): its loading,
its start-up calibration and every call. PyTorch runs a CPU operation's parallel part on an OpenMP team of the calling
thread, and a second thread's team slows both for the process's life (BENCHMARKS.md, "One OpenMP team per service"),
so a model loaded on the main thread and called from another paid that every step."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from specinfer.serving import runner
from specinfer.serving.metrics import ModelMetrics

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "models/demo"
QUICK = ("--calibrate-tokens", "2", "--calibration-cache", "off")  # a start-up calibration of seconds, not cached


def spy_threads(monkeypatch) -> list[tuple[str, str]]:
    """(what, thread name) of every model load and calibration of the services' start-up."""
    seen: list[tuple[str, str]] = []

    def spy(what, real):
        def wrapped(*args, **kwargs):
            seen.append((what, threading.current_thread().name))
            return real(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(runner, "load_backend", spy("load", runner.load_backend))
    monkeypatch.setattr(runner, "calibrate_costs", spy("calibrate", runner.calibrate_costs))
    monkeypatch.setattr(runner, "calibrate_table", spy("calibrate", runner.calibrate_table))
    return seen


def call_thread(model_runner: runner.ModelRunner) -> str:
    return asyncio.run(model_runner.call(lambda model: threading.current_thread().name))


def test_the_verifier_loads_calibrates_and_serves_its_model_in_one_thread(monkeypatch):
    from specinfer.llm_verifier.__main__ import build_parser, load_servicer

    seen = spy_threads(monkeypatch)
    argv = ["--llm", str(DEMO / "llm"), *QUICK, "--model-calls", "thread"]
    servicer = load_servicer(build_parser().parse_args(argv), ModelMetrics(CollectorRegistry(), "llm"))
    serving = call_thread(servicer.runner)
    assert serving.startswith("model-") and serving != threading.main_thread().name
    assert [what for what, _ in seen] == ["load", "calibrate"] and {name for _, name in seen} == {serving}


def test_each_ssm_of_a_worker_loads_calibrates_and_drafts_in_its_own_thread(monkeypatch):
    from specinfer.ssm_worker.__main__ import build_parser, load_servicer

    seen = spy_threads(monkeypatch)
    ssm = DEMO / "ssm"
    argv = ["--ssm", f"a={ssm},b={ssm}", *QUICK, "--model-calls", "thread"]
    servicer = load_servicer(build_parser().parse_args(argv), ModelMetrics(CollectorRegistry(), "ssm"))
    serving = {name: call_thread(servicer._runner(name)) for name in ("a", "b")}
    assert serving["a"] != serving["b"] and all(n.startswith("model-") for n in serving.values())
    assert [name for what, name in seen if what == "load"] == [serving["a"], serving["b"]]
    assert [name for what, name in seen if what == "calibrate"] == [serving["a"], serving["b"]]


def test_inline_calls_load_calibrate_and_serve_on_the_thread_that_runs_the_event_loop(monkeypatch):
    """``--model-calls inline`` (the default): no model thread; the main thread loads, calibrates and, running the
    event loop, makes every call (one OpenMP team still)."""
    from specinfer.llm_verifier.__main__ import build_parser, load_servicer

    seen = spy_threads(monkeypatch)
    args = build_parser().parse_args(["--llm", str(DEMO / "llm"), *QUICK])
    assert args.model_calls == "inline"
    servicer = load_servicer(args, ModelMetrics(CollectorRegistry(), "llm"))
    main = threading.main_thread().name
    assert call_thread(servicer.runner) == main
    assert [what for what, _ in seen] == ["load", "calibrate"] and {name for _, name in seen} == {main}


def test_a_model_calls_setting_that_is_neither_is_refused_naming_it():
    from specinfer.core import InvalidArgument
    from specinfer.ssm_worker.__main__ import build_parser, load_servicer

    args = build_parser().parse_args(["--ssm", str(DEMO / "ssm"), "--model-calls", "fibers"])
    with pytest.raises(InvalidArgument, match="fibers") as caught:
        load_servicer(args, ModelMetrics(CollectorRegistry(), "ssm"))
    assert caught.value.field == "model-calls"
