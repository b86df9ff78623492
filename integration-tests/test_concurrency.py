"""32 concurrent streams each produce the text they produce alone."""

import asyncio

import httpx

from conftest import stream_completion

PROMPTS = [f"Write item number {i} of a shopping list:" for i in range(32)]


async def stream_text(client: httpx.AsyncClient, prompt: str) -> str:
    model = (await client.get("/v1/models")).json()["data"][0]["id"]
    return await stream_completion(client, model, prompt, 16)


def test_32_concurrent_streams_match_alone(launcher):
    async def run():
        async with httpx.AsyncClient(base_url=launcher.base_url, timeout=300) as client:
            alone = [await stream_text(client, p) for p in PROMPTS[:32]]
            together = await asyncio.gather(*(stream_text(client, p) for p in PROMPTS))
            return alone, together

    alone, together = asyncio.run(run())
    assert all(alone)
    assert together == alone
