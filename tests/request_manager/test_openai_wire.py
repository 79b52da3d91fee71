"""OpenAI JSON -> GenerateRequest messages and back (pure conversions of the HTTP API)."""

from __future__ import annotations

import pytest

from specinfer.core import InvalidArgument
from specinfer.request_manager.api import openai_objects as oo
from specinfer.request_manager.api import openai_wire as ow
from specinfer.v1 import api_pb2


def requests(body: dict) -> list[api_pb2.GenerateRequest]:
    return ow.generate_requests(body, ow.completion_params(body), "cmpl-x")


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hi", ["hi"]),
        ([1, 2, 3], [[1, 2, 3]]),
        (["a", "b"], ["a", "b"]),
        ([[1], [2, 3]], [[1], [2, 3]]),
        (["a", [4]], ["a", [4]]),
    ],
)
def test_prompt_forms(prompt, expected):
    assert ow.prompts({"prompt": prompt}) == expected


@pytest.mark.parametrize("prompt", [None, "", [], [[]], [1, "a"], [True], 5, {"text": "a"}])
def test_bad_prompts_name_the_param(prompt):
    if prompt == "":  # an empty string is a prompt form; admission refuses it (prompt.text must not be empty)
        assert ow.prompts({"prompt": prompt}) == [""]
        return
    with pytest.raises(InvalidArgument) as err:
        ow.prompts({"prompt": prompt})
    assert err.value.field == "prompt"


def test_defaults_follow_openai():
    (msg,) = requests({"prompt": "x"})
    assert msg.max_new_tokens == ow.DEFAULT_MAX_TOKENS == 16
    assert msg.sampling.temperature == 1.0 and msg.sampling.top_p == 1.0 and msg.sampling.top_k == 0
    assert not msg.sampling.HasField("seed")
    assert msg.speculation == api_pb2.SpeculationParams()  # the server's default speculation
    assert msg.text == "x" and msg.request_id == "cmpl-x-0"


def test_choices_are_prompts_times_n_and_samples_get_seed_plus_i():
    msgs = requests(
        {
            "prompt": [[5, 6], "y"],
            "n": 3,
            "seed": 10,
            "max_tokens": 4,
            "stop": "\n",
            "stop_token_ids": [2],
            "top_k": 40,
            "ignore_eos": True,
        }
    )
    assert [m.request_id for m in msgs] == [f"cmpl-x-{i}" for i in range(6)]
    assert [list(m.token_ids.ids) for m in msgs[:3]] == [[5, 6]] * 3 and [m.text for m in msgs[3:]] == ["y"] * 3
    assert [m.sampling.seed for m in msgs] == [10, 11, 12, 10, 11, 12]
    assert all(
        list(m.stop) == ["\n"] and list(m.stop_token_ids) == [2] and m.sampling.top_k == 40 and m.ignore_eos
        for m in msgs
    )


def test_skip_special_tokens_defaults_to_true():
    from specinfer import wire

    assert wire.skip_special_tokens_from_proto(api_pb2.GenerateRequest())  # unset (an older client): skip
    assert not wire.skip_special_tokens_from_proto(api_pb2.GenerateRequest(skip_special_tokens=False))
    for body, skip in (
        ({}, True),
        ({"skip_special_tokens": None}, True),
        ({"skip_special_tokens": True}, True),
        ({"skip_special_tokens": False}, False),
    ):
        (msg,) = requests({"prompt": "x", **body})
        assert wire.skip_special_tokens_from_proto(msg) is skip


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("auto", api_pb2.SpeculationParams(adaptive=True)),
        ("disabled", api_pb2.SpeculationParams(disabled=True)),
        ({"expansion": [1, 1, 3], "ssms": ["a"]}, api_pb2.SpeculationParams(expansion=[1, 1, 3], ssms=["a"])),
        ({"adaptive": True, "suffix": False}, api_pb2.SpeculationParams(adaptive=True, suffix=False)),
        ({"adaptive": True}, api_pb2.SpeculationParams(adaptive=True)),  # suffix unset: the server's default (on)
    ],
)
def test_speculation_field(spec, expected):
    assert requests({"prompt": "x", "speculation": spec})[0].speculation == expected


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"n": ow.MAX_N + 1}, "n"),
        ({"seed": -1}, "seed"),
        ({"stop": [1]}, "stop"),
        ({"stop_token_ids": "2"}, "stop_token_ids"),
        ({"speculation": "maybe"}, "speculation"),
        ({"speculation": {"expansion": [0]}}, "speculation"),
        ({"speculation": {"adaptive": True, "suffix": 1}}, "speculation"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": "yes"}, "stream"),
        ({"skip_special_tokens": "false"}, "skip_special_tokens"),
        ({"skip_special_tokens": 0}, "skip_special_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"logprobs": 2, "echo": True}, "logprobs"),
        ({"best_of": 3}, "best_of"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": "high"}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"model": 3}, "model"),
    ],
)
def test_bad_fields_name_their_param(body, param):
    with pytest.raises(InvalidArgument) as err:
        requests({"prompt": "x", **body})
    assert err.value.field == param


@pytest.mark.parametrize(
    ("field", "param"),
    [
        ("max_new_tokens", "max_tokens"),
        ("prompt.token_ids", "prompt"),
        ("prompt.text", "prompt"),
        ("sampling.top_p", "top_p"),
        ("speculation.ssms", "speculation"),
    ],
)
def test_admission_fields_map_to_openai_params(field, param):
    assert ow.openai_param(field) == param


def test_usage_counts_each_prompt_once_and_speculation_sums_the_choices():
    usage = api_pb2.Usage(llm_steps=4, mean_accepted_tokens=1.5, mean_tree_size=3.0, cached_prompt_tokens=4)
    choices = [oo.Choice(0, token_ids=10, usage=usage), oo.Choice(1, token_ids=10, usage=usage)]
    want = {
        "prompt_tokens": 7,
        "completion_tokens": 20,
        "total_tokens": 27,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    assert oo.usage_object(choices, [7]) == want  # the prompt's cached tokens once, not per sample
    spec = oo.speculation_object(choices)
    assert spec == {
        "num_drafts": 8,
        "num_draft_tokens": 16,
        "num_accepted_tokens": 12,
        "mean_accepted_length": 2.5,
        "mean_tree_size": 3.0,
    }
