"""Multi-step decode end to end: the session launcher runs the default
(`--decode-steps 8`), a second server the same flags with `--decode-steps 1`.
Greedy and seeded sampled outputs are the same token for token, alone and
32 at once; a stop string or EOS inside a burst of draws ends the answer
where one token per step ends it, with the same usage; the on server ran
fewer steps than it generated tokens (/metrics), and /info shows the
setting."""

import asyncio

import httpx
import pytest

from conftest import SESSION_FLAGS, start_launcher, stream_completion
from test_greedy_golden import PROMPTS
from test_prefix_caching import metric, model_name


@pytest.fixture(scope="module")
def one_step(tmp_path_factory):
    server = start_launcher(*SESSION_FLAGS, "--decode-steps", "1", tmp=tmp_path_factory.mktemp("one-step"))
    yield server
    server.stop()


def completion(base_url: str, **body) -> dict:
    body = {"model": model_name(base_url), **body}
    resp = httpx.post(f"{base_url}/v1/completions", json=body, timeout=300)
    resp.raise_for_status()
    return resp.json()


def test_info_shows_the_setting(one_step, launcher):
    assert httpx.get(f"{launcher.base_url}/info").json()["decode_steps"] == 8
    assert httpx.get(f"{one_step.base_url}/info").json()["decode_steps"] == 1


@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 0}, {"temperature": 0.9, "top_p": 0.95, "seed": 7, "frequency_penalty": 0.4}],
    ids=["greedy", "seeded"],
)
def test_same_tokens_with_several_draws_per_step(one_step, launcher, sampling):
    steps = metric(launcher.base_url, "sluice_scheduler_steps_total")
    generated = 0
    for prompt in PROMPTS:
        body = {"prompt": prompt, "max_tokens": 40, "logprobs": 1, **sampling}
        on = completion(launcher.base_url, **body)
        off = completion(one_step.base_url, **body)
        assert on["choices"][0]["logprobs"]["tokens"] == off["choices"][0]["logprobs"]["tokens"], prompt
        assert on["choices"][0]["finish_reason"] == off["choices"][0]["finish_reason"]
        assert on["usage"] == off["usage"]
        generated += on["usage"]["completion_tokens"]
    ran = metric(launcher.base_url, "sluice_scheduler_steps_total") - steps
    assert ran < generated, f"{ran} steps for {generated} tokens: no step drew several"


def test_a_stop_string_or_eos_inside_a_burst(one_step, launcher):
    """The stop string is a word of the 10th-20th token of the answer run
    without it: the answer ends before it in both servers, and usage counts
    the same tokens; a chat answer that ends at EOS ends the same way."""
    prompt = "Once upon a time, in a land far away,"
    full = completion(one_step.base_url, prompt=prompt, max_tokens=40, temperature=0)["choices"][0]["text"]
    words = full.split()
    stop = next(w for w in words[6:] if len(w) > 3)
    for base_url in (launcher.base_url, one_step.base_url):
        got = completion(base_url, prompt=prompt, max_tokens=40, temperature=0, stop=[stop])
        assert got["choices"][0]["finish_reason"] == "stop"
        assert got["choices"][0]["text"] == full[: full.index(stop)]
    stopped = [completion(u, prompt=prompt, max_tokens=40, temperature=0, stop=[stop])["usage"]
               for u in (launcher.base_url, one_step.base_url)]
    assert stopped[0] == stopped[1]

    def chat(base_url):
        resp = httpx.post(f"{base_url}/v1/chat/completions", timeout=300, json={
            "model": model_name(base_url), "messages": [{"role": "user", "content": "What is 2+2?"}],
            "max_tokens": 200, "temperature": 0,
        })
        resp.raise_for_status()
        return resp.json()

    on, off = chat(launcher.base_url), chat(one_step.base_url)
    assert off["choices"][0]["finish_reason"] == "stop", "the answer should end at EOS within 200 tokens"
    assert on["choices"][0] == off["choices"][0]
    assert on["usage"] == off["usage"]


def test_32_concurrent_streams_identical(one_step, launcher):
    prompts = [f"Write item number {i} of a shopping list: item {i}, item {i}," for i in range(32)]

    async def texts(base_url: str) -> list[str]:
        async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
            return list(await asyncio.gather(*(stream_completion(client, model, p, 24) for p in prompts)))

    on = asyncio.run(texts(launcher.base_url))
    off = asyncio.run(texts(one_step.base_url))
    assert all(off)
    assert on == off
