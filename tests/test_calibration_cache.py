"""The calibration cache (specinfer.engine.calibration_cache), the cold cost probe, and their use by
the engine, ``specinfer generate`` and the services; ``specinfer generate --offload``.

Tiny random models built here (never ../shared), fp32, CPU."""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest
import torch

from specinfer import cli
from specinfer.core.costs import BUCKETS, CostTable, StepCosts, VerifyShape
from specinfer.core.requests import GenerationRequest, SamplingParams, SpeculationConfig
from specinfer.engine import calibrate
from specinfer.engine import engine as engine_module
from specinfer.engine.calibration_cache import (
    ENV,
    FORMAT_VERSION,
    CalibrationCache,
    CalibrationKey,
    CostEntry,
    ModelIdentity,
    ModelRuntime,
    cache_dir,
    checkpoint_digest,
    costs_from_json,
    costs_to_json,
    engine_cost_entry,
)
from specinfer.engine.engine import EngineConfig, SpeculativeEngine
from specinfer.models.loading import load_backend
from specinfer.models.tiny import TinySpec, build_tiny_pair

FP32 = ModelRuntime("float32", "cpu", "auto", "auto")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny LLM (vocabulary with a byte tokenizer, so the CLI can encode text) and its 1-layer SSM."""
    return build_tiny_pair(tmp_path_factory.mktemp("calib-pair"), TinySpec(layers=2, ssm_layers=1))


@pytest.fixture
def threads():
    """Restores torch's thread count after a test that changes it."""
    saved = torch.get_num_threads()
    yield
    torch.set_num_threads(saved)


def test_cache_folder_from_flag_environment_and_default():
    from pathlib import Path

    assert cache_dir("/x/cal", {ENV: "/y"}) == cache_dir("/x/cal", {}) == cache_dir(" /x/cal ", {})
    assert str(cache_dir("/x/cal", {})) == "/x/cal"
    assert str(cache_dir("", {ENV: "/y"})) == "/y"  # the flag wins over the variable, which wins over the default
    assert str(cache_dir("", {"XDG_CACHE_HOME": "/xdg"})) == "/xdg/specinfer/calibration"
    assert cache_dir("", {"XDG_CACHE_HOME": ""}) == cache_dir("", {}) == Path.home() / ".cache/specinfer/calibration"
    for off in ("none", "off", "OFF", " None "):
        assert cache_dir(off, {ENV: "/y"}) is None
        assert cache_dir("", {ENV: off}) is None
    assert CalibrationCache.from_setting("none", {}).root is None


def test_key_changes_with_what_changes_the_costs(pair, tmp_path, threads):
    llm, ssm = pair
    base = CalibrationKey.build("engine", [ModelIdentity.of(llm, FP32)], {"max_tokens": 64})
    assert base == CalibrationKey.build("engine", [ModelIdentity.of(llm, FP32)], {"max_tokens": 64})  # stable
    names = {base.file_name()}

    def differs(key: CalibrationKey) -> None:
        assert key.file_name() not in names
        names.add(key.file_name())

    differs(
        CalibrationKey.build(
            "engine", [ModelIdentity.of(llm, ModelRuntime("bfloat16", "cpu", "auto", "auto"))], {"max_tokens": 64}
        )
    )
    differs(
        CalibrationKey.build(
            "engine", [ModelIdentity.of(llm, ModelRuntime("float32", "cpu", "reference", "auto"))], {"max_tokens": 64}
        )
    )
    differs(
        CalibrationKey.build(
            "engine",
            [ModelIdentity.of(llm, ModelRuntime("float32", "cpu", "auto", "auto", kv_block_size=16))],
            {"max_tokens": 64},
        )
    )
    differs(
        CalibrationKey.build(
            "engine",
            [ModelIdentity.of(llm, ModelRuntime("float32", "cpu", "auto", "auto", offload=True))],
            {"max_tokens": 64},
        )
    )
    differs(CalibrationKey.build("engine", [ModelIdentity.of(llm, FP32)], {"max_tokens": 32}))
    differs(CalibrationKey.build("verifier", [ModelIdentity.of(llm, FP32)], {"max_tokens": 64}))
    differs(
        CalibrationKey.build("engine", [ModelIdentity.of(llm, FP32), ModelIdentity.of(ssm, FP32)], {"max_tokens": 64})
    )
    torch.set_num_threads(1 if torch.get_num_threads() != 1 else 2)
    differs(CalibrationKey.build("engine", [ModelIdentity.of(llm, FP32)], {"max_tokens": 64}))


