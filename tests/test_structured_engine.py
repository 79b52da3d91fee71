"""Structured outputs in process (fp32, the bundled demo models): greedy constrained speculative output equals
constrained incremental decoding token for token (tests/oracles.py, transformers with the grammar's mask at each
step), whatever the speculation, batched with unconstrained requests; every JSON output that ends parses and
validates against its schema; a grammar the LLM does not finish in max_new_tokens ends with ``length``; the
grammar's certain tokens inside the tree and drafts masked inside the drafters take fewer LLM steps for the same
output (steps counted)."""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import numpy as np
import pytest
from oracles import hf_constrained_greedy, hf_greedy  # tests/oracles.py
from test_stochastic_engine import free_speculation  # tests/test_stochastic_engine.py
from tokenizers import Tokenizer

from specinfer.core import DraftTree, ExpansionConfig, InvalidArgument, SamplingParams, TokenTree
from specinfer.core.constraints import Constraint, Grammars
from specinfer.core.grammar_states import GrammarSpeculation
from specinfer.core.iteration import VerifySpec
from specinfer.engine import EngineConfig, GenerationRequest, SpeculationConfig, SpeculativeEngine
from specinfer.models.loading import eos_token_id, load_backend
from specinfer.wire_jobs import context_to_proto, verify_job_from_proto, verify_job_to_proto

NEW_TOKENS = 40
MARGIN = 1.6  # the certain tokens take this many times fewer LLM steps under a schema, at least (measured: 2.1)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "schema": Constraint("json_schema", json.dumps(SCHEMA)),
    "object": Constraint("json_object"),
    "regex": Constraint("regex", r"(the|a) [a-z]{1,8}( (and|or) [a-z]{1,8}){0,3}\."),
    "lark": Constraint("grammar", 'start: "[" num ("," num)* "]"\nnum: /[0-9]{1,3}/'),
}
SPECULATIONS = {
    "none": None,
    "paper-tree": SpeculationConfig(ExpansionConfig.parse("1,1,3,1,1,1,1,1"), ssms=(0,)),
    "wide-two-ssms": SpeculationConfig(ExpansionConfig((3, 2, 2)), ssms=(0, 1)),
    "adaptive": SpeculationConfig(None, ssms=(0,)),
}


@pytest.fixture(scope="module")
def setup(model_pair):
    eos = eos_token_id(model_pair.llm)
    models = [
        load_backend(p, "model", "float32", backend="native", kv_cache_bytes=1 << 28)
        for p in (model_pair.llm, model_pair.ssm, model_pair.ssm2)
    ]
    grammars = Grammars((model_pair.llm / "tokenizer.json").read_text(), models[0].vocab_size, eos)
    engine = SpeculativeEngine(
        models[0], models[1:], EngineConfig(eos_token_id=eos), free_speculation(), grammars=grammars
    )
    prompts = [tuple(p) for p in model_pair.prompts[:2]]
    expected = {
        name: hf_constrained_greedy(model_pair.llm, prompts, NEW_TOKENS, [grammars.state(c) for _ in prompts])
        for name, c in CONSTRAINTS.items()
    }
    tokenizer = Tokenizer.from_file(str(model_pair.llm / "tokenizer.json"))
    return engine, prompts, expected, tokenizer, eos, hf_greedy(model_pair.llm, prompts[:1], 16)[0]


@pytest.mark.parametrize("spec_name", list(SPECULATIONS))
def test_constrained_greedy_equals_constrained_incremental_decoding(setup, spec_name):
    engine, prompts, expected, tokenizer, eos, plain = setup
    spec = SPECULATIONS[spec_name]
    requests = [
        GenerationRequest(f"{spec_name}-{name}-{i}", p, NEW_TOKENS, speculation=spec, constraint=c)
        for name, c in CONSTRAINTS.items()
        for i, p in enumerate(prompts)
    ]
    # an unconstrained request in the same batches keeps its own output
    free = GenerationRequest(f"{spec_name}-free", prompts[0], 16, speculation=spec)
    results = engine.generate([*requests, free])
    assert results[-1].output_tokens == plain
    at = 0
    for name in CONSTRAINTS:
        for i in range(len(prompts)):
            got = results[at].output_tokens
            assert got == expected[name][i], (spec_name, name, i)
            at += 1
            if got[-1] != eos:
                assert results[at - 1].finish_reason == "length"
                continue
            text = tokenizer.decode(got[:-1])
            _check_text(name, text)


def _check_text(name: str, text: str) -> None:
    if name == "schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif name == "object":
        assert isinstance(json.loads(text), dict)
    elif name == "regex":
        assert re.fullmatch(CONSTRAINTS["regex"].text, text), text
    else:
        assert re.fullmatch(r"\[[0-9]{1,3}(,[0-9]{1,3})*\]", text), text


def test_every_json_output_that_ends_validates(setup):
    """At least one output per constraint ends within the budget (else the tests above prove little)."""
    _, _, expected, tokenizer, eos, _ = setup
    for name in ("schema", "regex", "lark"):  # the demo LLM nests "object" past any budget
        ended = [out for out in expected[name] if out[-1] == eos]
        assert ended, name
        for out in ended:
            _check_text(name, tokenizer.decode(out[:-1]))


def test_an_unfinished_grammar_ends_with_length(setup):
    engine, prompts, _, _, _, _ = setup
    [result] = engine.generate([GenerationRequest("short", prompts[0], 3, constraint=CONSTRAINTS["schema"])])
    assert result.finish_reason == "length" and len(result.output_tokens) == 3


