"""The official `openai` client against the launcher with the bundled model."""

import math

import openai
import pytest


@pytest.fixture(scope="module")
def client(launcher):
    return openai.OpenAI(base_url=f"{launcher.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    models = client.models.list().data
    assert len(models) == 1
    return models[0].id


MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_completion(client, model):
    resp = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=16, temperature=0)
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert resp.usage.completion_tokens <= 16
    assert resp.usage.prompt_tokens > 5
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    # The same prompt again: every full block of it but the one holding its
    # last token comes from the prefix cache (16-token blocks).
    again = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=16, temperature=0)
    assert again.usage.prompt_tokens == resp.usage.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens == (resp.usage.prompt_tokens - 1) // 16 * 16
    assert again.choices[0].message.content == choice.message.content


def test_chat_stream_matches_non_stream(client, model):
    full = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=20, temperature=0)
    stream = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    text, usage, finish = "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert text == full.choices[0].message.content
    assert finish == full.choices[0].finish_reason
    assert usage is not None
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_completion_and_stream(client, model):
    prompt = "The three primary colors are"
    full = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
    assert full.choices[0].text
    assert full.usage.completion_tokens == 12 or full.choices[0].finish_reason == "stop"
    text = "".join(
        c.choices[0].text
        for c in client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True)
        if c.choices
    )
    assert text == full.choices[0].text


def test_max_tokens_gives_length(client, model):
    resp = client.completions.create(model=model, prompt="Count: 1, 2, 3,", max_tokens=5, temperature=0)
    assert resp.usage.completion_tokens == 5
    assert resp.choices[0].finish_reason == "length"


def test_chat_logprobs(client, model):
    resp = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    for item in content:
        assert item.logprob <= 0.0
        assert len(item.top_logprobs) == 3
        # greedy: the chosen token is the most likely one
        assert math.isclose(item.top_logprobs[0].logprob, item.logprob, abs_tol=1e-4)
        assert item.top_logprobs[0].token == item.token
        probs = [t.logprob for t in item.top_logprobs]
        assert probs == sorted(probs, reverse=True)


def test_completion_logprobs(client, model):
    resp = client.completions.create(model=model, prompt="Hello, my name is", max_tokens=4, temperature=0, logprobs=2)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == 4 and len(lp.token_logprobs) == 4
    assert all(len(t) == 2 for t in lp.top_logprobs)


def stop_across_tokens(tokens: list[str]) -> tuple[str, int]:
    """A two-character stop string, the last character of one token and the
    first of the next, whose first occurrence in the text is there: only a
    check across token boundaries finds it. Returns it and where it starts."""
    text, offset = "".join(tokens), 0
    for left, right in zip(tokens, tokens[1:]):
        offset += len(left)
        if left and right and offset > 1:
            stop = left[-1] + right[0]
            if stop.strip() and text.find(stop) == offset - 1:
                return stop, offset - 1
    pytest.fail(f"no stop string across a token boundary in {tokens!r}")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_stop_sequence_across_tokens_is_cut(client, model, stream):
    prompt = "1, 2, 3, 4,"
    base = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0, logprobs=0)
    tokens = base.choices[0].logprobs.tokens
    text = base.choices[0].text
    assert "".join(tokens) == text and len(tokens) == 16
    stop, start = stop_across_tokens(tokens)
    kwargs = dict(model=model, prompt=prompt, max_tokens=16, temperature=0, stop=[stop])
    if stream:
        chunks = list(client.completions.create(stream=True, **kwargs))
        got = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    else:
        resp = client.completions.create(**kwargs)
        got, finish = resp.choices[0].text, [resp.choices[0].finish_reason]
    assert finish == ["stop"]
    assert got == text[:start], (stop, tokens)


def test_seed_reproducible(client, model):
    kwargs = dict(model=model, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=24, temperature=1.0)
    a = client.chat.completions.create(seed=1234, **kwargs).choices[0].message.content
    b = client.chat.completions.create(seed=1234, **kwargs).choices[0].message.content
    others = {client.chat.completions.create(seed=s, **kwargs).choices[0].message.content for s in (1, 2, 3)}
    assert a == b
    assert len(others | {a}) > 1


def test_n_two(client, model):
    resp = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say something."}], max_tokens=12, temperature=1.0, n=2, seed=7
    )
    assert sorted(c.index for c in resp.choices) == [0, 1]
    assert resp.choices[0].message.content != resp.choices[1].message.content
    # usage counts the tokens of both choices
    assert 2 <= resp.usage.completion_tokens <= 24