def test_checkpoint_digest_follows_config_and_weights(pair, tmp_path):
    import shutil

    copy = tmp_path / "llm"
    shutil.copytree(pair[0], copy)
    first = checkpoint_digest(copy)
    assert first == checkpoint_digest(copy)
    (copy / "tokenizer.json").write_text((copy / "tokenizer.json").read_text() + " ")  # not a cost: same digest
    assert checkpoint_digest(copy) == first
    config = json.loads((copy / "config.json").read_text())
    config["num_hidden_layers"] += 1
    (copy / "config.json").write_text(json.dumps(config))
    second = checkpoint_digest(copy)
    assert second != first
    (weights,) = copy.glob("*.safetensors")
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # new weights: a new modification time
    assert checkpoint_digest(copy) != second


def _refined_costs() -> StepCosts:
    costs = StepCosts(CostTable({1: 0.01, 8: 0.02}), 1e-7, {0: CostTable({1: 0.001, 4: 0.002})})
    for tokens, seconds in ((5, 0.03), (40, 0.09), (3, 0.012)):
        costs.observe_verify(VerifyShape(tokens, 100), seconds)
    costs.observe_draft(0, 2, 0.004)
    costs.observe_overhead(0.002)
    return costs


def test_cost_model_round_trips_through_json():
    costs = _refined_costs()
    back = costs_from_json(json.loads(json.dumps(costs_to_json(costs))))
    assert back.describe() == costs.describe()
    np.testing.assert_array_equal(back.verify_table.samples, costs.verify_table.samples)  # raw state, not a refit
    # and it refines on exactly as the saved one would have
    for c in (costs, back):
        c.observe_verify(VerifyShape(7, 50), 0.05)
    assert back.describe() == costs.describe()
    for bad in (
        {**costs_to_json(costs), "overhead": -1.0},
        {**costs_to_json(costs), "verify": {"buckets": [5], "seconds": [1.0], "samples": [1.0]}},
    ):
        with pytest.raises(ValueError):
            costs_from_json(bad)


def _entry(tmp_path, pair) -> CostEntry:
    llm, ssm = pair
    return engine_cost_entry(
        CalibrationCache(tmp_path / "cache"), ModelIdentity.of(llm, FP32), [ModelIdentity.of(ssm, FP32)], ["shared"]
    )


def test_corrupt_or_stale_entry_is_ignored_logged_once_and_rewritten(tmp_path, pair, caplog):
    entry = _entry(tmp_path, pair)
    path = entry.cache.path(entry.key)
    assert entry.load_costs() is None and not path.exists()  # a miss: nothing logged
    entry.save_costs(_refined_costs())
    assert entry.load_costs().describe() == _refined_costs().describe()
    saved = json.loads(path.read_text())
    assert saved["version"] == FORMAT_VERSION and saved["key"] == entry.key.as_json()
    caplog.set_level(logging.WARNING, logger="specinfer.calibrate")
    broken = [
        "{not json",
        json.dumps({**saved, "version": FORMAT_VERSION + 1}),  # stale: another format
        json.dumps({**saved, "key": {**saved["key"], "threads": saved["key"]["threads"] + 1}}),  # stale: another key
        json.dumps(
            {
                **saved,
                "payload": {**saved["payload"], "verify": {"buckets": [1, 2], "seconds": [1.0], "samples": [1.0]}},
            }
        ),
        json.dumps({**saved, "payload": {"verify": None}}),
    ]
    for text in broken:
        fresh = _entry(tmp_path, pair)  # a new process's cache: logs each problem once
        path.write_text(text)
        caplog.clear()
        assert fresh.load_costs() is None and fresh.load_costs() is None
        assert len([r for r in caplog.records if "ignoring" in r.getMessage()]) == 1, text
        fresh.save_costs(_refined_costs())  # rewritten
        assert fresh.load_costs().describe() == _refined_costs().describe()
    path.write_bytes(b"\xff\xfe\x00")
    assert _entry(tmp_path, pair).load_costs() is None