def test_bad_constraints_are_refused_naming_the_field(setup):
    engine, prompts, *_ = setup
    with pytest.raises(InvalidArgument) as err:
        engine.add(GenerationRequest("bad", prompts[0], 8, constraint=Constraint("regex", "(unclosed")))
    assert err.value.field == "regex"
    with pytest.raises(InvalidArgument) as err:
        GenerationRequest("eos", prompts[0], 8, ignore_eos=True, constraint=Constraint("json_object"))
    assert err.value.field == "ignore_eos"


def test_seeded_constrained_output_is_plain_decodings_whatever_the_speculation(setup):
    """Seeded sampling under a grammar (coupled verification, the default for seeded requests): speculative output
    equals plain constrained decoding with the same seed, token for token, under static, merged and adaptive trees,
    with the drafts masked and the grammar's certain tokens in the trees."""
    engine, prompts, _, _, _, _ = setup
    params = SamplingParams(temperature=1.0, top_p=0.95)
    outputs: dict[str, list[tuple[int, ...]]] = {}
    for spec_name, spec in SPECULATIONS.items():
        requests = [
            GenerationRequest(
                f"seeded-{spec_name}-{name}-{i}",
                prompts[i % 2],
                NEW_TOKENS,
                dataclasses.replace(params, seed=11 + i),
                spec,
                constraint=c,
            )
            for name, c in CONSTRAINTS.items()
            for i in range(2)
        ]
        outputs[spec_name] = [tuple(r.output_tokens) for r in engine.generate(requests)]
    plain = outputs.pop("none")
    assert len(set(plain)) > 1  # the seeds draw different outputs: the comparison below can fail
    for spec_name, got in outputs.items():
        assert got == plain, spec_name


@pytest.mark.parametrize("verification, seed", [("mss", None), ("coupled", 5)])
def test_sampled_constrained_outputs_match_their_grammar(setup, verification, seed):
    """Sampling under MSS (the tree kept whole, forbidden nodes always rejected) and coupled verification
    (the tree pruned): every output matches, whatever the drafts proposed."""
    engine, prompts, _, tokenizer, eos, _ = setup
    params = SamplingParams(temperature=1.0, verification=verification, seed=seed)
    requests = [
        GenerationRequest(
            f"{verification}-{name}-{i}", prompts[i % 2], NEW_TOKENS, params, SPECULATIONS["paper-tree"], constraint=c
        )
        for name, c in CONSTRAINTS.items()
        if name != "object"
        for i in range(3)
    ]
    for request, result in zip(requests, engine.generate(requests), strict=True):
        out = result.output_tokens
        name = request.request_id.split("-")[1]
        if out[-1] == eos:
            _check_text(name, tokenizer.decode(out[:-1]))
        else:
            assert result.finish_reason == "length"


def test_masks_cross_the_wire(setup):
    engine, prompts, *_ = setup
    grammars = engine._core.grammars.grammars
    state = grammars.state(CONSTRAINTS["schema"])
    tree = TokenTree((5, 93, 4, 95), (-1, 0, 1, 0))  # "{", "\"" below it, and "}" (forbidden)
    walked = state.tree(tree.tokens, tree.parents)
    assert walked.kept == (0, 1, 2)
    masks = walked.masks[list(walked.kept)]
    job = VerifySpec(
        "r", list(prompts[0][:-1]), DraftTree(tree).subtree(walked.kept), SamplingParams(), 0, 0, masks=masks
    )
    item = verify_job_to_proto(job, context_to_proto("r", job.context_tokens, 0))
    back = verify_job_from_proto(item, job.context_tokens, grammars.vocab_size, 1 << 12, "items[0]")
    np.testing.assert_array_equal(back.masks, masks)
    item.token_masks = item.token_masks[:-4]
    with pytest.raises(InvalidArgument) as err:
        verify_job_from_proto(item, job.context_tokens, grammars.vocab_size, 1 << 12, "items[0]")
    assert err.value.field == "items[0].token_masks"


@pytest.mark.parametrize("spec_name", ["paper-tree", "adaptive"])
def test_certain_tokens_and_masked_drafts_take_fewer_llm_steps(setup, spec_name):
    """The grammar's help, counted in LLM steps for the same output (constrained incremental decoding's): with the
    drafts unmasked (pruned after drafting), the certain tokens inside the tree take clearly fewer steps than pruning
    alone, and without pruning or certain tokens the output is the same too; drafts masked inside the drafters take
    clearly fewer steps than unmasked pruned ones, and no more than unmasked ones with certain tokens (the masked
    SSM drafts most certain tokens itself)."""
    engine, prompts, expected, _, eos, _ = setup
    grammars = engine._core.grammars.grammars
    steps = {}
    for name, config in {
        "masked": GrammarSpeculation(),
        "certain": GrammarSpeculation(mask_drafts=False),
        "pruned": GrammarSpeculation(certain_tokens=0, mask_drafts=False),
        "whole": GrammarSpeculation(prune=False, certain_tokens=0, mask_drafts=False),
    }.items():
        other = SpeculativeEngine(
            engine.llm,
            engine.ssms,
            EngineConfig(eos_token_id=eos, grammar=config),
            free_speculation(),
            grammars=grammars,
        )
        requests = [
            GenerationRequest(
                f"steps-{spec_name}-{name}-{kind}-{i}",
                p,
                NEW_TOKENS,
                speculation=SPECULATIONS[spec_name],
                constraint=CONSTRAINTS[kind],
            )
            for kind in ("schema", "lark")
            for i, p in enumerate(prompts)
        ]
        results = other.generate(requests)
        assert [r.output_tokens for r in results] == expected["schema"] + expected["lark"], name
        steps[name] = sum(r.llm_steps for r in results)
    assert steps["certain"] * MARGIN <= steps["pruned"], steps
    assert steps["masked"] * MARGIN <= steps["pruned"], steps
    assert steps["masked"] <= steps["certain"], steps
