"""Sending a plan to a server and timing every streamed token.

The load shape decides when a session may start:
- fixed concurrency N: N sessions in flight, the next starts when one ends;
- Poisson arrivals at R sessions/s (exponential gaps drawn from the seed, so two
  runs with one seed send at the same offsets), optionally capped at
  `max_concurrency` in flight.
A session holds its slot for all its turns: a multi-turn conversation sends turn
k+1, with the answer to turn k in its history, only after turn k finished.

Nothing a server does can crash a run: HTTP errors, broken streams, timeouts and
malformed events become failed records with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from dataclasses import dataclass, field, replace

import httpx

from .metrics import RequestRecord, summarize, timings_from_chunks
from .workloads import LocalTokenizer, Plan, RemoteTokenizer, Session, TokenCounter, Turn, WorkloadSpec, build_plan

ENDPOINTS = ("completions", "chat")


@dataclass
class BenchConfig:
    """Everything one benchmark run against one server needs."""

    base_url: str
    spec: WorkloadSpec = field(default_factory=WorkloadSpec)
    concurrency: int | None = 1
    request_rate: float | None = None
    max_concurrency: int | None = None
    endpoint: str = "completions"
    model: str | None = None
    api_key: str | None = None
    tokenizer: str | None = None
    timeout: float = 600.0
    seed: int = 0
    warmup: int = 0
    ignore_eos: bool = True
    temperature: float = 0.0
    goodput_ms: dict[str, float] = field(default_factory=dict)
    hourly_cost: float | None = None
    progress: bool = True
    label: str | None = None

    def validate(self) -> None:
        self.spec.validate()
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        if self.request_rate is None and (self.concurrency is None or self.concurrency < 1):
            raise ValueError("give a concurrency of at least 1 or a request rate")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError(f"request rate must be positive, got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max-concurrency must be at least 1")
        if self.warmup < 0 or self.timeout <= 0:
            raise ValueError("warmup must be >= 0 and timeout > 0")
        if self.hourly_cost is not None and self.hourly_cost < 0:
            raise ValueError("hourly cost must be >= 0")

    @property
    def chat(self) -> bool:
        # Multi-turn conversations only make sense as chat.
        return self.endpoint == "chat" or self.spec.kind == "multi-turn"

    def load(self) -> dict:
        if self.request_rate is not None:
            return {"request_rate": self.request_rate, "max_concurrency": self.max_concurrency}
        return {"concurrency": self.concurrency}


@dataclass
class RunResult:
    label: str
    base_url: str
    model: str
    load: dict
    workload: str
    summary: dict
    records: list[RequestRecord]
    warmup: dict
    server_info: dict = field(default_factory=dict)

    def to_json(self, with_requests: bool = False) -> dict:
        d = {
            "label": self.label,
            "base_url": self.base_url,
            "model": self.model,
            "load": self.load,
            "workload": self.workload,
            "warmup": self.warmup,
            "server_info": self.server_info,
            "summary": self.summary,
        }
        if with_requests:
            d["requests"] = [r.to_json() for r in self.records]
        return d


# ---------------------------------------------------------------------------
# Server discovery


def root_url(base_url: str) -> str:
    """'http://h:8080/v1/' -> 'http://h:8080': OpenAI paths are appended to the
    root, and /tokenize, /info live there too."""
    url = base_url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"base URL must start with http:// or https://, got {base_url!r}")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def auth_headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def discover_model(client: httpx.AsyncClient, root: str, headers: dict) -> str:
    try:
        resp = await client.get(root + "/v1/models", headers=headers)
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except Exception as e:
        raise ValueError(f"cannot learn the model name from {root}/v1/models ({e}); pass --model") from None


async def server_info(client: httpx.AsyncClient, root: str, headers: dict) -> dict:
    """What the server says about itself: TGI/Sluice /info, vLLM /version,
    llama.cpp /props. Best effort; a benchmark does not depend on it."""
    info = {}
    for path in ("/info", "/version", "/props"):
        try:
            resp = await client.get(root + path, headers=headers, timeout=5.0)
            if resp.status_code == 200:
                data = resp.json()
                if path == "/props" and isinstance(data, dict):
                    data = {k: data[k] for k in ("build_info", "total_slots", "model_path") if k in data}
                info[path.lstrip("/")] = data
        except Exception:
            pass
    return info


async def make_counter(cfg: BenchConfig, client: httpx.AsyncClient, model: str | None) -> TokenCounter:
    if cfg.tokenizer:
        return LocalTokenizer.load(cfg.tokenizer)
    counter = RemoteTokenizer(client, root_url(cfg.base_url), model, auth_headers(cfg.api_key))
    try:
        await counter.count("hello")
    except Exception as e:
        raise ValueError(
            f"the server has no usable POST /tokenize ({e}); pass --tokenizer PATH "
            "(a tokenizer.json or a model folder) so prompts can have exact lengths"
        ) from None
    return counter


# ---------------------------------------------------------------------------
# Plans and arrivals


def warmup_spec(spec: WorkloadSpec, k: int) -> WorkloadSpec:
    """A workload of k requests shaped like `spec`."""
    if spec.kind == "random":
        return replace(spec, num_prompts=k)
    if spec.kind == "shared-prefix":
        return replace(spec, num_groups=1, prompts_per_group=k)
    return replace(spec, num_conversations=k, num_turns=1)


# Warm-up prompts come from a different seed, so they warm the engine up but
# put none of the measured prompts (or shared system prompts) in a prefix cache.
WARMUP_SEED_OFFSET = 1_000_003


async def prepare(cfg: BenchConfig, client: httpx.AsyncClient, model: str | None) -> tuple[Plan, Plan | None]:
    counter = await make_counter(cfg, client, model)
    plan = await build_plan(cfg.spec, counter, cfg.seed, cfg.chat)
    warm = None
    if cfg.warmup:
        warm = await build_plan(warmup_spec(cfg.spec, cfg.warmup), counter, cfg.seed + WARMUP_SEED_OFFSET, cfg.chat)
    return plan, warm


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Send offsets (seconds) of n sessions arriving as a Poisson process of
    `rate` per second: the first at 0, then exponential gaps of mean 1/rate."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        out.append(t)
    return out


# ---------------------------------------------------------------------------
# Sending


def request_body(cfg: BenchConfig, model: str, turn: Turn, history: list[dict]) -> tuple[str, dict]:
    """(path, JSON body) of one streamed request."""
    body = {
        "model": model,
        "max_tokens": turn.max_tokens,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.ignore_eos:
        # vLLM, Sluice (and TGI's OpenAI layer) honour these; servers that do not
        # know them ignore them, and usage tells how many tokens really came.
        body["ignore_eos"] = True
        body["min_tokens"] = turn.max_tokens
    if cfg.chat:
        messages = [{"role": "system", "content": turn.system}] if turn.system else []
        messages += history + [{"role": "user", "content": turn.user}]
        body["messages"] = messages
        return "/v1/chat/completions", body
    body["prompt"] = turn.prompt
    return "/v1/completions", body


def token_text(event: dict) -> str | None:
    """The generated text an SSE event carries, or None when it carries none
    (a role-only first chat chunk, the final usage chunk, an empty finish chunk)."""
    choices = event.get("choices") or []
    if not choices:
        return None
    c = choices[0]
    if "text" in c:
        text = c.get("text")
    else:
        delta = c.get("delta") or {}
        text = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
    return text or None


async def send_one(client: httpx.AsyncClient, url: str, body: dict, headers: dict, rec: RequestRecord, t0: float,
                   timeout: float) -> None:
    """Streams one request, filling `rec`. `timeout` bounds the whole request,
    not one read. Never raises (except cancellation)."""
    send = time.perf_counter()
    rec.start = send - t0
    chunk_times: list[float] = []
    pieces: list[str] = []
    try:
        await asyncio.wait_for(_stream(client, url, body, headers, rec, chunk_times, pieces), timeout)
    except (asyncio.TimeoutError, httpx.TimeoutException):
        rec.error = f"timeout after {timeout:g}s"
    except Exception as e:  # connection refused, reset, malformed JSON, ...
        rec.error = f"{type(e).__name__}: {e}"
    if rec.error:
        return
    if not chunk_times:
        rec.error = "stream ended without any generated token"
        return
    rec.ttft, rec.itl, rec.e2el = timings_from_chunks(send, chunk_times)
    if not rec.output_tokens_from_usage:
        rec.output_tokens = len(chunk_times)
    rec.text = "".join(pieces)
    rec.ok = True


async def _stream(client, url, body, headers, rec: RequestRecord, chunk_times: list[float], pieces: list[str]) -> None:
    """Reads the SSE stream, appending each token-carrying chunk's arrival time
    and text; sets rec.error for an HTTP error or an error event."""
    async with client.stream("POST", url, json=body, headers=headers) as resp:
        rec.status = resp.status_code
        if resp.status_code != 200:
            raw = (await resp.aread()).decode(errors="replace")
            rec.error = f"HTTP {resp.status_code}: {error_message(raw)}"
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            now = time.perf_counter()
            data = line[5:].strip()
            if data == "[DONE]":
                return
            event = json.loads(data)
            if not isinstance(event, dict):
                raise ValueError(f"stream event is not an object: {data[:80]}")
            if event.get("error"):
                rec.error = f"error in stream: {error_message(data)}"
                return
            piece = token_text(event)
            if piece is not None:
                chunk_times.append(now)
                pieces.append(piece)
            if event.get("usage"):
                read_usage(event["usage"], rec)
    # Every OpenAI-compatible server ends a complete stream with [DONE].
    rec.error = "stream ended before [DONE]"


def read_usage(usage: dict, rec: RequestRecord) -> None:
    if isinstance(usage.get("completion_tokens"), int):
        rec.output_tokens = usage["completion_tokens"]
        rec.output_tokens_from_usage = True
    if isinstance(usage.get("prompt_tokens"), int):
        rec.prompt_tokens = usage["prompt_tokens"]
    details = usage.get("prompt_tokens_details") or {}
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        rec.cached_tokens = details["cached_tokens"]


def error_message(raw: str) -> str:
    """The message of an OpenAI (or TGI) error body, else the raw text."""
    try:
        data = json.loads(raw)
        err = data.get("error", data) if isinstance(data, dict) else data
        if isinstance(err, dict):
            return str(err.get("message") or err)[:300]
        return str(err)[:300]
    except Exception:
        return raw.strip()[:300]


@dataclass
class _Driver:
    """Runs a list of sessions under one load shape, collecting records."""

    cfg: BenchConfig
    client: httpx.AsyncClient
    model: str
    progress: object = None

    async def drive(self, sessions: list[Session], arrivals: list[float] | None, limit: int | None) -> tuple[list[RequestRecord], float]:
        root = root_url(self.cfg.base_url)
        headers = auth_headers(self.cfg.api_key)
        sem = asyncio.Semaphore(limit) if limit else None
        first_index = []
        n = 0
        for s in sessions:
            first_index.append(n)
            n += len(s.turns)
        records: list[RequestRecord | None] = [None] * n
        t0 = time.perf_counter()

        async def run_session(i: int, session: Session) -> None:
            if arrivals is not None:
                await asyncio.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
            async with sem if sem else contextlib.nullcontext():
                history: list[dict] = []
                broken = False
                for k, turn in enumerate(session.turns):
                    idx = first_index[i] + k
                    rec = RequestRecord(index=idx, session=session.index, turn=k,
                                        expected_prompt_tokens=turn.expected_prompt_tokens)
                    if broken:
                        rec.start = time.perf_counter() - t0
                        rec.error = "skipped: an earlier turn of this conversation failed"
                    else:
                        path, body = request_body(self.cfg, self.model, turn, history)
                        await send_one(self.client, root + path, body, headers, rec, t0, self.cfg.timeout)
                        broken = not rec.ok
                        history += [{"role": "user", "content": turn.user}, {"role": "assistant", "content": rec.text}]
                    records[idx] = rec
                    if self.progress is not None:
                        self.progress.update(1)

        await asyncio.gather(*(run_session(i, s) for i, s in enumerate(sessions)))
        return records, time.perf_counter() - t0


async def run_plan(cfg: BenchConfig, client: httpx.AsyncClient, model: str, plan: Plan, warm: Plan | None = None) -> RunResult:
    """Runs the warm-up plan (not measured), then the plan, under cfg's load."""
    cfg.validate()
    limit = cfg.max_concurrency if cfg.request_rate is not None else cfg.concurrency
    warm_info = {"requests": 0, "failed": 0}
    if warm is not None and warm.sessions:
        w_records, _ = await _Driver(cfg, client, model).drive(warm.sessions, None, limit or len(warm.sessions))
        warm_info = {"requests": len(w_records), "failed": sum(not r.ok for r in w_records)}
    arrivals = poisson_arrivals(len(plan.sessions), cfg.request_rate, cfg.seed) if cfg.request_rate else None
    progress = _progress_bar(cfg, plan)
    try:
        records, duration = await _Driver(cfg, client, model, progress).drive(plan.sessions, arrivals, limit)
    finally:
        if progress is not None:
            progress.close()
    return RunResult(
        label=cfg.label or cfg.base_url,
        base_url=cfg.base_url,
        model=model,
        load=cfg.load(),
        workload=cfg.spec.describe(),
        summary=summarize(records, duration, cfg.goodput_ms, cfg.hourly_cost),
        records=records,
        warmup=warm_info,
    )