def test_write_failure_and_disabled_cache_never_raise(tmp_path, pair):
    blocked = tmp_path / "file"
    blocked.write_text("")
    key = CalibrationKey.build("engine", [ModelIdentity.of(pair[0], FP32)], {})
    CostEntry(CalibrationCache(blocked / "cache"), key).save_costs(
        _refined_costs()
    )  # a file where the folder should be
    off = CostEntry(CalibrationCache(None), key)
    off.save_costs(_refined_costs())
    assert off.load_costs() is None and off.cache.path(key) is None


def test_cache_keeps_at_most_max_entries(tmp_path, pair, monkeypatch):
    from specinfer.engine import calibration_cache

    monkeypatch.setattr(calibration_cache, "MAX_ENTRIES", 3)
    cache = CalibrationCache(tmp_path / "cache")
    llm, _ = pair
    for n in range(5):
        CostEntry(cache, CalibrationKey.build("engine", [ModelIdentity.of(llm, FP32)], {"n": n})).save_costs(
            _refined_costs()
        )
    assert len(list((tmp_path / "cache").glob("*.json"))) == 3


def test_probe_is_quick_and_sane(pair):
    llm_path, ssm_path = pair
    llm, ssm = load_backend(llm_path, "llm", "float32"), load_backend(ssm_path, "ssm", "float32")
    costs = calibrate.probe_costs(llm, [ssm], calibrate.ProbeConfig(seconds=0.2))
    for table in (costs.verify_table, costs.drafts[0]):
        measured = table.as_dict()
        assert {1, 4} <= set(measured)  # always two sizes at least: one alone would make extra nodes look free
        assert all(s > 0 for s in measured.values())
        assert list(measured.values()) == sorted(measured.values())
    assert not llm.cached_requests() and not ssm.cached_requests()  # the probe's request is released
    # a budget far too small still times the two first sizes, and nothing else
    tiny = calibrate.probe_table(llm, (1, 8, 16, 4), 0.0, 3, "t")
    assert set(tiny.as_dict()) == {1, 2, 3, 4, 6, 8}  # buckets up to 8, from the two sizes timed
    # a roomy one times every size it is given, in at most its rounds
    roomy = calibrate.probe_table(llm, (1, 4, 64), 30.0, 2, "t")
    assert set(roomy.as_dict()) == {b for b in BUCKETS if b <= 64}


def test_probe_predicts_a_call_from_the_two_largest_sizes():
    assert calibrate._predicted_seconds({1: [0.2], 4: [0.5, 0.6]}, 4) == 0.6  # its size's last call
    assert calibrate._predicted_seconds({1: [0.2], 4: [0.5]}, 8) == pytest.approx(0.5 + 0.1 * 4)
    assert calibrate._predicted_seconds({1: [0.11], 4: [0.10]}, 64) == pytest.approx(0.10)  # flat: never falling
    assert calibrate._predicted_seconds({1: [0.2]}, 8) == 0.2


def _requests(n: int = 2):
    prompts = [[5, 6, 7, 8], [9, 10, 11]][:n]
    return [
        GenerationRequest(f"r{i}", tuple(p), 12, SamplingParams(), SpeculationConfig(None, ssms=(0,)))
        for i, p in enumerate(prompts)
    ]


class _Counting:
    """A model that counts its forward calls."""

    def __init__(self, model) -> None:
        self.model = model
        self.calls = 0

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward_tree(self, batch):
        self.calls += 1
        return self.model.forward_tree(batch)


