"""An engine from checkpoint folders (specinfer.engine.loading): the Python API's engine reads and writes the
calibration cache entry that ``specinfer generate`` uses, so an adaptive request neither calibrates for tens of
seconds nor probes again once either of them ran. (The README's example of it runs in
tests/deploy/test_readme_clients.py.)"""

from __future__ import annotations

import json

import pytest

from specinfer import cli
from specinfer.core.errors import InvalidArgument
from specinfer.core.requests import GenerationRequest, SamplingParams, SpeculationConfig
from specinfer.engine import engine as engine_module
from specinfer.engine.calibration_cache import costs_from_json
from specinfer.engine.loading import EngineModels, load_engine
from specinfer.models.tiny import TinySpec, build_tiny_pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_tiny_pair(tmp_path_factory.mktemp("load-pair"), TinySpec(layers=2, ssm_layers=1))


def _adaptive():
    """Adaptive requests (``SpeculationConfig(None)``): the first one builds the cost model."""
    return [
        GenerationRequest(f"r{i}", p, 12, SamplingParams(), SpeculationConfig(None, ssms=(0,)))
        for i, p in enumerate(((5, 6, 7, 8), (9, 10, 11)))
    ]


def _never(what: str):
    def fail(*args, **kwargs):
        pytest.fail(f"{what} must not run: the cost model is cached")

    return fail


def test_python_engine_reads_the_entry_generate_wrote(tmp_path, pair, monkeypatch):
    llm, ssm = pair
    cache = tmp_path / "cache"
    argv = ["generate", "--llm", str(llm), "--ssm", str(ssm), "--dtype", "float32", "--max-new-tokens", "8"]
    assert cli.main([*argv, "--calibration-cache", str(cache), "def f(x):"]) == 0
    (entry,) = cache.glob("engine-*.json")
    written = json.loads(entry.read_text())
    monkeypatch.setattr(engine_module, "probe_costs", _never("the probe"))
    monkeypatch.setattr(engine_module, "calibrate_costs", _never("the full calibration"))
    models = EngineModels(llm, (ssm,), dtype="float32", calibration_cache=str(cache))
    engine = load_engine(models)
    # built from the entry as the command left it: neither the probe nor the calibration ran
    assert engine.adaptive.costs.describe() == costs_from_json(written["payload"]).describe()
    engine.generate(_adaptive())
    assert list(cache.glob("engine-*.json")) == [entry]  # the same key as the command's
    assert json.loads(entry.read_text())["key"] == written["key"]


def test_python_engine_probes_once_then_reads_its_own_entry(tmp_path, pair, monkeypatch):
    llm, ssm = pair
    monkeypatch.setenv("SPECINFER_CALIBRATION_CACHE", str(tmp_path / "env-cache"))  # the folder from the environment
    probes = []
    real_probe = engine_module.probe_costs
    monkeypatch.setattr(engine_module, "probe_costs", lambda llm, ssms: probes.append(1) or real_probe(llm, ssms))
    monkeypatch.setattr(engine_module, "calibrate_costs", _never("the full calibration"))
    models = EngineModels(llm, (ssm,), dtype="float32")
    first = [r.output_tokens for r in load_engine(models).generate(_adaptive())]
    assert probes == [1]
    assert len(list((tmp_path / "env-cache").glob("engine-*.json"))) == 1
    second = [r.output_tokens for r in load_engine(models).generate(_adaptive())]
    assert probes == [1]  # the second engine read what the first one refined and wrote
    assert second == first  # greedy: the same tokens whatever the cost model planned


def test_without_a_tokenizer_constraints_are_refused_by_name(tmp_path, pair):
    llm, _ = pair
    folder = tmp_path / "no-tokenizer"
    folder.mkdir()
    for f in llm.iterdir():
        if f.name != "tokenizer.json":
            (folder / f.name).symlink_to(f)
    models = EngineModels(folder, (), dtype="float32", calibration_cache="none")
    with pytest.raises(InvalidArgument, match="llm"):
        load_engine(models)
    assert load_engine(models, constraints=False).llm.vocab_size > 0
