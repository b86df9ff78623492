"""The router against one real shard: `sluice-server serve` on a tiny
random-weight Llama plus `sluice-router`, checked over HTTP end to end
(/generate, /generate_stream, /v1/chat/completions streaming and not,
/v1/completions, /openapi.json as valid OpenAPI 3).

The router binary: $SLUICE_ROUTER_BIN, else the installed `sluice-router`
(see conftest.find_executable).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import find_executable

REPO = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 180

# A byte-fallback tokenizer: <unk> <s> </s>, then one token per byte, so the
# 259-token tiny model can say anything and decoding exercises UTF-8 assembly.
VOCAB_SIZE = 259
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def router_binary() -> str:
    return find_executable("sluice-router")


def write_tokenizer(folder: Path) -> None:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    special = [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for t, i in list(vocab.items())[:3]
    ]
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": special,
        "normalizer": None, "pre_tokenizer": None,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}},
        },
        "decoder": {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True,
                  "ignore_merges": False, "vocab": vocab, "merges": []},
    }
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE}))


def make_model(folder: Path) -> Path:
    from sluice_server.testing import make_tiny_model

    make_tiny_model(folder, "llama", vocab_size=VOCAB_SIZE, bos_token_id=1)
    write_tokenizer(folder)
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("tiny-router-model"))


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir):
    folder = model_dir
    uds = str(tmp_path_factory.mktemp("sock") / "shard")
    logs = tmp_path_factory.mktemp("logs")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(REPO / d) for d in ("server", "kernels")), OMP_NUM_THREADS="1")
    shard = subprocess.Popen(
        [sys.executable, "-m", "sluice_server.cli", "serve", str(folder), "--uds-path", uds,
         "--kv-cache-bytes", str(8 << 20), "--num-threads", "1"],
        env=env, stdout=open(logs / "shard.log", "w"), stderr=subprocess.STDOUT,
    )
    port = free_port()
    router = subprocess.Popen(
        [router_binary(), "--master-shard-uds-path", f"{uds}-0", "--tokenizer", str(folder),
         "--model-id", "tiny-llama", "--hostname", "127.0.0.1", "--port", str(port),
         "--max-total-tokens", "128", "--max-batch-prefill-tokens", "128", "--max-concurrent-requests", "16"],
        stdout=open(logs / "router.log", "w"), stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S

    def output() -> str:
        return "\n".join(f"--- {n}.log\n" + (logs / f"{n}.log").read_text()[-3000:] for n in ("shard", "router"))

    try:
        while True:
            for name, proc in (("shard", shard), ("router", router)):
                if proc.poll() is not None:
                    pytest.fail(f"{name} exited with {proc.returncode}:\n{output()}")
            try:
                if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"router not ready after {START_TIMEOUT_S}s:\n{output()}")
            time.sleep(0.5)
        yield base
        # SIGTERM: the router drains and exits 0, leaving the shard alone.
        stop(router)
        assert router.returncode == 0, output()
        assert "shut down cleanly" in output()
    finally:
        stop(router)
        stop(shard)


def sse(response: httpx.Response) -> list[str]:
    return [line[len("data:"):].strip() for line in response.iter_lines() if line.startswith("data:")]


def test_generate_greedy_is_deterministic(server):
    body = {"inputs": "Hello", "parameters": {"max_new_tokens": 8, "details": True, "decoder_input_details": True}}
    first = httpx.post(f"{server}/generate", json=body, timeout=60)
    assert first.status_code == 200, first.text
    out = first.json()
    details = out["details"]
    assert details["generated_tokens"] == len(details["tokens"]) <= 8
    assert details["finish_reason"] in ("length", "eos_token")
    assert [t["id"] for t in details["prefill"]][:2] == [1, 3 + ord("H")]
    assert details["prefill"][0]["logprob"] is None
    assert all(isinstance(t["logprob"], float) for t in details["prefill"][1:])
    again = httpx.post(f"{server}/generate", json=body, timeout=60).json()
    assert again["generated_text"] == out["generated_text"]


def test_generate_stream_matches_generate(server):
    body = {"inputs": "Hi there", "parameters": {"max_new_tokens": 6}}
    full = httpx.post(f"{server}/generate", json=body, timeout=60).json()["generated_text"]
    with httpx.stream("POST", f"{server}/generate_stream", json=body, timeout=60) as response:
        assert response.status_code == 200
        events = [json.loads(p) for p in sse(response)]
    assert events[-1]["generated_text"] == full
    assert "".join(e["token"]["text"] for e in events) == full
    assert events[-1]["details"]["generated_tokens"] == len(events)


def test_chat_completion(server):
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Say hi"}],
            "max_tokens": 5, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    response = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    out = response.json()
    choice = out["choices"][0]
    assert choice["finish_reason"] in ("stop", "length")
    assert out["usage"]["completion_tokens"] == len(choice["logprobs"]["content"]) <= 5
    assert all(len(c["top_logprobs"]) == 2 for c in choice["logprobs"]["content"])
    # The chat template's rendering, tokenized without extra specials:
    # <s> + "<|user|>Say hi" bytes + </s> + "<|assistant|>" bytes.
    expected_prompt = 1 + len("<|user|>Say hi") + 1 + len("<|assistant|>")
    assert out["usage"]["prompt_tokens"] == expected_prompt

    with httpx.stream("POST", f"{server}/v1/chat/completions", timeout=60,
                      json=dict(body, stream=True, stream_options={"include_usage": True})) as streamed:
        payloads = sse(streamed)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    text = "".join(c["choices"][0]["delta"]["content"] for c in chunks if c["choices"])
    assert text == choice["message"]["content"]
    assert chunks[-1]["usage"]["completion_tokens"] == out["usage"]["completion_tokens"]


def test_completions_with_token_prompt_and_n(server):
    body = {"model": "tiny-llama", "prompt": [[1, 50, 60], [1, 70]], "n": 2, "max_tokens": 4,
            "temperature": 1.0, "seed": 1}
    response = httpx.post(f"{server}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    again = httpx.post(f"{server}/v1/completions", json=body, timeout=60).json()["choices"]
    assert [c["text"] for c in again] == [c["text"] for c in choices], "seeded sampling is reproducible"


def metric(server: str, name: str) -> float:
    """The sum of every sample of `name` on /metrics; the series must exist."""
    samples = [
        float(line.rsplit(" ", 1)[1])
        for line in httpx.get(f"{server}/metrics", timeout=30).text.splitlines()
        if line.startswith(name) and line[len(name)] in " {"
    ]
    assert samples, f"{name} is not on /metrics"
    return sum(samples)


def test_bad_input_never_reaches_the_shard(server):
    steps = metric(server, "sluice_scheduler_steps_total")
    looked_up = metric(server, "sluice_prefix_cache_lookup_tokens_total")
    response = httpx.post(f"{server}/v1/completions", json={"prompt": [1, VOCAB_SIZE]}, timeout=10)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompt"
    response = httpx.post(f"{server}/generate", json={"inputs": "x" * 200}, timeout=10)
    assert response.status_code == 422
    assert response.json()["error_type"] == "validation"
    assert httpx.get(f"{server}/ready", timeout=10).status_code == 200
    # Nothing was queued, looked up in the prefix cache, or sent to the shard.
    assert metric(server, "sluice_scheduler_steps_total") == steps
    assert metric(server, "sluice_prefix_cache_lookup_tokens_total") == looked_up


def test_openapi_document_is_valid(server):
    from openapi_spec_validator import validate

    document = httpx.get(f"{server}/openapi.json", timeout=10).json()
    validate(document)
    assert "/v1/chat/completions" in document["paths"]


def test_hugging_face_clients_work_unchanged(server):
    from huggingface_hub import InferenceClient
    from text_generation import Client

    client = Client(server, timeout=60)
    response = client.generate("Hello", max_new_tokens=4, decoder_input_details=True)
    assert response.details.generated_tokens == len(response.details.tokens)
    streamed = list(client.generate_stream("Hello", max_new_tokens=4))
    assert streamed[-1].generated_text == response.generated_text

    hub = InferenceClient(base_url=server, timeout=60)
    out = hub.text_generation("Hello", max_new_tokens=4, details=True)
    assert out.generated_text == response.generated_text
    chat = hub.chat_completion([{"role": "user", "content": "hi"}], max_tokens=4, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    chunks = list(hub.chat_completion([{"role": "user", "content": "hi"}], max_tokens=4, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content


def test_openai_client_works_unchanged(server):
    import openai

    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    chat = client.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0)
    again = client.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0)
    # 25 prompt tokens: the second request reads its first full 16-token
    # block from the prefix cache (never the block of the last token).
    assert chat.usage.prompt_tokens == again.usage.prompt_tokens == 25
    assert again.usage.prompt_tokens_details.cached_tokens == 16
    assert again.choices[0].message.content == chat.choices[0].message.content
    completion = client.completions.create(model="tiny-llama", prompt="Hello", max_tokens=3, echo=True, logprobs=1)
    assert completion.choices[0].text.startswith("Hello")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)


def test_port_in_use_is_one_clear_error(tmp_path, model_dir):
    uds = str(tmp_path / "shard")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(REPO / d) for d in ("server", "kernels")), OMP_NUM_THREADS="1")
    shard = subprocess.Popen(
        [sys.executable, "-m", "sluice_server.cli", "serve", str(model_dir), "--uds-path", uds,
         "--kv-cache-bytes", str(8 << 20), "--num-threads", "1"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    taken = socket.socket()
    try:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        router = subprocess.run(
            [router_binary(), "--master-shard-uds-path", f"{uds}-0", "--tokenizer", str(model_dir),
             "--hostname", "127.0.0.1", "--port", str(port), "--max-total-tokens", "128"],
            capture_output=True, text=True, timeout=START_TIMEOUT_S,
        )
    finally:
        taken.close()
        stop(shard)
    assert router.returncode != 0
    errors = [line for line in router.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and f"cannot listen on 127.0.0.1:{port}" in errors[0], router.stderr
