"""Bad input gets a 4xx naming the problem, and the server keeps serving."""

import httpx
import pytest


@pytest.fixture(scope="module")
def http(launcher):
    with httpx.Client(base_url=launcher.base_url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def model(http):
    return http.get("/v1/models").json()["data"][0]["id"]


def chat(model, **extra):
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}


CASES = [
    # (path, body builder, expected status, OpenAI error `param` (the field
    # named; None for TGI routes or errors about no single field), words the
    # message must contain)
    ("/v1/completions", lambda m: {"model": m, "prompt": "hello " * 3000}, 400, "prompt", ["token"]),
    ("/v1/chat/completions", lambda m: chat(m, max_tokens=-1), 400, "max_tokens", ["max_tokens"]),
    ("/v1/chat/completions", lambda m: chat(m, temperature="hot"), 400, "temperature", ["temperature"]),
    ("/v1/chat/completions", lambda m: {"model": m, "messages": []}, 400, "messages", ["messages"]),
    ("/v1/chat/completions", lambda m: chat("no-such-model"), 404, "model", ["no-such-model"]),
    ("/v1/chat/completions", lambda m: chat(m, top_p=0), 400, "top_p", ["top_p"]),
    ("/v1/chat/completions", lambda m: chat(m, n=0), 400, "n", ["`n` is out of range"]),
    ("/v1/completions", lambda m: {"model": m, "prompt": [999999]}, 400, "prompt", ["999999"]),
    ("/generate", lambda m: {"inputs": "", "parameters": {"max_new_tokens": 4}}, 422, None, ["empty"]),
    ("/generate", lambda m: {"inputs": "hi", "parameters": {"max_new_tokens": 0}}, 422, None, ["max_new_tokens"]),
    ("/generate", lambda m: {"inputs": "hi", "parameters": {"top_n_tokens": 1000}}, 422, None, ["top_n_tokens"]),
    # Limits of issue 16: a max_tokens near 2^64 (no overflow), a stop
    # sequence longer than 1024 bytes, one token biased under two spellings
    # (keys are read in sorted order: "5" comes second),
    # more than 1024 biased tokens.
    ("/v1/completions", lambda m: {"model": m, "prompt": "hi", "max_tokens": 2**64 - 1}, 400, "max_tokens",
     [str(2**64 - 1)]),
    ("/v1/chat/completions", lambda m: chat(m, stop=["ok", "x" * 1025]), 400, "stop[1]", ["1024 bytes"]),
    ("/v1/chat/completions", lambda m: chat(m, logit_bias={"5": 10, "05": 10}), 400, "logit_bias.5",
     ["more than once"]),
    ("/v1/chat/completions", lambda m: chat(m, logit_bias={str(i): 1 for i in range(1025)}), 400, "logit_bias",
     ["at most 1024"]),
]


@pytest.mark.parametrize("path,build,status,param,words", CASES)
def test_bad_input_is_4xx(http, model, path, build, status, param, words):
    resp = http.post(path, json=build(model))
    assert resp.status_code == status, resp.text
    if path.startswith("/v1/"):
        assert resp.json()["error"]["param"] == param, resp.text
    text = resp.text.lower()
    for word in words:
        assert word.lower() in text, resp.text
    # and the server still serves
    ok = http.post("/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}})
    assert ok.status_code == 200


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/generate"])
def test_malformed_json_is_4xx(http, path):
    resp = http.post(path, content=b"{not json", headers={"content-type": "application/json"})
    assert 400 <= resp.status_code < 500
    assert "json" in resp.text.lower() or "parse" in resp.text.lower() or "expected" in resp.text.lower()


def test_openai_error_shape(http, model):
    resp = http.post("/v1/chat/completions", json=chat(model, max_tokens=-1))
    err = resp.json()["error"]
    assert err["message"] and err["type"]


def test_tgi_error_shape(http):
    resp = http.post("/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 0}})
    body = resp.json()
    assert body["error"] and body["error_type"] == "validation"
