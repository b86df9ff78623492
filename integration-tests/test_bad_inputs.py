"""Bad input gets a 4xx naming the problem, and the server keeps serving."""

import json

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


# The session launcher's --payload-limit (the default).
PAYLOAD_LIMIT = 2_000_000


def says_the_limit(message: str) -> bool:
    return f"limit of {PAYLOAD_LIMIT} bytes (--payload-limit)" in message


def oversized(model) -> dict:
    return chat(model, messages=[{"role": "user", "content": "x" * PAYLOAD_LIMIT}])


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/generate"])
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_an_oversized_body_is_413_naming_the_limit(http, model, path, chunked):
    """Whether the body declares its length (refused unread) or arrives
    chunked and grows past the limit, the 413 names the limit in bytes and
    the flag, in the route's error shape."""
    body = json.dumps({**oversized(model), "inputs": "hi"}).encode()
    # A generator: httpx sends it chunked, with no Content-Length.
    content = (body[i:i + 65536] for i in range(0, len(body), 65536)) if chunked else body
    resp = http.post(path, content=content, headers={"content-type": "application/json"})
    assert resp.status_code == 413, resp.text
    if path.startswith("/v1/"):
        error = resp.json()["error"]
        assert error["code"] == "payload_too_large" and says_the_limit(error["message"]), resp.text
    else:
        body = resp.json()
        assert body["error_type"] == "payload_too_large" and says_the_limit(body["error"]), resp.text


def test_the_openai_client_reads_the_413(launcher, model):
    import openai

    client = openai.OpenAI(base_url=f"{launcher.base_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIStatusError) as raised:
        client.chat.completions.create(**oversized(model))
    assert raised.value.status_code == 413
    assert says_the_limit(raised.value.message), raised.value.message