def _progress_bar(cfg: BenchConfig, plan: Plan):
    if not cfg.progress:
        return None
    from tqdm import tqdm

    load = f"c={cfg.concurrency}" if cfg.request_rate is None else f"rate={cfg.request_rate}/s"
    # disable=None: a bar on a terminal, nothing in a log file
    return tqdm(total=plan.num_requests(), desc=f"{cfg.label or cfg.base_url} {load}", unit="req", leave=False,
                disable=None)


def make_client(cfg: BenchConfig) -> httpx.AsyncClient:
    # No pool limit: the load shape, not the HTTP pool, decides what is in flight.
    return httpx.AsyncClient(
        timeout=httpx.Timeout(cfg.timeout, connect=min(cfg.timeout, 30.0)),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
    )


async def run_benchmark(cfg: BenchConfig, plan: Plan | None = None, warm: Plan | None = None) -> RunResult:
    """The Python API: one benchmark against one server. Builds the plan from
    cfg (tokenizer: cfg.tokenizer or the server's /tokenize) unless given."""
    cfg.validate()
    async with make_client(cfg) as client:
        root = root_url(cfg.base_url)
        headers = auth_headers(cfg.api_key)
        model = cfg.model or await discover_model(client, root, headers)
        if plan is None:
            plan, warm = await prepare(cfg, client, model)
        result = await run_plan(cfg, client, model, plan, warm)
        result.server_info = await server_info(client, root, headers)
        return result


def run_benchmark_sync(cfg: BenchConfig, plan: Plan | None = None, warm: Plan | None = None) -> RunResult:
    return asyncio.run(run_benchmark(cfg, plan, warm))
