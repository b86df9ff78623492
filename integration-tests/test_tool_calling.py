"""Tool calling end to end (issue 17) with the bundled SmolLM2 (hermes
format; its template knows no tools, so they are described in the system
message) and the `openai` client: every call parses, names a declared tool
and has arguments valid under its schema."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from openai import OpenAI

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}}, "required": ["timezone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                      "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
QUESTION = [{"role": "user", "content": "What is the weather in Paris and the time in Tokyo?"}]


@pytest.fixture(scope="module")
def client(launcher) -> OpenAI:
    return OpenAI(base_url=f"{launcher.base_url}/v1", api_key="unused", timeout=600)


def check_calls(calls, finish: str = "tool_calls") -> None:
    """Every call names a declared tool with valid arguments; after
    `finish_reason: length` the last call may be cut short (a small model
    can keep calling until max_tokens)."""
    assert calls
    ids = [c.id for c in calls]
    assert len(set(ids)) == len(ids) and all(ids)
    for call in calls:
        assert call.function.name in SCHEMAS
    whole = calls[:-1] if finish == "length" else calls
    for call in whole:
        assert call.type == "function"
        assert call.function.name in SCHEMAS
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def ask(client, **kwargs):
    kwargs = {"messages": QUESTION, "tools": TOOLS, "max_tokens": 300, "temperature": 0, **kwargs}
    return client.chat.completions.create(model="tgi", **kwargs)


def test_required_always_calls(client):
    choice = ask(client, tool_choice="required").choices[0]
    assert choice.finish_reason == "tool_calls"
    check_calls(choice.message.tool_calls)


def test_named_calls_that_function_once(client):
    choice = ask(client, tool_choice={"type": "function", "function": {"name": "get_time"}}).choices[0]
    assert choice.finish_reason == "tool_calls"
    check_calls(choice.message.tool_calls)
    assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]


def test_none_answers_in_text(client):
    choice = ask(client, tool_choice="none", max_tokens=20).choices[0]
    assert not choice.message.tool_calls
    assert choice.finish_reason in ("stop", "length")
    assert isinstance(choice.message.content, str)


def streamed(stream) -> tuple[str, list[dict], str | None]:
    """The content, calls and finish reason of a streamed chat answer,
    checking OpenAI's shape: a call's first delta carries its id, type and
    name, later ones only argument fragments; calls are indexed from 0."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            if delta.index not in calls:
                assert delta.id and delta.type == "function" and delta.function.name
                calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
            else:
                assert delta.id is None and not delta.function.name
            calls[delta.index]["arguments"] += delta.function.arguments or ""
    assert sorted(calls) == list(range(len(calls)))
    return content, [calls[i] for i in sorted(calls)], finish


def test_auto_is_text_or_valid_calls_streamed_or_not(client):
    for seed in range(3):
        choice = ask(client, tool_choice="auto", temperature=1.0, seed=seed).choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason in ("tool_calls", "length")
            check_calls(choice.message.tool_calls, choice.finish_reason)
        else:
            assert choice.finish_reason in ("stop", "length")
        # Seeded: the stream is the same answer, split into deltas.
        content, calls, finish = streamed(ask(client, tool_choice="auto", temperature=1.0, seed=seed, stream=True))
        assert finish == choice.finish_reason
        assert content == (choice.message.content or "")
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]


def test_no_parallel_calls_means_one(client):
    choice = ask(client, tool_choice="required", parallel_tool_calls=False).choices[0]
    check_calls(choice.message.tool_calls)
    assert len(choice.message.tool_calls) == 1


def test_parallel_calls_come_when_allowed(client):
    """`parallel_tool_calls` (the default) lets one answer hold several
    calls: some seeded answer to a two-part question makes two or more, each
    valid."""
    most = 0
    for seed in range(6):
        choice = ask(client, tool_choice="required", parallel_tool_calls=True, temperature=1.0, seed=seed).choices[0]
        check_calls(choice.message.tool_calls, choice.finish_reason)
        whole = len(choice.message.tool_calls) - (choice.finish_reason == "length")
        most = max(most, whole)
        if most >= 2:
            break
    assert most >= 2


def test_streamed_named_and_none_match_unstreamed(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    content, calls, finish = streamed(ask(client, tool_choice=named, stream=True))
    assert finish == "tool_calls" and not content
    assert [c["name"] for c in calls] == ["get_time"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), TIME)
    whole = ask(client, tool_choice=named).choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in whole] == [(c["name"], c["arguments"]) for c in calls]

    content, calls, finish = streamed(ask(client, tool_choice="none", max_tokens=20, stream=True))
    assert not calls and finish in ("stop", "length")
    assert content == ask(client, tool_choice="none", max_tokens=20).choices[0].message.content


def test_streamed_calls_send_id_and_name_first_then_arguments(client):
    content, calls, finish = streamed(ask(client, tool_choice="required", stream=True))
    assert finish == "tool_calls"
    assert calls and not content
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])

    # The same request unstreamed gives the same calls (greedy).
    whole = ask(client, tool_choice="required").choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in whole] == [(c["name"], c["arguments"]) for c in calls]


def test_two_turns_with_the_tool_result(client):
    first = ask(client, tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0].message
    call = first.tool_calls[0]
    messages = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "clear"})},
    ]
    second = ask(client, messages=messages, tool_choice="auto").choices[0]
    if second.message.tool_calls:
        check_calls(second.message.tool_calls, second.finish_reason)
    else:
        assert isinstance(second.message.content, str) and second.finish_reason in ("stop", "length")
    # And once more, forcing the other tool, so the third turn parses too.
    third = ask(client, messages=messages, tool_choice={"type": "function", "function": {"name": "get_time"}})
    check_calls(third.choices[0].message.tool_calls)


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
])
def test_bad_tools_are_400s(launcher, body, param):
    r = httpx.post(f"{launcher.base_url}/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "hi"}], **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
