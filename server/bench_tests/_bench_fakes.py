"""Test doubles for sluice-bench: small real tokenizers trained here, and a fake
OpenAI-compatible streaming server (aiohttp, in a background thread) whose
timing and failures the tests control."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field

from aiohttp import web
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

CORPUS = """
It was the best of times, it was the worst of times, it was the age of wisdom,
it was the age of foolishness, it was the epoch of belief, it was the epoch of
incredulity, it was the season of Light, it was the season of Darkness, it was
the spring of hope, it was the winter of despair, we had everything before us,
we had nothing before us, we were all going direct to Heaven, we were all going
direct the other way. There were a king with a large jaw and a queen with a
plain face, on the throne of England; there were a king with a large jaw and a
queen with a fair face, on the throne of France. In both countries it was clearer
than crystal to the lords of the State preserves of loaves and fishes, that
things in general were settled for ever. The river ran past the old mill and the
children watched the boats carry wood and food down to the town by the sea.
""".split("\n")


def byte_level_bpe(vocab_size: int = 320) -> Tokenizer:
    """GPT-2/SmolLM-style: byte-level BPE, no BOS. A small vocabulary, so most
    benchmark words take several tokens, which the length search must handle."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def metaspace_bpe_with_bos(vocab_size: int = 200) -> Tokenizer:
    """Llama/sentencepiece-style: metaspace pre-tokenizer and a BOS token the
    post-processor adds to every encoding."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=list("abcdefghijklmnopqrstuvwxyz"), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return tok


@dataclass
class FakeServer:
    """An OpenAI-compatible server that streams `max_tokens` fake tokens.

    ttft: seconds before the first token; gap: seconds between tokens.
    fail_every: every n-th generation request (1-based) answers HTTP 500.
    extra_prompt_tokens: added to usage.prompt_tokens (a tokenizer that
    disagrees with the client's). tokenize: serve TGI's POST /tokenize.
    hold_until_in_flight: no request gets its first token before this many
    are in flight at once (a barrier: tests of how many requests a client
    keeps open wait for an event, not for a lucky overlap in time).
    """

    tokenizer: Tokenizer
    ttft: float = 0.004
    gap: float = 0.001
    fail_every: int = 0
    extra_prompt_tokens: int = 0
    tokenize: bool = True
    tokenize_dialect: str = "tgi"  # or "vllm", "llama.cpp": which /tokenize body it accepts
    model: str = "fake-model"
    port: int = 0
    cached_tokens: int | None = None  # reported in usage.prompt_tokens_details
    truncate_after: int | None = None  # close the stream after this many tokens, without [DONE]
    api_key: str | None = None  # when set, generation and /v1/models need "Bearer <key>"
    hold_until_in_flight: int = 0
    received: list = field(default_factory=list)  # (perf_counter, path, body)
    finished: list = field(default_factory=list)  # (perf_counter, body)
    in_flight: int = 0
    max_in_flight: int = 0

    def __enter__(self) -> "FakeServer":
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()

        def serve():
            asyncio.set_event_loop(self._loop)
            app = web.Application()
            app.router.add_get("/v1/models", self._models)
            app.router.add_get("/ready", self._ready)
            app.router.add_post("/v1/completions", self._generate)
            app.router.add_post("/v1/chat/completions", self._generate)
            if self.tokenize:
                app.router.add_post("/tokenize", self._tokenize)
            self._runner = web.AppRunner(app)
            self._loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, "127.0.0.1", self.port)
            self._loop.run_until_complete(site.start())
            self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=serve, daemon=True)
        self._thread.start()
        assert ready.wait(120), "the fake server did not start"
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _enough_in_flight(self) -> asyncio.Event:
        if not hasattr(self, "_barrier"):
            self._barrier = asyncio.Event()  # created on the server's loop
        return self._barrier

    def generation_requests(self) -> list:
        return [r for r in self.received if r[1] != "/tokenize"]

    def _unauthorized(self, request):
        if self.api_key and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return web.json_response({"error": {"message": "bad api key", "type": "invalid_request_error"}}, status=401)
        return None

    async def _models(self, request):
        if denied := self._unauthorized(request):
            return denied
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def _ready(self, request):
        return web.Response(text="ready")

    async def _tokenize(self, request):
        body = await request.json()
        field_name = {"tgi": "inputs", "vllm": "prompt", "llama.cpp": "content"}[self.tokenize_dialect]
        if not body.get(field_name):  # absent or empty, refused as Sluice and TGI do
            return web.json_response({"error": f"missing field {field_name}"}, status=422)
        enc = self.tokenizer.encode(body[field_name])
        if self.tokenize_dialect == "tgi":
            return web.json_response([{"id": i, "text": t} for i, t in zip(enc.ids, enc.tokens)])
        if self.tokenize_dialect == "vllm":
            return web.json_response({"count": len(enc.ids), "tokens": enc.ids, "max_model_len": 2048})
        return web.json_response({"tokens": enc.ids})

    def _prompt_tokens(self, body: dict) -> int:
        if "prompt" in body:
            return len(self.tokenizer.encode(body["prompt"]).ids) + self.extra_prompt_tokens
        # A toy chat template: 4 tokens of framing per message.
        return sum(len(self.tokenizer.encode(m["content"]).ids) + 4 for m in body["messages"])

    async def _generate(self, request):
        body = await request.json()
        self.received.append((time.perf_counter(), request.path, body))
        if denied := self._unauthorized(request):
            return denied
        n = len(self.generation_requests())
        if self.fail_every and n % self.fail_every == 0:
            return web.json_response({"error": {"message": "injected failure", "type": "server_error"}}, status=500)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        if self.max_in_flight >= self.hold_until_in_flight:
            self._enough_in_flight().set()
        try:
            await asyncio.wait_for(self._enough_in_flight().wait(), timeout=120)
            return await self._stream(request, body)
        finally:
            self.in_flight -= 1
            self.finished.append((time.perf_counter(), body))

    async def _stream(self, request, body):
        chat = request.path.endswith("chat/completions")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(obj) -> None:
            await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

        if chat:  # role-only first chunk, as OpenAI and vLLM send: not a token
            await send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        await asyncio.sleep(self.ttft)
        max_tokens = body["max_tokens"]
        for i in range(max_tokens):
            if i:
                await asyncio.sleep(self.gap)
            piece = f" t{i}"
            choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
            choice["finish_reason"] = "length" if i == max_tokens - 1 else None
            await send({"choices": [choice]})
            if self.truncate_after is not None and i + 1 == self.truncate_after:
                await resp.write_eof()
                return resp
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": self._prompt_tokens(body), "completion_tokens": max_tokens,
                     "total_tokens": self._prompt_tokens(body) + max_tokens}
            if self.cached_tokens is not None:
                usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
            await send({"choices": [], "usage": usage})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
