"""Constrained outputs under load (issue 17), with a tiny random-weight model
(its outputs are noise, so only the grammar makes them valid):

- 32 clients at once, half constrained (JSON schema, regex, choice, tool
  calls), half not, prefix caching on (they share a system prompt) and a KV
  budget small enough to preempt: every constrained output validates, and
  each one equals what the same request gives alone (a preempted request's
  matcher is rebuilt where it stood);
- two tensor-parallel shards: the same requests, every output valid.
"""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema

from conftest import start_launcher
from test_prefix_caching import metric

SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "tier": {"enum": ["gold", "silver"]},
                   "ok": {"type": "boolean"}},
    "required": ["id", "tier", "ok"],
    "additionalProperties": False,
}
REGEX = r"[A-Z]{2}-\d{4}"
CHOICES = ["alpha", "beta", "gamma"]
# No extra keys: a random model would otherwise add one and write its name
# until max_tokens (valid, but never finished).
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"key": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["key"],
    "additionalProperties": False}}}]
SYSTEM = "You are a terse assistant. " * 4


def request(i: int) -> dict:
    """Request i: constrained in four ways for even i, free for odd i."""
    body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Item {i}?"}],
            "max_tokens": 40, "temperature": 0}
    kind = ("schema", "regex", "choice", "tools")[(i // 2) % 4] if i % 2 == 0 else "free"
    if kind == "schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA}}
    elif kind == "regex":
        body["guided_regex"] = REGEX
    elif kind == "choice":
        body["guided_choice"] = CHOICES
    elif kind == "tools":
        body["tools"] = TOOLS
        body["tool_choice"] = "required"
        # One call, then EOS: with parallel calls a random model calls until max_tokens.
        body["parallel_tool_calls"] = False
    else:
        body["ignore_eos"] = True
    return kind, body


def check(kind: str, message: dict, finish: str) -> None:
    if kind == "free":
        return
    assert finish in ("stop", "tool_calls"), (kind, finish, message)
    if kind == "schema":
        jsonschema.validate(json.loads(message["content"]), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(REGEX, message["content"]), message
    elif kind == "choice":
        assert message["content"] in CHOICES, message
    else:
        calls = message["tool_calls"]
        assert calls and all(c["function"]["name"] == "lookup" for c in calls)
        for call in calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]), TOOLS[0]["function"]["parameters"])


async def ask(client: httpx.AsyncClient, i: int) -> tuple[str, dict, str]:
    kind, body = request(i)
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return kind, choice["message"], choice["finish_reason"]


def run(base_url: str, indices: list[int], together: bool) -> list[tuple[str, dict, str]]:
    async def go():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=base_url, timeout=900, limits=limits) as client:
            if together:
                return await asyncio.gather(*(ask(client, i) for i in indices))
            return [await ask(client, i) for i in indices]

    return asyncio.run(go())


def test_32_clients_mixed_with_preemption_and_prefix_caching(tiny_model_dir, tmp_path):
    server = start_launcher(
        "--model-id", str(tiny_model_dir),
        # The tool request's prompt (tools described in the system message)
        # is the longest, about 160 tokens.
        "--max-input-tokens", "300", "--max-total-tokens", "340",
        # Room for 2 full requests (42 blocks): the 16 free requests alone
        # hold about 80 by their end (47 + 40 tokens each, a block shared),
        # so 32 at once must preempt. (Room for 4 did not: the constrained
        # answers end after a few tokens.)
        "--max-batch-total-tokens", str(2 * 340),
        "--max-concurrent-requests", "64",
        tmp=tmp_path,
    )
    try:
        indices = list(range(32))
        constrained = [i for i in indices if i % 2 == 0]
        alone = run(server.base_url, constrained, together=False)
        preemptions_before = metric(server.base_url, "sluice_preemptions_total")
        together = run(server.base_url, indices, together=True)
        preemptions = metric(server.base_url, "sluice_preemptions_total") - preemptions_before
        hits = metric(server.base_url, "sluice_prefix_cache_hit_tokens_total")
    finally:
        server.stop()
    for kind, message, finish in alone + together:
        check(kind, message, finish)
    by_index = dict(zip(indices, together))
    for i, (kind, message, _) in zip(constrained, alone):
        if kind == "tools":  # call ids are fresh each time
            strip = lambda m: [(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]  # noqa: E731
            assert strip(message) == strip(by_index[i][1]), i
        else:
            assert message["content"] == by_index[i][1]["content"], i
    assert preemptions > 0
    assert hits > 0


def test_tensor_parallel_shards_keep_outputs_valid(tiny_model_dir, tmp_path):
    server = start_launcher("--model-id", str(tiny_model_dir), "--num-shard", "2", "--max-total-tokens", "340",
                            tmp=tmp_path)
    try:
        results = run(server.base_url, list(range(0, 16, 2)), together=True)
    finally:
        server.stop()
    for kind, message, finish in results:
        check(kind, message, finish)