def test_engine_probes_once_then_reads_the_refined_model(tmp_path, pair, monkeypatch):
    llm_path, ssm_path = pair
    probes = []
    real_probe = engine_module.probe_costs
    monkeypatch.setattr(engine_module, "probe_costs", lambda llm, ssms: probes.append(1) or real_probe(llm, ssms))
    entry = _entry(tmp_path, pair)
    llm = load_backend(llm_path, "llm", "float32")
    ssm = load_backend(ssm_path, "ssm", "float32")
    first = SpeculativeEngine(llm, [ssm], EngineConfig(), cost_entry=entry)
    out1 = [r.output_tokens for r in first.generate(_requests())]
    assert probes == [1]
    saved = entry.load_costs()
    assert (
        saved is not None and saved.describe() == first.adaptive.costs.describe()
    )  # the refined model, as the run left it
    assert saved.overhead > 0  # learned from the run, not probed

    def no_probe(llm, ssms):
        raise AssertionError("a cached cost model must not be probed again")

    monkeypatch.setattr(engine_module, "probe_costs", no_probe)
    counted = _Counting(load_backend(llm_path, "llm", "float32"))
    second = SpeculativeEngine(
        counted, [load_backend(ssm_path, "ssm", "float32")], EngineConfig(), cost_entry=_entry(tmp_path, pair)
    )
    results = second.generate(_requests())
    assert [r.output_tokens for r in results] == out1  # greedy: the same tokens
    assert counted.calls == max(r.llm_steps for r in results)  # one verify call per iteration: no timing calls


def test_engine_without_cache_folder_still_probes_quickly(pair, monkeypatch):
    llm_path, ssm_path = pair
    probes = []
    real_probe = engine_module.probe_costs
    monkeypatch.setattr(engine_module, "probe_costs", lambda llm, ssms: probes.append(1) or real_probe(llm, ssms))
    monkeypatch.setattr(
        engine_module, "calibrate_costs", lambda *a, **k: pytest.fail("the full calibration must not run")
    )
    entry = engine_cost_entry(
        CalibrationCache(None), ModelIdentity.of(llm_path, FP32), [ModelIdentity.of(ssm_path, FP32)], ["shared"]
    )
    engine = SpeculativeEngine(
        load_backend(llm_path, "llm", "float32"),
        [load_backend(ssm_path, "ssm", "float32")],
        EngineConfig(),
        cost_entry=entry,
    )
    engine.generate(_requests(1))
    assert probes == [1]


def _generate(pair, *flags: str) -> list[str]:
    llm, ssm = pair
    return [
        "generate",
        "--llm",
        str(llm),
        "--ssm",
        str(ssm),
        "--dtype",
        "float32",
        "--max-new-tokens",
        "10",
        *flags,
        "def f(x):",
        "class A:",
    ]


def _text(out: str) -> list[str]:
    """The prompts and generated text of ``specinfer generate``'s output, without its statistics (which follow the
    plans)."""
    lines = [line for line in out.splitlines() if not line.startswith(("===", "--- LLM steps"))]
    assert any(line.startswith("--- generated") for line in lines)
    return lines


def test_cli_second_run_reads_the_cache(tmp_path, pair, monkeypatch, capsys):
    cache = tmp_path / "cli-cache"
    assert cli.main(_generate(pair, "--calibration-cache", str(cache))) == 0
    first = capsys.readouterr().out
    (entry,) = cache.glob("engine-*.json")
    assert json.loads(entry.read_text())["key"]["kind"] == "engine"
    monkeypatch.setattr(
        engine_module, "probe_costs", lambda llm, ssms: pytest.fail("a cached cost model must not be probed again")
    )
    assert cli.main(_generate(pair, "--calibration-cache", str(cache))) == 0
    second = capsys.readouterr().out
    assert _text(first) == _text(second)
    # the variable names the folder when the flag does not; a new dtype is a new entry
    monkeypatch.setenv(ENV, str(cache))
    monkeypatch.setattr(engine_module, "probe_costs", calibrate.probe_costs)
    assert cli.main(_generate(pair, "--backend", "reference")) == 0
    assert len(list(cache.glob("engine-*.json"))) == 2


