"""Bad input raises InvalidArgument naming the field."""

from __future__ import annotations

import pytest

from specinfer.cli import main
from specinfer.core import ExpansionConfig, InvalidArgument, SamplingParams
from specinfer.core.drafts import PAPER_EXPANSION
from specinfer.engine import EngineConfig, GenerationRequest, SpeculationConfig, SpeculativeEngine
from specinfer.models.reference import ReferenceBackend
from specinfer.models.tiny import tiny_llama


@pytest.fixture(scope="module")
def engine():
    return SpeculativeEngine(
        ReferenceBackend(tiny_llama(50, 32, 1, 2, 2, 0)),
        [ReferenceBackend(tiny_llama(50, 32, 1, 2, 2, 1))],
        EngineConfig(),
    )


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
    assert (
        _field(
            lambda: engine.add(
                GenerationRequest("a", (1,), 5, speculation=SpeculationConfig(spec.expansion, ssms=(3,)))
            )
        )
        == "speculation.ssms"
    )
    assert _field(lambda: SpeculationConfig(spec.expansion, ssms=())) == "speculation.ssms"


def test_request_ids_are_unique_while_running_or_waiting_and_free_once_cancelled_or_done():
    engine = SpeculativeEngine(
        ReferenceBackend(tiny_llama(50, 32, 1, 2, 2, 0)), [], EngineConfig(max_batch=1, eos_token_id=None)
    )
    engine.add(GenerationRequest("run", (1, 2), 3, ignore_eos=True))
    engine.add(GenerationRequest("wait", (1, 2), 3, ignore_eos=True))
    engine.add(GenerationRequest("third", (1, 2), 3, ignore_eos=True))
    engine.step()  # max_batch 1: "run" runs, the others wait
    for rid in ("run", "wait", "third"):
        assert _field(lambda rid=rid: engine.add(GenerationRequest(rid, (1,), 2))) == "request_id"
    cancelled = engine.cancel("wait")  # a waiting request, not the last of the queue
    assert cancelled is not None and cancelled.finish_reason == "cancelled"
    assert engine.cancel("wait") is None and engine.admitted == 2
    engine.add(GenerationRequest("wait", (1, 2), 3, ignore_eos=True))  # its ID is free again
    done = []
    while engine.has_work:
        done += engine.step()
    assert sorted(r.request_id for r in done) == ["run", "third", "wait"]
    engine.add(GenerationRequest("run", (1, 2), 1, ignore_eos=True))  # a finished request's ID is free


@pytest.mark.parametrize("text", ["", "0", "1,0,2", "1,-1", "a,b", "<>"])
def test_expansion(text):
    assert _field(lambda: ExpansionConfig.parse(text)) == "expansion"


def test_expansion_depth_zero():
    assert _field(lambda: ExpansionConfig(())) == "expansion"


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": -2}, "top_k"),
    ],
)
def test_sampling(kwargs, field):
    assert _field(lambda: SamplingParams(**kwargs)) == field


def test_ssm_with_another_vocabulary():
    llm = ReferenceBackend(tiny_llama(50, 32, 1, 2, 2, 0))
    ssm = ReferenceBackend(tiny_llama(60, 32, 1, 2, 2, 0))
    assert _field(lambda: SpeculativeEngine(llm, [ssm], EngineConfig())) == "ssms[0]"


def test_cli_reports_bad_input_without_a_traceback(model_pair, capsys):
    assert main(["generate", "--llm", str(model_pair.llm), "--ssm", str(model_pair.ssm), "--top-p", "2", "x"]) == 2
    assert "--top-p: must be in (0, 1]" in capsys.readouterr().err  # the field named as its flag
    assert main(["generate", "--llm", str(model_pair.llm), "--ssm", str(model_pair.ssm), "--min-p", "2", "x"]) == 2
    assert "--min-p: must be in [0, 1]" in capsys.readouterr().err
    assert (
        main(["generate", "--llm", str(model_pair.llm), "--ssm", str(model_pair.ssm), "--expansion", "1,0", "x"]) == 2
    )
    assert "expansion" in capsys.readouterr().err
    assert main(["generate", "--llm", str(model_pair.llm), "--ssm", "/nonexistent", "x"]) == 2
    assert "ssm[0]" in capsys.readouterr().err
    assert main(["generate", "--llm", str(model_pair.llm), "--ssm", str(model_pair.ssm), ""]) == 2
    assert "prompt" in capsys.readouterr().err


