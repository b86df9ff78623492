"""gpt-oss's harmony format end to end (issue 36): a tiny random-weight
gpt-oss (transformers' GptOssConfig) with SmolLM2's tokenizer plus harmony's
special tokens and a harmony chat template, served with the reasoning
parser its template picks (`gpt_oss`).

Random weights do not write harmony by themselves, so the channel split
itself is shown by the router's tests (the exact outputs gpt-oss writes,
through every API). Here: /info names the parser, every chat API answers,
and a forced tool call -- the harmony tool grammar masks the real shard's
logits, and a bias on <|end|> closes an analysis message at once -- comes
back as a tool call whose arguments follow the schema, ended by <|call|>
(an EOS token)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from conftest import start_launcher

SPECIALS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]

# A compact harmony template: gpt-oss's structure (system, a developer
# message declaring the functions, channels on assistant messages, tool
# results from functions.NAME), without its long preamble.
TEMPLATE = """
<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}

# Valid channels: analysis, commentary, final. Channel must be included for every message.
{%- if tools %}
Calls to these tools must go to the commentary channel: 'functions'.{% endif %}<|end|>
{%- if tools %}<|start|>developer<|message|># Tools

## functions

namespace functions {
{% for t in tools %}
// {{ t.function.description | default('') }}
type {{ t.function.name }} = (_: {{ t.function.parameters | tojson }}) => any;
{% endfor %}
} // namespace functions<|end|>{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' %}
{%- if m.reasoning_content %}<|start|>assistant<|channel|>analysis<|message|>{{ m.reasoning_content }}<|end|>{% endif %}
{%- if m.tool_calls %}{% for c in m.tool_calls %}<|start|>assistant<|channel|>commentary to=functions.{{ c.function.name }} \
<|constrain|>json<|message|>{{ c.function.arguments | tojson }}<|call|>{% endfor %}
{%- else %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>{% endif %}
{%- elif m.role == 'tool' %}<|start|>functions.{{ m.name | default('tool') }} to=assistant<|channel|>commentary<|message|>{{ m.content }}<|end|>
{%- else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}
""".strip()

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}}]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from tokenizers import AddedToken, Tokenizer
    from sluice_server.download import bundled_model_path, resolve_model
    from sluice_server.testing import make_tiny_model

    source = resolve_model(str(bundled_model_path()))
    tokenizer = Tokenizer.from_file(str(source / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    ids = {t: tokenizer.token_to_id(t) for t in SPECIALS}
    eos = [ids["<|return|>"], ids["<|call|>"]]
    out = make_tiny_model(tmp_path_factory.mktemp("tiny-gpt-oss"), "gpt_oss", seed=5, vocab_size=49216,
                          bos_token_id=1, eos_token_id=eos, max_position_embeddings=1024,
                          # YaRN's context (factor x original) is what the shard serves: 16 x 64.
                          rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 16.0,
                                           "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                           "original_max_position_embeddings": 64})
    tokenizer.save(str(out / "tokenizer.json"))
    config = json.loads((source / "tokenizer_config.json").read_text())
    for key in ("chat_template", "added_tokens_decoder"):
        config.pop(key, None)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    (out / "chat_template.jinja").write_text(TEMPLATE)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "bos_token_id": 1}))
    (out / "harmony_ids.json").write_text(json.dumps(ids))
    return out


@pytest.fixture(scope="module")
def http(model_dir, tmp_path_factory):
    server = start_launcher("--model-id", str(model_dir), "--dtype", "float32", "--max-total-tokens", "1024",
                            "--max-input-tokens", "768", "--max-batch-prefill-tokens", "768",
                            "--kv-cache-bytes", str(32 * 1024 * 1024), tmp=tmp_path_factory.mktemp("gpt-oss"))
    with httpx.Client(base_url=server.base_url, timeout=300) as client:
        yield client
    server.stop()


@pytest.fixture(scope="module")
def ids(model_dir) -> dict[str, int]:
    return json.loads((model_dir / "harmony_ids.json").read_text())


def test_info_names_the_harmony_parser(http):
    assert http.get("/info").json()["reasoning_parser"] == "gpt_oss"


def test_every_chat_api_answers(http):
    chat = http.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 8})
    assert chat.status_code == 200, chat.text
    message = chat.json()["choices"][0]["message"]
    assert isinstance(message["content"], str) or message.get("tool_calls"), message
    with http.stream("POST", "/v1/chat/completions",
                     json={"messages": QUESTION, "max_tokens": 8, "stream": True}) as streamed:
        assert streamed.status_code == 200
        frames = [line for line in streamed.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "data: [DONE]", frames
    responses = http.post("/v1/responses", json={"input": "Weather in Paris?", "max_output_tokens": 8})
    assert responses.status_code == 200, responses.text
    # A random model rarely ends within 8 tokens: then the response is
    # incomplete, saying why.
    created = responses.json()
    assert created["status"] in ("completed", "incomplete"), created
    if created["status"] == "incomplete":
        assert created["incomplete_details"]["reason"] == "max_output_tokens", created
    messages = http.post("/v1/messages", json={"model": "tgi", "max_tokens": 8, "messages": QUESTION})
    assert messages.status_code == 200, messages.text
    assert messages.json()["type"] == "message"


def test_a_forced_call_is_read_back_as_a_tool_call(http, ids):
    body = {"messages": QUESTION, "tools": TOOLS, "max_tokens": 200, "temperature": 0,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            # An analysis message (which the grammar allows) ends at once.
            "logit_bias": {str(ids["<|end|>"]): 100}}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    called = choice["message"]["tool_calls"][0]["function"]
    assert called["name"] == "get_weather"
    arguments = json.loads(called["arguments"])
    assert set(arguments) == {"city"} and len(arguments["city"]) <= 12, arguments
    # The call and its result go back through the harmony template.
    history = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": choice["message"]["tool_calls"]},
        {"role": "tool", "tool_call_id": choice["message"]["tool_calls"][0]["id"], "content": "sunny"},
    ]
    again = http.post("/v1/chat/completions", json={"messages": history, "tools": TOOLS, "max_tokens": 8})
    assert again.status_code == 200, again.text
