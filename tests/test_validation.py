"""Bad input raises InvalidArgument naming the field."""

from __future__ import annotations

import pytest

from specinfer.cli import main
from specinfer.core import ExpansionConfig, InvalidArgument, SamplingParams
from specinfer.engine import EngineConfig, GenerationRequest, SpeculationConfig, SpeculativeEngine
from specinfer.models.reference import ReferenceBackend
from specinfer.models.tiny import tiny_llama


@pytest.fixture(scope="module")
def engine():
    return SpeculativeEngine(ReferenceBackend(tiny_llama(50, 32, 1, 2, 2, 0)), [ReferenceBackend(tiny_llama(50, 32, 1, 2, 2, 1))], EngineConfig())


def _field(fn) -> str:
    with pytest.raises(InvalidArgument) as err:
        fn()
    return err.value.field


def test_request_fields(engine):
    spec = SpeculationConfig(ExpansionConfig((1, 2)))
    assert _field(lambda: GenerationRequest("a", (), 5)) == "prompt"
    assert _field(lambda: GenerationRequest("a", (1,), 0)) == "max_new_tokens"
    assert _field(lambda: GenerationRequest("a", (1,), -3)) == "max_new_tokens"
    assert _field(lambda: engine.add(GenerationRequest("a", (1, 50), 5))) == "prompt_tokens"
    assert _field(lambda: engine.add(GenerationRequest("a", (1, -1), 5))) == "prompt_tokens"
    assert _field(lambda: engine.add(GenerationRequest("a", (1,), 5, stop_token_ids=(99,)))) == "stop_token_ids"
    assert _field(lambda: engine.add(GenerationRequest("a", (1,), 5000))) == "max_new_tokens"
    assert _field(lambda: engine.add(GenerationRequest("a", (1,), 5, speculation=SpeculationConfig(spec.expansion, ssms=(3,))))) == "speculation.ssms"
    assert _field(lambda: SpeculationConfig(spec.expansion, ssms=())) == "speculation.ssms"


@pytest.mark.parametrize("text", ["", "0", "1,0,2", "1,-1", "a,b", "<>"])
def test_expansion(text):
    assert _field(lambda: ExpansionConfig.parse(text)) == "expansion"


def test_expansion_depth_zero():
    assert _field(lambda: ExpansionConfig(())) == "expansion"


@pytest.mark.parametrize(
    "kwargs, field", [({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.01}, "top_p"), ({"top_k": -2}, "top_k")]
)
def test_sampling(kwargs, field):
    assert _field(lambda: SamplingParams(**kwargs)) == field


def test_ssm_with_another_vocabulary():
    llm = ReferenceBackend(tiny_llama(50, 32, 1, 2, 2, 0))
    ssm = ReferenceBackend(tiny_llama(60, 32, 1, 2, 2, 0))
    assert _field(lambda: SpeculativeEngine(llm, [ssm], EngineConfig())) == "ssms[0]"


def test_cli_reports_bad_input_without_a_traceback(model_pair, capsys):
    assert main(["generate", "--llm", str(model_pair.llm), "--ssm", str(model_pair.ssm), "--top-p", "2", "x"]) == 2
    assert "top_p" in capsys.readouterr().err
    assert main(["generate", "--llm", str(model_pair.llm), "--ssm", str(model_pair.ssm), "--expansion", "1,0", "x"]) == 2
    assert "expansion" in capsys.readouterr().err
    assert main(["generate", "--llm", str(model_pair.llm), "--ssm", "/nonexistent", "x"]) == 2
    assert "ssm[0]" in capsys.readouterr().err
    assert main(["generate", "--llm", str(model_pair.llm), "--ssm", str(model_pair.ssm), ""]) == 2
    assert "prompt" in capsys.readouterr().err


def test_cli_generates(model_pair, capsys):
    assert main(["generate", "--llm", str(model_pair.llm), "--ssm", str(model_pair.ssm), "--max-new-tokens", "12", "def f(x):\n"]) == 0
    out = capsys.readouterr().out
    assert "tokens per LLM step" in out and "12 tokens" in out
