"""Speculative decoding end to end (`--speculate ngram`): greedy output is the
same token for token as without speculation (the session launcher, same
flags, is the "off" server), alone, 32 at once, from the prefix cache, and
through preemption on a tiny KV cache; drafts were really proposed and
accepted (/metrics), and /info shows the settings."""

import asyncio

import httpx
import pytest

from conftest import SESSION_FLAGS, alone_then_together, start_launcher, stream_completion
from test_greedy_golden import PROMPTS as GOLDEN_PROMPTS
from test_prefix_caching import metric, model_name, word_tokens

# Prompts whose continuation copies their input: drafts get accepted.
COPYING = [
    "Repeat after me: the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the lazy dog. the quick",
    "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2,",
    "<|im_start|>user\nCopy this line exactly: red green blue red green blue red green blue<|im_end|>\n<|im_start|>assistant\n",
]
PROMPTS = GOLDEN_PROMPTS + COPYING


@pytest.fixture(scope="module")
def speculating(tmp_path_factory):
    server = start_launcher(
        *SESSION_FLAGS,
        "--speculate", "ngram", "--speculate-tokens", "4",
        # 32 concurrent requests still speculate, with room for their drafts
        # (the back-off and the step limit are tested by the router's tests).
        "--speculate-max-batch-size", "64", "--speculate-max-step-tokens", "1024",
        tmp=tmp_path_factory.mktemp("speculating"),
    )
    yield server
    server.stop()


def generated_ids(base_url: str, prompt: str, max_new_tokens: int = 40) -> list[int]:
    resp = httpx.post(
        f"{base_url}/generate",
        json={"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "details": True}},
        timeout=300,
    )
    resp.raise_for_status()
    return [t["id"] for t in resp.json()["details"]["tokens"]]


def test_info_shows_the_settings(speculating, launcher):
    info = httpx.get(f"{speculating.base_url}/info").json()
    assert info["speculation"] == {
        "method": "ngram", "speculate_tokens": 4, "ngram_min": 1, "ngram_max": 3, "max_batch_size": 64,
    }
    assert httpx.get(f"{launcher.base_url}/info").json()["speculation"] is None


def test_greedy_tokens_identical_with_speculation_on_and_off(speculating, launcher):
    before = metric(speculating.base_url, "sluice_speculative_accepted_tokens_total")
    for prompt in PROMPTS:
        on = generated_ids(speculating.base_url, prompt)
        off = generated_ids(launcher.base_url, prompt)
        assert on == off, prompt
        # Again, now mostly from the prefix cache.
        assert generated_ids(speculating.base_url, prompt) == off, prompt
    accepted = metric(speculating.base_url, "sluice_speculative_accepted_tokens_total") - before
    assert accepted > 0, "no draft token was accepted: the test did not exercise speculation"
    assert metric(launcher.base_url, "sluice_speculative_proposed_tokens_total") == 0


def test_32_concurrent_streams_identical_on_and_off(speculating, launcher):
    prompts = [f"Write item number {i} of a shopping list: item {i}, item {i}," for i in range(32)]

    async def texts(base_url: str, together: bool) -> list[str]:
        async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
            if together:
                return list(await asyncio.gather(*(stream_completion(client, model, p, 24) for p in prompts)))
            return [await stream_completion(client, model, p, 24) for p in prompts]

    off = asyncio.run(texts(launcher.base_url, together=False))
    before = metric(speculating.base_url, "sluice_speculative_proposed_tokens_total")
    on = asyncio.run(texts(speculating.base_url, together=True))
    assert all(off)
    assert on == off
    assert metric(speculating.base_url, "sluice_speculative_proposed_tokens_total") > before, "nothing was drafted"


def test_tiny_kv_cache_preemption_with_speculation(tiny_model_dir, tmp_path):
    """Room for 4 full-length requests, 48 clients at once, speculating: each
    matches what it produces alone, and preemption happened."""
    server = start_launcher(
        "--model-id", str(tiny_model_dir),
        "--max-input-tokens", "48", "--max-total-tokens", "96",
        "--max-batch-total-tokens", str(4 * 96),
        "--max-concurrent-requests", "128",
        "--speculate", "ngram", "--speculate-max-batch-size", "64", "--speculate-max-step-tokens", "1024",
        tmp=tmp_path,
    )
    try:
        model = model_name(server.base_url)
        # Repeated halves: the tiny model's output is random, its prompt is not.
        prompts = []
        for i in range(48):
            half = word_tokens(server.base_url, 300 + i, 12 + i % 12)
            prompts.append(half + half)
        alone, together = alone_then_together(server.base_url, model, prompts, 48)
        preemptions = metric(server.base_url, "sluice_preemptions_total")
        proposed = metric(server.base_url, "sluice_speculative_proposed_tokens_total")
    finally:
        server.stop()
    assert all(alone)
    mismatches = [i for i, (a, t) in enumerate(zip(alone, together)) if a != t]
    assert not mismatches, f"{len(mismatches)} requests differ, e.g. #{mismatches[0]}"
    assert preemptions > 0
    assert proposed > 0
