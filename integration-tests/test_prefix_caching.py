"""Prefix caching, preemption and chunked prefill end to end (issue 5).

Every test drives a real launcher (router + Python shard) over HTTP:

- greedy outputs are the same with prefix caching on and off, and the cache
  really serves tokens (`cached_tokens`, `/metrics`);
- a KV cache far too small for 64 concurrent clients preempts, and every
  request still gets the text it gets alone;
- a prompt 8x the step budget is read in chunks while 4 streams keep getting
  tokens.
"""

from __future__ import annotations

import asyncio
import random
import re
import time

import httpx

from conftest import alone_then_together, sse_chunks, start_launcher, stream_completion

BLOCK = 16  # the launcher's default --block-size


def metric(base_url: str, name: str, label: str = "") -> float:
    """Sum of the samples of `name` in /metrics whose labels contain `label`
    (e.g. 'outcome="success"'); 0 when the series is absent (a counter
    appears once it was first incremented)."""
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? (\S+)$", line)
        if m and label in (m.group(1) or ""):
            total += float(m.group(2))
    return total


def model_name(base_url: str) -> str:
    return httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"][0]["id"]


def complete(base_url: str, prompt: list[int], max_tokens: int = 12) -> dict:
    body = {"model": model_name(base_url), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    resp = httpx.post(f"{base_url}/v1/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()


def cached_tokens(response: dict) -> int:
    return response["usage"]["prompt_tokens_details"]["cached_tokens"]


def tokenize(base_url: str, text: str) -> list[int]:
    resp = httpx.post(f"{base_url}/tokenize", json={"inputs": text}, timeout=30)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    tokens = body["tokens"] if isinstance(body, dict) else body
    return [t["id"] if isinstance(t, dict) else t for t in tokens]


def word_tokens(base_url: str, seed: int, n: int) -> list[int]:
    """`n` token ids of plain English words, different for each seed."""
    words = ("river stone garden lamp window quiet harbor letter paper morning bread "
             "silver market winter candle forest bridge music orange cloud").split()
    rng = random.Random(seed)
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenize(base_url, " ".join(rng.choice(words) for _ in range(64)))
    return ids[:n]


def test_greedy_outputs_match_with_prefix_caching_on_and_off(launcher, tmp_path):
    """The session launcher (bundled model) caches; a second one does not."""
    base = word_tokens(launcher.base_url, 5, 200)
    other = word_tokens(launcher.base_url, 6, 60)
    # (prompt, tokens it shares with a prompt sent before it)
    #   base[:150]           150 tokens: ends mid-block (9 full blocks + 6)
    #   base[:150] + other   shares those 150
    #   base[:40] + other    shares 40 (2 full blocks + 8, mid-block)
    #   base[:7] + other     shares less than a block: nothing to reuse
    #   base[:160]           exactly 10 blocks; the last is recomputed for logits
    #   base[:150] + other   sent again: fully cached except its last block
    prompts = [
        (base[:150], 0),
        (base[:150] + other[:30], 150),
        (base[:40] + other[30:], 40),
        (base[:7] + other[:20], 7),
        (base[:160], 160),
        (base[:150] + other[:30], 180),
    ]
    off = start_launcher(
        "--dtype", "float32",  # as the shared launcher: texts compared one for one
        "--max-total-tokens", "2048", "--max-input-tokens", "1536",
        "--kv-cache-bytes", str(256 * 1024 * 1024), "--no-prefix-caching",
        tmp=tmp_path,
    )
    try:
        hits_before = metric(launcher.base_url, "sluice_prefix_cache_hit_tokens_total")
        lookups_before = metric(launcher.base_url, "sluice_prefix_cache_lookup_tokens_total")
        on_results = [complete(launcher.base_url, p) for p, _ in prompts]
        off_results = [complete(off.base_url, p) for p, _ in prompts]
        hits = metric(launcher.base_url, "sluice_prefix_cache_hit_tokens_total") - hits_before
        lookups = metric(launcher.base_url, "sluice_prefix_cache_lookup_tokens_total") - lookups_before
        off_hits = metric(off.base_url, "sluice_prefix_cache_hit_tokens_total")
    finally:
        off.stop()

    for (prompt, shared), on, off_ in zip(prompts, on_results, off_results):
        assert on["choices"][0]["text"] == off_["choices"][0]["text"], f"prompt of {len(prompt)} tokens"
        assert on["usage"]["prompt_tokens"] == len(prompt)
        cached = cached_tokens(on)
        # Whole blocks only, and never the block holding the last token.
        assert cached % BLOCK == 0 and cached <= (len(prompt) - 1) // BLOCK * BLOCK
        # At least every full block of the part shared with an earlier prompt.
        assert cached >= min(shared // BLOCK, (len(prompt) - 1) // BLOCK) * BLOCK, (len(prompt), shared, cached)
        assert cached_tokens(off_) == 0
    assert cached_tokens(on_results[1]) == 144
    assert cached_tokens(on_results[5]) == 176  # the repeated prompt: 11 of its 12 blocks
    assert any(o["choices"][0]["text"] for o in on_results)
    assert lookups >= sum(len(p) for p, _ in prompts)
    assert hits >= sum(cached_tokens(o) for o in on_results) and hits > 0
    assert off_hits == 0


def test_tiny_kv_cache_preempts_and_every_request_matches_alone(tiny_model_dir, tmp_path):
    """Room for 4 full-length requests (4 x 6 blocks), 64 clients at once."""
    server = start_launcher(
        "--model-id", str(tiny_model_dir),
        "--max-input-tokens", "48", "--max-total-tokens", "96",
        "--max-batch-total-tokens", str(4 * 96),
        "--max-concurrent-requests", "128",
        tmp=tmp_path,
    )
    try:
        model = model_name(server.base_url)
        prompts = [word_tokens(server.base_url, 100 + i, 24 + i % 24) for i in range(64)]
        preemptions_before = metric(server.base_url, "sluice_preemptions_total")
        alone, together = alone_then_together(server.base_url, model, prompts, 48)
        preemptions = metric(server.base_url, "sluice_preemptions_total") - preemptions_before
        outcomes = {o: metric(server.base_url, "sluice_requests_total", f'outcome="{o}"')
                    for o in ("success", "cancelled")}
    finally:
        server.stop()
    assert all(alone)
    mismatches = [i for i, (a, t) in enumerate(zip(alone, together)) if a != t]
    assert not mismatches, f"{len(mismatches)} requests differ, e.g. #{mismatches[0]}"
    assert preemptions > 0
    # Each streamed request is counted once, as what it was.
    assert outcomes == {"success": 128, "cancelled": 0}


def step_token_buckets(base_url: str) -> dict[str, float]:
    """The cumulative counts of sluice_batch_tokens (tokens computed per step)
    by bucket bound ("32", "128", "+Inf", ...)."""
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r'^sluice_batch_tokens_bucket\{le="([^"]+)"\} (\S+)$',
                                                              text, re.M)}


def test_chunked_prefill_keeps_streams_flowing(model_dir, tmp_path):
    """A 1,024-token prompt with a 128-token step budget while 4 clients
    stream: it is read in chunks of at most the budget, and every step that
    reads a chunk also decodes the streams, so each stream keeps getting
    tokens while the prompt is read. Counted in steps and tokens, not seconds.
    """
    budget = 128
    server = start_launcher(
        "--max-batch-prefill-tokens", str(budget),
        "--max-input-tokens", "1536", "--max-total-tokens", "2048",
        "--kv-cache-bytes", str(256 * 1024 * 1024),
        "--no-prefix-caching",  # the prompt is read in full
        tmp=tmp_path,
    )
    try:
        url = server.base_url
        model = model_name(url)
        long_prompt = word_tokens(url, 300, 8 * budget)
        short_prompts = [word_tokens(url, 310 + i, 16) for i in range(4)]
        before = step_token_buckets(url)

        async def run():
            stamps: list[list[float]] = [[] for _ in short_prompts]
            firsts = [asyncio.Event() for _ in short_prompts]
            async with httpx.AsyncClient(base_url=url, timeout=600) as client:
                streams = [
                    asyncio.create_task(stream_completion(client, model, p, 96, s, f, ignore_eos=True))
                    for p, s, f in zip(short_prompts, stamps, firsts)
                ]
                for f in firsts:
                    await f.wait()
                long_first = asyncio.Event()
                sent = time.monotonic()
                long_task = asyncio.create_task(
                    stream_completion(client, model, long_prompt, 2, None, long_first))
                await long_first.wait()
                read = time.monotonic()
                await asyncio.gather(long_task, *streams)
            return stamps, sent, read

        stamps, sent, read = asyncio.run(run())
        after = step_token_buckets(url)
    finally:
        server.stop()

    steps = {le: after[le] - before.get(le, 0.0) for le in after}
    # No step computed more than the budget...
    assert steps["+Inf"] == steps["128"], steps
    # ...so reading the prompt took at least 1024 / 128 = 8 steps of more
    # than 32 tokens (the streams' decodes are 4 tokens a step).
    assert steps["128"] - steps["32"] >= 8, steps
    # Each of those steps decoded every stream: the streams got a token per
    # chunk while the prompt was read (the last chunk's step also produced
    # the long prompt's first token, so its tokens may arrive after it).
    for s in stamps:
        during = [t for t in s if sent <= t <= read]
        assert len(during) >= 7, f"a stream got {len(during)} tokens while the long prompt was read"


def test_sampling_through_preemption_matches_alone(tmp_path):
    """Seeded sampling with every penalty and min_tokens, 64 clients on a KV
    cache with room for 4: preempted requests resume (prompt + generated
    tokens, the boundary marked) and end with exactly the tokens they get
    alone.

    The byte-level model of test_router_shard has 259 tokens, so a
    48-token answer repeats tokens and the penalties change what is sampled;
    the bias on </s> makes it likely from the first token on, so min_tokens
    decides where answers may end. Tokens >= 0x80 and the specials other than
    </s> are banned: every token is one ASCII character, so equal texts are
    equal token ids.
    """
    from test_router_shard import make_model

    folder = make_model(tmp_path / "byte-model")
    server = start_launcher(
        "--model-id", str(folder),
        "--max-input-tokens", "48", "--max-total-tokens", "96",
        "--max-batch-total-tokens", str(4 * 96),
        "--max-concurrent-requests", "128",
        tmp=tmp_path,
    )
    eos, min_tokens = 2, 20
    bias = {str(3 + b): -100.0 for b in range(0x80, 0x100)}
    bias.update({"0": -100.0, "1": -100.0})  # <unk>, <s>: specials, invisible in the text
    bias[str(eos)] = 3.0
    rng = random.Random(7)
    prompts = [[1] + [3 + rng.randrange(0x20, 0x7F) for _ in range(20 + i % 28)] for i in range(64)]

    def body(i: int) -> dict:
        return {
            "model": "m", "prompt": prompts[i], "max_tokens": 48, "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 1.0, "seed": 1000 + i, "top_k": 40,
            "frequency_penalty": 0.6, "presence_penalty": 0.4, "repetition_penalty": 1.3,
            "min_tokens": min_tokens, "logit_bias": bias,
        }

    async def one(client: httpx.AsyncClient, i: int) -> tuple[str, str, int]:
        text, finish, generated = "", None, None
        async with client.stream("POST", "/v1/completions", json=dict(body(i), model=model)) as resp:
            async for chunk in sse_chunks(resp):
                for choice in chunk["choices"]:
                    text += choice["text"]
                    finish = choice.get("finish_reason") or finish
                if chunk.get("usage"):
                    generated = chunk["usage"]["completion_tokens"]
        return text, finish, generated

    try:
        model = model_name(server.base_url)

        async def run():
            limits = httpx.Limits(max_connections=80)
            async with httpx.AsyncClient(base_url=server.base_url, timeout=600, limits=limits) as client:
                alone = [await one(client, i) for i in range(64)]
                together = await asyncio.gather(*(one(client, i) for i in range(64)))
                return alone, together

        preemptions_before = metric(server.base_url, "sluice_preemptions_total")
        alone, together = asyncio.run(run())
        preemptions = metric(server.base_url, "sluice_preemptions_total") - preemptions_before
    finally:
        server.stop()
    assert preemptions > 0
    mismatches = [i for i, (a, t) in enumerate(zip(alone, together)) if a != t]
    assert not mismatches, [(i, alone[i], together[i]) for i in mismatches[:3]]
    for text, finish, generated in alone:
        assert all(ord(c) < 0x80 for c in text), text
        assert min_tokens <= generated <= 48
        # </s> is skipped in the text: one character per other token.
        assert len(text) == generated - (finish == "stop")
    # The bias on </s> ends most answers soon after min_tokens, so min_tokens
    # (and not max_tokens) decided many lengths.
    assert sum(finish == "stop" for _, finish, _ in alone) >= 16
    assert any(generated == min_tokens + 1 for _, _, generated in alone)
