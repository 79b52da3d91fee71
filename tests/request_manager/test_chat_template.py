"""Chat templates render as transformers' apply_chat_template does (text and token IDs), without
transformers in the request manager; templates that refuse messages give INVALID_ARGUMENT."""

from __future__ import annotations

import json

import pytest
from transformers import PreTrainedTokenizerFast

from specinfer.checkpoint import load_tokenizer
from specinfer.core import InvalidArgument
from specinfer.request_manager.api.chat_template import ChatTemplate, check_messages

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Llama-2 style: bos_token, a system message lifted out of the loop, whitespace control, loop controls
LLAMA = """{{ bos_token }}
{% if messages[0]['role'] == 'system' %}
    {% set system = messages[0]['content'] %}{% set messages = messages[1:] %}
{% else %}{% set system = 'You are helpful.' %}{% endif %}
<<SYS>>{{ system | trim }}<</SYS>>
{% for message in messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% if message['role'] == 'user' %}[INST] {{ message['content'] | trim }} [/INST]\
{% else %} {{ message['content'] | trim }} {{ eos_token }}{% endif %}
    {% if loop.index > 50 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}{{ ' ' }}{% endif %}"""
# Meta-Llama-3-8B-Instruct's tokenizer_config.json chat_template
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Mistral-7B-Instruct-v0.1's: no system role, roles must alternate
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token + ' ' }}{% else %}"
    "{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
JSONY = (
    "{% for m in messages %}{{ m | tojson }}{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}<answer>{% endif %}"
)

MESSAGES = [
    {"role": "system", "content": '  Be terse. <b>html</b> & "quotes" ünïcode '},
    {"role": "user", "content": "def add(a, b):"},
    {"role": "assistant", "content": "return a + b"},
    {"role": "user", "content": [{"type": "text", "text": "and"}, {"type": "text", "text": "sub?"}]},
]


@pytest.fixture
def checkpoint(model_pair, tmp_path):
    """A copy of the LLM's tokenizer files with ``template`` installed (written per test)."""

    def make(template: str, as_file: bool):
        config = json.loads((model_pair.llm / "tokenizer_config.json").read_text())
        (tmp_path / "tokenizer.json").write_bytes((model_pair.llm / "tokenizer.json").read_bytes())
        if as_file:
            (tmp_path / "chat_template.jinja").write_text(template)
        else:
            config["chat_template"] = template
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
        return tmp_path

    return make


@pytest.mark.parametrize(
    "template", [CHATML, LLAMA3, MISTRAL, LLAMA, JSONY], ids=["chatml", "llama3", "mistral", "llama2", "tojson"]
)
@pytest.mark.parametrize("as_file", [False, True], ids=["config", "jinja-file"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_like_transformers(checkpoint, template, as_file, add_generation_prompt):
    folder = checkpoint(template, as_file)
    ours = ChatTemplate.load(folder)
    assert ours is not None
    messages = check_messages(MESSAGES[1:] if template == MISTRAL else MESSAGES)  # Mistral's has no system role
    hf = PreTrainedTokenizerFast.from_pretrained(str(folder))
    theirs = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    text = ours.render(messages, add_generation_prompt)
    assert text == theirs
    ids = hf.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
    )
    assert load_tokenizer(folder).encode(text, add_special_tokens=False).ids == list(ids)


def test_a_template_that_refuses_the_messages_is_an_invalid_argument(checkpoint):
    ours = ChatTemplate.load(checkpoint(LLAMA, False))
    with pytest.raises(InvalidArgument, match="roles must alternate") as err:
        ours.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert err.value.field == "messages"


def test_no_template_and_named_templates(model_pair, checkpoint, tmp_path):
    assert ChatTemplate.load(model_pair.llm) is None  # the shared pair has none
    folder = checkpoint("", False)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": CHATML}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert (
        ChatTemplate.load(folder).render([{"role": "user", "content": "hi"}])
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize(
    "messages",
    [
        None,
        [],
        "hi",
        [{"content": "no role"}],
        [{"role": "wizard", "content": "x"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": [{"type": "image_url"}]}],
    ],
)
def test_bad_messages(messages):
    with pytest.raises(InvalidArgument) as err:
        check_messages(messages)
    assert err.value.field == "messages"
