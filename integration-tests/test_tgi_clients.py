"""Hugging Face's `text-generation` client and `huggingface_hub.InferenceClient`."""

import pytest
from huggingface_hub import InferenceClient
from text_generation import Client


@pytest.fixture(scope="module")
def tgi(launcher):
    return Client(launcher.base_url, timeout=120)


def test_generate_details(tgi):
    resp = tgi.generate("The capital of France is", max_new_tokens=8, decoder_input_details=True)
    details = resp.details
    assert details.generated_tokens == len(details.tokens)
    assert 1 <= details.generated_tokens <= 8
    assert details.finish_reason.value in ("length", "eos_token", "stop_sequence")
    assert resp.generated_text == "".join(t.text for t in details.tokens if not t.special)
    # prefill: every prompt token, the first without a logprob
    assert len(details.prefill) > 3
    assert details.prefill[0].logprob is None or details.prefill[0].logprob != details.prefill[0].logprob
    assert all(p.logprob <= 0 for p in details.prefill[1:])
    assert details.seed is None  # greedy


def test_generate_top_n_tokens(tgi):
    resp = tgi.generate("Hello", max_new_tokens=4, top_n_tokens=3)
    assert len(resp.details.top_tokens) == resp.details.generated_tokens
    for chosen, tops in zip(resp.details.tokens, resp.details.top_tokens):
        assert len(tops) == 3
        assert tops[0].id == chosen.id


def test_generate_stream(tgi):
    full = tgi.generate("Once upon a time", max_new_tokens=12)
    tokens, last = [], None
    for resp in tgi.generate_stream("Once upon a time", max_new_tokens=12):
        tokens.append(resp.token)
        last = resp
    assert last.generated_text == full.generated_text
    assert last.details.generated_tokens == full.details.generated_tokens
    assert [t.id for t in tokens] == [t.id for t in full.details.tokens]


def test_sampling_with_seed(tgi):
    a = tgi.generate("Write a poem", max_new_tokens=10, do_sample=True, temperature=0.9, seed=42)
    b = tgi.generate("Write a poem", max_new_tokens=10, do_sample=True, temperature=0.9, seed=42)
    assert a.generated_text == b.generated_text
    assert a.details.seed == 42


def test_inference_client(launcher):
    client = InferenceClient(base_url=launcher.base_url)
    text = client.text_generation("The capital of France is", max_new_tokens=8)
    assert isinstance(text, str) and text
    out = client.chat_completion(messages=[{"role": "user", "content": "Hi!"}], max_tokens=8, temperature=0)
    assert out.choices[0].message.content
    chunks = list(
        client.chat_completion(messages=[{"role": "user", "content": "Hi!"}], max_tokens=8, temperature=0, stream=True)
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == out.choices[0].message.content