def test_cli_generates(model_pair, capsys):
    assert (
        main(
            [
                "generate",
                "--llm",
                str(model_pair.llm),
                "--ssm",
                str(model_pair.ssm),
                "--max-new-tokens",
                "12",
                "def f(x):\n",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "tokens per LLM step" in out and "12 tokens" in out


def test_cli_generates_with_penalties_and_prints_logprobs(model_pair, capsys):
    """The sampling flags reach the engine (a repetition penalty changes the greedy text), and --logprobs N prints
    one line per output token with N alternatives."""
    base = ["generate", "--llm", str(model_pair.llm), "--ssm", str(model_pair.ssm), "--max-new-tokens", "12"]
    assert main([*base, "--dtype", "float32", "def f(x):\n"]) == 0
    plain = capsys.readouterr().out
    flags = ["--dtype", "float32", "--repetition-penalty", "3", "--presence-penalty", "1.5", "--logprobs", "2"]
    assert main([*base, *flags, "def f(x):\n"]) == 0
    out = capsys.readouterr().out
    text = out.split("--- generated")[1].split("--- logprobs")[0]
    assert text != plain.split("--- generated")[1].split("--- LLM steps")[0]
    lines = out.split("--- logprobs (position, token, logprob, alternatives)\n")[1].split("--- LLM steps")[0]
    rows = lines.strip().splitlines()
    assert len(rows) == 12 and all(row.split()[0] == str(k) for k, row in enumerate(rows))


def _limits(default_adaptive: bool = False, default_expansion: tuple[int, ...] = ()):
    from specinfer.request_manager.api.admission import ApiLimits

    return ApiLimits(
        vocab_size=100,
        max_positions=256,
        max_new_tokens=64,
        default_expansion=default_expansion,
        default_ssms=("a", "b"),
        ssm_names=("a", "b"),
        draft_support=8,
        llm_name="llm",
        eos_token_id=None,
        default_adaptive=default_adaptive,
    )


def test_admission_of_adaptive_speculation():
    """``adaptive`` (or nothing, on an adaptive server) -> SpeculationConfig(None, ...); expansion -> static; both:
    refused."""
    from specinfer.request_manager.api.admission import speculation
    from specinfer.v1 import api_pb2

    auto, static = _limits(default_adaptive=True), _limits(default_expansion=(1, 2))
    adaptive = SpeculationConfig(None, (0, 1), 8)
    assert speculation(api_pb2.SpeculationParams(adaptive=True), static) == adaptive
    assert speculation(api_pb2.SpeculationParams(), auto) == adaptive
    assert speculation(api_pb2.SpeculationParams(adaptive=True, ssms=["b"]), _limits()) == SpeculationConfig(
        None, (1,), 8
    )
    assert speculation(api_pb2.SpeculationParams(expansion=[2, 1]), auto) == SpeculationConfig(
        ExpansionConfig((2, 1)), (0, 1), 8
    )
    assert speculation(api_pb2.SpeculationParams(), static) == SpeculationConfig(ExpansionConfig((1, 2)), (0, 1), 8)
    assert speculation(api_pb2.SpeculationParams(), _limits()) is None
    assert speculation(api_pb2.SpeculationParams(disabled=True, adaptive=True), auto) is None
    assert (
        _field(lambda: speculation(api_pb2.SpeculationParams(adaptive=True, expansion=[1]), auto))
        == "speculation.adaptive"
    )
    assert _field(lambda: speculation(api_pb2.SpeculationParams(adaptive=True, ssms=["c"]), auto)) == "speculation.ssms"
    assert (auto.default_speculation, static.default_speculation, _limits().default_speculation) == (
        "auto",
        "1,2",
        "none",
    )
    assert speculation(api_pb2.SpeculationParams(adaptive=True), auto).suffix  # unset: drafts from the text too
    assert not speculation(api_pb2.SpeculationParams(adaptive=True, suffix=False), auto).suffix


def test_adaptive_requests_survive_the_redis_record():
    from specinfer.request_manager.scheduling.live import Live
    from specinfer.request_manager.state.live_records import live_from_snapshot, live_params
    from specinfer.request_manager.state.records import RequestSnapshot, RequestStatus

    limits = _limits(default_adaptive=True)
    for suffix, head in ((True, True), (False, True), (True, False)):
        spec = SpeculationConfig(None, (1,), 8, suffix, head)
        live = Live(GenerationRequest("r", (1, 2), 8, SamplingParams(), spec), 5)
        params = live_params(live, limits.ssm_names)
        assert params["speculation"] == {"expansion": None, "ssms": ["b"], "suffix": suffix, "head": head}
        snapshot = RequestSnapshot(
            "r", "me", RequestStatus.RUNNING, params, (1, 2), (), None, None, live.stats, 0.0, 0.0
        )
        assert live_from_snapshot(snapshot, limits, None).request.speculation == spec
    del params["speculation"]["suffix"]  # a record from before suffix drafts: on, the default
    del params["speculation"]["head"]  # and from before draft heads: on too
    restored = live_from_snapshot(snapshot, limits, None).request.speculation
    assert restored.suffix and restored.head


def test_a_constraint_survives_the_redis_record():
    """A constrained request resumed after a restart keeps its constraint (its grammar state is rebuilt from the
    committed output by the engine core)."""
    from specinfer.core.constraints import Constraint
    from specinfer.request_manager.scheduling.live import Live
    from specinfer.request_manager.state.live_records import live_from_snapshot, live_params
    from specinfer.request_manager.state.records import RequestSnapshot, RequestStatus

    limits = _limits()
    for constraint in (Constraint("json_schema", '{"type": "object"}'), Constraint("json_object"), None):
        live = Live(GenerationRequest("r", (1, 2), 8, constraint=constraint), 5)
        params = live_params(live, limits.ssm_names)
        snapshot = RequestSnapshot("r", "me", RequestStatus.RUNNING, params, (1, 2), (), None, None, live.stats, 0, 0)
        assert live_from_snapshot(snapshot, limits, None).request.constraint == constraint
    del params["constraint"]  # a record from before structured outputs: none
    assert live_from_snapshot(snapshot, limits, None).request.constraint is None


def test_request_manager_expansion_keywords():
    from specinfer.request_manager.config import RequestManagerConfig

    def parsed(*argv: str) -> tuple[bool, tuple[int, ...]]:
        cfg = RequestManagerConfig.from_args(list(argv))
        return cfg.adaptive, cfg.expansion

    assert parsed() == (True, ())  # auto, the default: adaptive speculation
    assert parsed("--expansion", "tuned") == (False, ExpansionConfig.parse(PAPER_EXPANSION).widths)
    assert parsed("--expansion", "none") == (False, ())
    assert parsed("--expansion", "2,1") == (False, (2, 1))


def test_cli_generates_adaptively(model_pair, capsys):
    """``--expansion auto`` (the default) speculates adaptively, with the output of the LLM alone."""
    argv = [
        "generate",
        "--llm",
        str(model_pair.llm),
        "--ssm",
        str(model_pair.ssm),
        "--max-new-tokens",
        "12",
        "--dtype",
        "float32",
        "def f(x):\n",
    ]
    assert main(argv) == 0
    adaptive = capsys.readouterr().out
    assert "adaptive trees over 1 SSM(s)" in adaptive
    assert main([*argv, "--expansion", "none"]) == 0
    incremental = capsys.readouterr().out
    assert (
        adaptive.split("--- generated")[1].split("--- LLM steps")[0]
        == incremental.split("--- generated")[1].split("--- LLM steps")[0]
    )


def test_admission_refuses_a_request_no_kv_budget_holds_alone():
    """prompt + max_new_tokens + the largest tree must fit every KV budget (the request manager's
    scheduler could never run it otherwise): refused naming max_new_tokens; the tree counts."""
    import dataclasses

    from specinfer.core.kv_budget import KVBudget
    from specinfer.request_manager.api.admission import build_live
    from specinfer.v1 import api_pb2

    limits = dataclasses.replace(
        _limits(default_adaptive=True), kv_budgets=(KVBudget(100, 4), KVBudget(4, 10))
    )  # 40 rows in the second

    def request(max_new_tokens: int, adaptive: bool) -> api_pb2.GenerateRequest:
        spec = api_pb2.SpeculationParams(adaptive=True) if adaptive else api_pb2.SpeculationParams(disabled=True)
        return api_pb2.GenerateRequest(
            token_ids=api_pb2.TokenIds(ids=[1, 2, 3, 4]), max_new_tokens=max_new_tokens, speculation=spec
        )

    assert (
        build_live(request(20, adaptive=False), limits, None, None).request.max_new_tokens == 20
    )  # 4 + 20 + the root: 25 rows
    with pytest.raises(InvalidArgument) as err:
        build_live(request(20, adaptive=True), limits, None, None)  # 4 + 20 + 32 tree nodes: 56 rows
    assert err.value.field == "max_new_tokens" and "14 KV blocks" in err.value.message  # 56 rows in blocks of 4
    assert _field(lambda: build_live(request(36, adaptive=False), limits, None, None)) == "max_new_tokens"  # 41 rows
    assert (
        build_live(request(35, adaptive=False), limits, None, None).request.max_new_tokens == 35
    )  # 40 rows: exactly the budget
    # an SSM worker's cache holds every node it expands: 4 + 20 + 1 + 8 passes x 31 nodes = 273 rows for an
    # adaptive tree
    drafting = dataclasses.replace(
        _limits(default_adaptive=True), kv_budgets=(KVBudget(4, 68, drafts=True),)
    )  # 272 rows
    assert _field(lambda: build_live(request(20, adaptive=True), drafting, None, None)) == "max_new_tokens"
    assert build_live(request(20, adaptive=False), drafting, None, None).request.max_new_tokens == 20


def test_admission_refuses_more_logprobs_alternatives_than_the_vocabulary_holds():
    """A logprobs record holds as many alternatives as the request asks: a vocabulary with fewer tokens could not
    fill it, so the request is refused naming ``logprobs`` (the in-process engine reports the whole vocabulary)."""
    import dataclasses

    from specinfer.client import Client
    from specinfer.request_manager.api.admission import build_live

    limits = dataclasses.replace(_limits(), vocab_size=10)
    assert build_live(Client.request([1, 2, 3], 4, logprobs=10), limits, None, None).request.logprobs == 10
    assert _field(lambda: build_live(Client.request([1, 2, 3], 4, logprobs=11), limits, None, None)) == "logprobs"
