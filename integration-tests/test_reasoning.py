"""Reasoning models end to end (issue 33): a tiny random-weight Qwen3 whose
template thinks as Qwen3's does, served with the reasoning parser its
template picks. Random weights write `<think>` only when pushed: logit_bias
makes the tags likely and a seed makes each sample reproducible, so a chat
answer can be compared with the raw text /v1/completions samples from the
same prompt tokens, seed and bias (the shard's randomness depends only on
the seed and the position)."""

from __future__ import annotations

import json

import httpx
import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from conftest import API_KEY

QUESTION = [{"role": "user", "content": "What is 6 times 7?"}]


@pytest.fixture(scope="module")
def http(qwen3_launcher):
    with httpx.Client(base_url=qwen3_launcher.base_url, timeout=300,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as client:
        yield client


@pytest.fixture(scope="module")
def client(qwen3_launcher) -> OpenAI:
    return OpenAI(base_url=f"{qwen3_launcher.base_url}/v1", api_key=API_KEY, timeout=300)


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3_dir):
    return AutoTokenizer.from_pretrained(str(tiny_qwen3_dir))


@pytest.fixture(scope="module")
def tags(tokenizer) -> dict[str, int]:
    return {tag: tokenizer.convert_tokens_to_ids(tag) for tag in ("<think>", "</think>")}


def split(text: str) -> tuple[str, str]:
    """What the qwen3 parser makes of a raw output that may open a block."""
    stripped = text.lstrip()
    if not stripped.startswith("<think>"):
        return "", text
    thought, closed, answer = stripped[len("<think>"):].partition("</think>")
    return thought.strip(), answer.lstrip() if closed else ""


def test_info_names_the_parser(http):
    assert http.get("/info").json()["reasoning_parser"] == "qwen3"


def test_thinking_is_split_as_the_raw_text_reads(client, http, tokenizer, tags):
    """Chat answers (buffered, streamed, n=2) against the raw completion of
    the same prompt tokens: reasoning_content is the block, content the rest."""
    prompt = tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    # Strong enough that most seeds open and close a block within 24 tokens
    # (random weights: about 23 seeds in 40 give both a thought and an answer).
    bias = {str(tags["<think>"]): 12, str(tags["</think>"]): 10}
    both = 0
    for seed in range(6):
        sampling = dict(max_tokens=24, temperature=1.0, seed=seed, logit_bias=bias)
        raw = http.post("/v1/completions", json={"prompt": ids, **sampling}).json()["choices"][0]["text"]
        reasoning, content = split(raw)
        chat = client.chat.completions.create(model="tgi", messages=QUESTION, **sampling)
        message = chat.choices[0].message
        assert (getattr(message, "reasoning_content", None) or "", message.content or "") == (reasoning, content), raw
        thinking = chat.usage.completion_tokens_details.reasoning_tokens
        if not raw.lstrip().startswith("<think>"):
            assert thinking == 0, raw
        elif "</think>" not in raw:
            assert thinking == chat.usage.completion_tokens, raw
        else:
            assert 0 < thinking < chat.usage.completion_tokens or not content, raw
        streamed_reasoning, streamed_content = "", ""
        for chunk in client.chat.completions.create(model="tgi", messages=QUESTION, stream=True, **sampling):
            for choice in chunk.choices:
                streamed_reasoning += getattr(choice.delta, "reasoning_content", None) or ""
                streamed_content += choice.delta.content or ""
        assert (streamed_reasoning, streamed_content) == (reasoning, content), raw
        both += bool(reasoning) and bool(content)
    assert both, "no seed gave both a thought and an answer: the bias no longer shapes the output"


def test_n_choices_are_each_split(client, tags):
    bias = {str(tags["<think>"]): 100, str(tags["</think>"]): 6}
    chat = client.chat.completions.create(model="tgi", messages=QUESTION, max_tokens=12, n=2, seed=3,
                                          temperature=1.0, logit_bias=bias)
    for choice in chat.choices:
        assert "<think>" not in (choice.message.content or "") and "</think>" not in (choice.message.content or "")
    assert chat.usage.completion_tokens_details.reasoning_tokens > 0


def test_enable_thinking_false_leaves_the_output_alone(client, tags):
    """The template writes an empty block into the prompt: nothing after it
    is thinking, even a <think> the model writes."""
    chat = client.chat.completions.create(
        model="tgi", messages=QUESTION, max_tokens=3, temperature=0, logit_bias={str(tags["<think>"]): 100},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = chat.choices[0].message
    assert message.content.startswith("<think>")
    assert getattr(message, "reasoning_content", None) is None
    assert chat.usage.completion_tokens_details.reasoning_tokens == 0


def test_include_reasoning_false_drops_it(client, tags):
    bias = {str(tags["<think>"]): 100, str(tags["</think>"]): 0}
    chat = client.chat.completions.create(model="tgi", messages=QUESTION, max_tokens=4, temperature=0,
                                          logit_bias=bias, extra_body={"include_reasoning": False})
    message = chat.choices[0].message
    assert getattr(message, "reasoning_content", None) is None
    assert message.content in ("", None), "the block is still split off"
    assert chat.usage.completion_tokens_details.reasoning_tokens == 4


SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
          "additionalProperties": False}


def test_structured_output_applies_after_the_thinking(client, tags):
    """The schema binds the answer; the block before it is free text."""
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    thought = 0
    for seed in range(4):
        chat = client.chat.completions.create(
            model="tgi", messages=QUESTION, max_tokens=60, temperature=1.0, seed=seed, response_format=fmt,
            logit_bias={str(tags["<think>"]): 100, str(tags["</think>"]): 7})
        choice = chat.choices[0]
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content)["answer"], int)
        thought += bool(getattr(choice.message, "reasoning_content", None))
    assert thought, "no answer thought first"


def test_tool_calls_after_thinking_still_parse(client, tags):
    tools = [{"type": "function", "function": {"name": "multiply", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"]}}}]
    chat = client.chat.completions.create(
        model="tgi", messages=QUESTION, tools=tools, tool_choice="required", max_tokens=120, temperature=1.0,
        seed=1, logit_bias={str(tags["<think>"]): 100, str(tags["</think>"]): 8})
    choice = chat.choices[0]
    assert getattr(choice.message, "reasoning_content", None) is not None
    if choice.finish_reason == "tool_calls":
        call = choice.message.tool_calls[0]
        assert call.function.name == "multiply"
        assert set(json.loads(call.function.arguments)) == {"a", "b"}


@pytest.mark.parametrize("kwargs,param", [
    ("yes", "chat_template_kwargs"),
    ([1, 2], "chat_template_kwargs"),
    ({"messages": []}, "chat_template_kwargs.messages"),
])
def test_bad_template_kwargs_are_400(http, kwargs, param):
    resp = http.post("/v1/chat/completions", json={"messages": QUESTION, "chat_template_kwargs": kwargs})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