def test_cli_calibration_cache_none_writes_nothing(tmp_path, pair, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv(ENV, raising=False)
    assert cli.main(_generate(pair, "--calibration-cache", "none")) == 0
    monkeypatch.setenv(ENV, "off")
    assert cli.main(_generate(pair)) == 0
    assert not any(p.is_file() for p in tmp_path.rglob("*"))
    monkeypatch.delenv(ENV)
    assert cli.main(_generate(pair)) == 0  # the default folder
    assert len(list((tmp_path / "xdg/specinfer/calibration").glob("engine-*.json"))) == 1


def test_cli_offload_generates_the_same_tokens(tmp_path, pair, monkeypatch, capsys):
    from specinfer.models import loading

    loaded = []
    real = loading.load_backend

    def spy(path, field, *args, **kwargs):
        model = real(path, field, *args, **kwargs)
        loaded.append((field, getattr(getattr(model, "options", None), "offload", None)))
        return model

    monkeypatch.setattr(loading, "load_backend", spy)
    flags = ("--calibration-cache", "none", "--backend", "native")
    assert cli.main(_generate(pair, *flags)) == 0
    resident = capsys.readouterr().out
    assert cli.main(_generate(pair, *flags, "--offload", "--offload-reserve-bytes", str(1 << 30))) == 0
    offloaded = capsys.readouterr().out
    assert loaded == [("llm", False), ("ssm[0]", False), ("llm", True), ("ssm[0]", False)]
    assert _text(resident) == _text(offloaded)
    # the verifier's checks: a reserve without offloading, offloading without the native backend
    assert cli.main(_generate(pair, "--offload-reserve-bytes", "1000")) == 2
    assert cli.main(_generate(pair, "--offload", "--backend", "reference")) == 2


def _verifier_args(llm, cache, *extra: str):
    from specinfer.llm_verifier.__main__ import build_parser

    return build_parser().parse_args(
        ["--llm", str(llm), "--calibrate-tokens", "4", "--calibration-cache", str(cache), *extra]
    )


def test_verifier_calibrates_once_then_reads_the_cache(tmp_path, pair, monkeypatch):
    from prometheus_client import CollectorRegistry

    from specinfer.llm_verifier.__main__ import load_servicer
    from specinfer.serving import runner
    from specinfer.serving.metrics import ModelMetrics

    cache = tmp_path / "svc-cache"
    first = load_servicer(_verifier_args(pair[0], cache), ModelMetrics(CollectorRegistry(), "llm"))
    assert len(list(cache.glob("verifier-*.json"))) == 1
    assert set(first.costs.verify_table.as_dict()) == {1, 2, 3, 4}
    monkeypatch.setattr(
        runner, "calibrate_costs", lambda *a, **k: pytest.fail("a cached calibration must not run again")
    )
    second = load_servicer(_verifier_args(pair[0], cache), ModelMetrics(CollectorRegistry(), "llm"))
    assert second.costs.describe() == first.costs.describe()
    calls = []
    monkeypatch.setattr(runner, "calibrate_costs", lambda *a, **k: calls.append(1) or first.costs)
    load_servicer(
        _verifier_args(pair[0], cache, "--kv-block-size", "0"), ModelMetrics(CollectorRegistry(), "llm")
    )  # another kernel: calibrates
    load_servicer(_verifier_args(pair[0], "off"), ModelMetrics(CollectorRegistry(), "llm"))
    assert calls == [1, 1] and len(list(cache.glob("verifier-*.json"))) == 2


def test_worker_calibrates_once_then_reads_the_cache(tmp_path, pair, monkeypatch):
    from prometheus_client import CollectorRegistry

    from specinfer.serving import runner
    from specinfer.serving.metrics import ModelMetrics
    from specinfer.ssm_worker.__main__ import build_parser, load_servicer

    cache = tmp_path / "svc-cache"
    llm, ssm = pair
    argv = ["--ssm", f"a={ssm},b={llm}", "--calibrate-tokens", "4", "--calibration-cache", str(cache)]
    first = load_servicer(build_parser().parse_args(argv), ModelMetrics(CollectorRegistry(), "ssm"))
    assert len(list(cache.glob("drafter-*.json"))) == 2 and set(first.draft_costs) == {"a", "b"}
    monkeypatch.setattr(
        runner, "calibrate_table", lambda *a, **k: pytest.fail("a cached calibration must not run again")
    )
    second = load_servicer(build_parser().parse_args(argv), ModelMetrics(CollectorRegistry(), "ssm"))
    assert {n: t.as_dict() for n, t in second.draft_costs.items()} == {
        n: t.as_dict() for n, t in first.draft_costs.items()
    }
