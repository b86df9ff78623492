"""--decode-stall-ms end to end: with a 1 ms limit, a long prompt that
arrives while another request decodes is read in small chunks, each step
also decoding the other request, and both answers are the session server's
token for token; /info shows the setting (the session server's default,
1000 ms, too)."""

import asyncio

import httpx
import pytest

from conftest import SESSION_FLAGS, start_launcher, stream_completion
from test_prefix_caching import metric, model_name


@pytest.fixture(scope="module")
def stalling(tmp_path_factory):
    server = start_launcher(*SESSION_FLAGS, "--decode-stall-ms", "1", "--decode-steps", "1",
                            tmp=tmp_path_factory.mktemp("stalling"))
    yield server
    server.stop()


def test_info_shows_the_setting(stalling, launcher):
    assert httpx.get(f"{stalling.base_url}/info").json()["decode_stall_ms"] == 1
    assert httpx.get(f"{launcher.base_url}/info").json()["decode_stall_ms"] == 1000


def test_a_long_prompt_is_read_in_chunks_next_to_a_decode(stalling, launcher):
    decoding = "Once upon a time, in a land far away,"
    long = " ".join(f"Item {i} of the list is a word." for i in range(60))

    async def run(base_url: str) -> tuple[str, str, float, int]:
        async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
            model = model_name(base_url)
            first = asyncio.Event()
            a = asyncio.create_task(stream_completion(client, model, decoding, 400, first_token=first, ignore_eos=True))
            await first.wait()
            steps = metric(base_url, "sluice_scheduler_steps_total")
            resp = await client.post("/v1/completions", json={"model": model, "prompt": long, "max_tokens": 4,
                                                              "temperature": 0})
            resp.raise_for_status()
            ran = metric(base_url, "sluice_scheduler_steps_total") - steps
            assert not a.done(), "the decoding request ended before the long prompt was read"
            body = resp.json()
            return await a, body["choices"][0]["text"], ran, body["usage"]["prompt_tokens"]

    a_on, b_on, steps, prompt_tokens = asyncio.run(run(stalling.base_url))
    a_ref, b_ref, _, _ = asyncio.run(run(launcher.base_url))
    assert (a_on, b_on) == (a_ref, b_ref)
    # 16 prompt tokens a step at the least (1 ms fits nothing more): at
    # least prompt_tokens / 17 steps for the prompt, then its 3 decodes.
    assert prompt_tokens > 400
    assert steps >= prompt_tokens // 17, f"{steps} steps for a {prompt_tokens}-token prompt"
