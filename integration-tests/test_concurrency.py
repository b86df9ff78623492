"""32 concurrent streams each produce the text they produce alone."""

import asyncio
import json

import httpx

PROMPTS = [f"Write item number {i} of a shopping list:" for i in range(32)]


async def stream_text(client: httpx.AsyncClient, prompt: str) -> str:
    model = (await client.get("/v1/models")).json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0, "stream": True}
    text = ""
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            for choice in chunk["choices"]:
                text += choice["text"]
    return text


def test_32_concurrent_streams_match_alone(launcher):
    async def run():
        async with httpx.AsyncClient(base_url=launcher.base_url, timeout=300) as client:
            alone = [await stream_text(client, p) for p in PROMPTS[:32]]
            together = await asyncio.gather(*(stream_text(client, p) for p in PROMPTS))
            return alone, together

    alone, together = asyncio.run(run())
    assert all(alone)
    assert together == alone
