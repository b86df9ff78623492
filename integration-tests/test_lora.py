"""LoRA adapters end to end (issue 37): adapters made with peft on the fly,
served by a real launcher, against transformers + peft in float32.

- Over a tiny random Llama and over the bundled SmolLM2 (`--dtype float32`:
  its decode steps run on the C++ decoder, which applies the adapters
  itself): greedy tokens through HTTP equal the oracle's for adapter A,
  adapter B and the base model with requests of all three in flight at
  once (32 on the tiny model, and alone there too; 12 on the bundled one,
  two prompts of 8 tokens, to stay short on CPU); the OpenAI API picks the adapter by
  `model`, TGI's by `adapter_id`. Alone, every prompt goes to the base model
  first, then to each adapter: a prefix cache shared between adapters would
  hand an adapter the base model's keys and values, and its tokens would
  differ.
- On the default CPU path (`--dtype auto`) the stacks are bfloat16: /info
  says so, and an adapter's tokens do not depend on what shares its steps.
- Adapters loaded and unloaded while requests run: none fails, each gets
  the tokens it gets alone, and the KV blocks and adapter slots are back at
  their baseline after.
- Bad adapters are refused with a message naming the problem, at load and
  at start, and the server keeps serving.
- Adapters named by Hub id (`NAME=ORG/NAME[@REVISION]`) come from a Hub
  cache offline (HF_HUB_OFFLINE=1, laid out as huggingface_hub writes it)
  and give the tokens of the same adapters served from their folders; an id
  the cache lacks, a repository without an adapter, or a value that is
  neither stops the launcher at start with one line naming the entry.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from pathlib import Path

import httpx
import openai
import pytest
from huggingface_hub import AsyncInferenceClient, InferenceClient

from conftest import SESSION_FLAGS, start_launcher
from test_observability import TRACE_ID, TRACEPARENT, Receiver
from test_prefix_caching import metric

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# name -> (seed, r, lora_alpha, targets, use_rslora): one adapter of q and v
# at rank 4, one of every module at rank 8 with rslora scaling.
ADAPTERS = {
    "ada": (21, 4, 8.0, ("q_proj", "v_proj"), False),
    "bea": (22, 8, 16.0, ALL_MODULES, True),
}
TINY_PROMPTS = [
    "The river stone garden lamp window quiet harbor letter paper morning bread silver market winter",
    "Once upon a time, in a land far away,",
    "def fibonacci(n):",
    "candle forest bridge music orange cloud river stone garden lamp window quiet harbor",
]
# Two prompts and few tokens: every token of this model costs the oracle a
# full forward pass on CPU (three models), and the server the same.
BUNDLED_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
]
BUNDLED_TOKENS = 8
CONCURRENT = 32
# In flight on the bundled model: each (prompt, model) pair twice, so its
# decode steps still mix the base model and both adapters.
BUNDLED_CONCURRENT = 12


def make_adapters(base: Path, root: Path, b_std: float) -> dict[str, Path]:
    from sluice_server.testing import make_lora_adapter

    folders = {}
    for name, (seed, r, alpha, targets, rslora) in ADAPTERS.items():
        folders[name] = make_lora_adapter(base, root / name, seed, r=r, alpha=alpha, target_modules=targets,
                                          use_rslora=rslora, b_std=b_std)
    return folders


def adapter_flags(folders: dict[str, Path]) -> list[str]:
    return ["--lora-adapters", *(f"{name}={path}" for name, path in folders.items())]


# --- the oracle ---------------------------------------------------------------------


def peft_greedy(base: Path, adapter: Path | None, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers (+ peft when `adapter` is given), float32, greedy: each
    prompt's new tokens, up to and including an end-of-sequence token."""
    import peft
    import torch
    import transformers

    from sluice_server.testing import transformers_model

    model = transformers_model(base, dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    model.eval()
    config = transformers.GenerationConfig(max_new_tokens=new_tokens, do_sample=False,
                                           eos_token_id=model.generation_config.eos_token_id)
    out = []
    with torch.no_grad():
        for ids in prompts:
            tokens = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    generation_config=config)
            out.append(tokens[0, len(ids):].tolist())
    return out


# --- requests -----------------------------------------------------------------------


def tokenize(base_url: str, text: str) -> list[int]:
    resp = httpx.post(f"{base_url}/tokenize", json={"inputs": text}, timeout=60)
    assert resp.status_code == 200, resp.text
    return [t["id"] for t in resp.json()]


def tgi_ids(base_url: str, prompt: str, adapter: str | None, new_tokens: int) -> list[int]:
    """Greedy token ids from TGI's API through huggingface_hub's client,
    the adapter picked by `adapter_id`."""
    out = InferenceClient(base_url=base_url, timeout=600).text_generation(
        prompt, max_new_tokens=new_tokens, details=True, adapter_id=adapter)
    return [t.id for t in out.details.tokens]


async def tgi_ids_async(client: AsyncInferenceClient, prompt: str, adapter: str | None, new_tokens: int,
                        started: asyncio.Event | None = None) -> list[int]:
    """The same, streamed; `started` is set at the first token."""
    ids = []
    stream = await client.text_generation(prompt, max_new_tokens=new_tokens, details=True, stream=True,
                                          adapter_id=adapter)
    async for event in stream:
        ids.append(event.token.id)
        if started is not None:
            started.set()
    return ids


def model_ids(base_url: str) -> dict[str, dict]:
    return {card["id"]: card for card in httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"]}


def served_name(base_url: str) -> str:
    return next(iter(model_ids(base_url)))


def kv_and_slots(base_url: str) -> dict[str, float]:
    """The scheduler's books once it is idle: KV blocks and adapter slots."""
    deadline = time.monotonic() + 60
    while metric(base_url, "sluice_batch_current_size") + metric(base_url, "sluice_queue_size") > 0:
        assert time.monotonic() < deadline, "the server did not go idle"
        time.sleep(0.2)
    names = ("kv_blocks_capacity", "kv_blocks_used", "kv_blocks_cached", "kv_blocks_free",
             "lora_slots_capacity", "lora_slots_loaded", "lora_slots_active", "lora_adapters", "lora_adapters_held")
    return {name: metric(base_url, f"sluice_{name}") for name in names}


def check_books(books: dict[str, float], registered: int) -> None:
    assert books["kv_blocks_used"] == 0, books
    assert books["kv_blocks_free"] + books["kv_blocks_cached"] == books["kv_blocks_capacity"], books
    assert books["lora_slots_active"] == 0, books
    assert books["lora_adapters"] == books["lora_adapters_held"] == registered, books
    assert books["lora_slots_loaded"] <= min(books["lora_slots_capacity"], registered), books


# --- the oracle over both models ---------------------------------------------------


def check_against_peft(server, base: Path, folders: dict[str, Path], prompts: list[str], new_tokens: int,
                       solo: bool = True, concurrent: int = CONCURRENT) -> None:
    """Greedy tokens of A, B and the base model through HTTP equal
    transformers + peft's with `concurrent` requests of all three in flight.
    With `solo`, first alone too (each prompt on the base model first), and
    the OpenAI API's `model` gives the same text as TGI's `adapter_id`."""
    url = server.base_url
    choices: list[str | None] = [None, *folders]
    pairs = [(p, m) for p in prompts for m in choices]
    ids = [tokenize(url, p) for p in prompts]
    oracle = {}
    for m in choices:
        oracle.update({(p, m): w for p, w in zip(prompts, peft_greedy(base, folders.get(m), ids, new_tokens))})
    for m in folders:
        assert any(oracle[(p, m)] != oracle[(p, None)] for p in prompts), f"adapter {m} changes nothing"

    if solo:
        wrong = [pair for pair in pairs if tgi_ids(url, *pair, new_tokens) != oracle[pair]]
        assert not wrong, f"alone, {len(wrong)} of {len(pairs)} differ from transformers + peft, e.g. {wrong[0]}"

    mixed = [pairs[i % len(pairs)] for i in range(concurrent)]

    async def together():
        client = AsyncInferenceClient(base_url=url, timeout=600)
        return await asyncio.gather(*(tgi_ids_async(client, p, m, new_tokens) for p, m in mixed))

    got = asyncio.run(together())
    wrong = [(p, m) for (p, m), g in zip(mixed, got) if g != oracle[(p, m)]]
    assert not wrong, f"{len(wrong)} of {concurrent} in flight differ from transformers + peft, e.g. {wrong[0]}"

    if solo:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        tgi = InferenceClient(base_url=url, timeout=600)
        for m in choices:
            text = client.completions.create(model=m or served_name(url), prompt=prompts[0], max_tokens=new_tokens,
                                             temperature=0).choices[0].text
            assert text == tgi.text_generation(prompts[0], max_new_tokens=new_tokens, adapter_id=m), m


# --- a tiny random Llama -----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory, tiny_model_dir) -> Path:
    """The allowed adapter folder: A, B, a third adapter (C, of o and down),
    and bad adapters beside them."""
    from sluice_server.testing import make_lora_adapter, make_tiny_model

    root = tmp_path_factory.mktemp("tiny-adapters")
    make_adapters(tiny_model_dir, root, b_std=0.1)
    make_lora_adapter(tiny_model_dir, root / "cid", 23, r=2, alpha=4.0, target_modules=("o_proj", "down_proj"))
    make_lora_adapter(tiny_model_dir, root / "rank-16", 24, r=16, alpha=16.0)
    make_lora_adapter(tiny_model_dir, root / "lm-head", 25, r=4, target_modules=("q_proj", "lm_head"))
    other = make_tiny_model(tmp_path_factory.mktemp("other-base"), "tied", hidden_size=32, intermediate_size=64)
    make_lora_adapter(other, root / "other-base", 26, r=4)
    (root / "config-only").mkdir()
    shutil.copy(root / "ada" / "adapter_config.json", root / "config-only")
    outside = tmp_path_factory.mktemp("not-allowed")
    shutil.copytree(root / "ada", outside / "ada")
    os.symlink(outside / "ada", root / "link-out")
    return root


@pytest.fixture(scope="module")
def tiny_collector():
    """An OTLP receiver for the module's launcher (the adapter in traces)."""
    import grpc
    from concurrent import futures
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield receiver, f"http://127.0.0.1:{port}"
    server.stop(grace=None)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir, tiny_root, tiny_collector, tmp_path_factory):
    """Two adapter slots for up to four adapters, rank <= 8."""
    server = start_launcher(
        "--model-id", str(tiny_model_dir),
        "--max-input-tokens", "96", "--max-total-tokens", "160", "--max-concurrent-requests", "128",
        *adapter_flags({name: tiny_root / name for name in ADAPTERS}),
        "--lora-root", str(tiny_root), "--max-loras", "2", "--max-lora-rank", "8",
        "--otlp-endpoint", tiny_collector[1],
        tmp=tmp_path_factory.mktemp("tiny-lora"),
    )
    yield server
    server.stop()


def load(server, name: str, path, expect: int = 200) -> str:
    resp = httpx.post(f"{server.base_url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                      timeout=120)
    assert resp.status_code == expect, resp.text
    return resp.text


def unload(server, name: str, expect: int = 200) -> str:
    resp = httpx.post(f"{server.base_url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=120)
    assert resp.status_code == expect, resp.text
    return resp.text


def test_tiny_model_adapters_equal_peft_alone_and_mixed(tiny, tiny_model_dir, tiny_root):
    check_against_peft(tiny, tiny_model_dir, {name: tiny_root / name for name in ADAPTERS}, TINY_PROMPTS, 16)


def test_models_lists_the_adapters_with_the_base_as_parent(tiny, tiny_root):
    cards = model_ids(tiny.base_url)
    base = next(iter(cards))
    assert cards[base]["parent"] is None
    for name in ADAPTERS:
        assert cards[name]["parent"] == base
        assert Path(cards[name]["root"]) == tiny_root / name
    info = httpx.get(f"{tiny.base_url}/info", timeout=30).json()
    assert info["lora"]["max_loras"] == 2 and info["lora"]["max_lora_rank"] == 8 and info["lora"]["lora_bytes"] > 0
    # A float32 model without GGUF blocks: float32 stacks (--lora-dtype auto), as peft computes.
    assert info["lora"]["lora_dtype"] == "float32"
    assert "float32), applied by the cpu grouped matmul" in "\n".join(tiny.head)


def test_the_prefix_cache_is_per_adapter(tiny):
    """The same 40-token prompt: cached only for the model that computed it."""
    client = openai.OpenAI(base_url=f"{tiny.base_url}/v1", api_key="unused", max_retries=0)
    prompt = tokenize(tiny.base_url, " ".join(["harbor lamp"] * 20))[:40]

    def cached(model: str) -> int:
        usage = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0).usage
        return usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0

    base = served_name(tiny.base_url)
    assert [cached(base), cached("ada"), cached("bea"), cached("ada"), cached(base)] == [0, 0, 0, 32, 32]


def test_usage_by_adapter_in_metrics_and_traces(tiny, tiny_collector):
    receiver, _ = tiny_collector
    before = {m: metric(tiny.base_url, "sluice_lora_generated_tokens_total", f'adapter="{m}"') for m in ("bea", "")}
    body = {"model": "bea", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "ignore_eos": True}
    resp = httpx.post(f"{tiny.base_url}/v1/chat/completions", json=body, headers={"traceparent": TRACEPARENT},
                      timeout=120)
    assert resp.status_code == 200, resp.text
    assert resp.json()["model"] == "bea"
    assert metric(tiny.base_url, "sluice_lora_generated_tokens_total", 'adapter="bea"') == before["bea"] + 5
    assert metric(tiny.base_url, "sluice_lora_generated_tokens_total", 'adapter=""') == before[""]
    assert metric(tiny.base_url, "sluice_lora_requests_total", 'adapter="bea"') >= 1
    deadline = time.monotonic() + 60
    while not (spans := [s for s in receiver.trace(TRACE_ID) if s["name"] == "chat bea"]):
        assert time.monotonic() < deadline, [s["name"] for s in receiver.trace(TRACE_ID)]
        time.sleep(0.2)
    attributes = spans[0]["attributes"]
    assert attributes["gen_ai.request.model"] == "bea" and attributes["sluice.lora_adapter"] == "bea"


def test_load_and_unload_under_load(tiny, tiny_root):
    """36 streams of A, B and the base model; while they run, C is loaded
    and asked for (two slots for three adapters, all in use), A is unloaded
    and loaded again under another name, and asked for. No request fails,
    each gets its solo tokens, and the books are back at the baseline."""
    url, n = tiny.base_url, 24
    baseline = kv_and_slots(url)
    check_books(baseline, registered=2)
    load(tiny, "cid", tiny_root / "cid")
    alone = {(p, m): tgi_ids(url, p, m, n) for p in TINY_PROMPTS for m in (None, "ada", "bea", "cid")}
    unload(tiny, "cid")

    async def run():
        client = AsyncInferenceClient(base_url=url, timeout=600)
        http = httpx.AsyncClient(base_url=url, timeout=600)

        async def command(path: str, body: dict):
            resp = await http.post(path, json=body)
            assert resp.status_code == 200, resp.text

        first = [(TINY_PROMPTS[i % 4], (None, "ada", "bea")[i % 3]) for i in range(36)]
        started = [asyncio.Event() for _ in first]
        streams = [asyncio.create_task(tgi_ids_async(client, p, m, n, s)) for (p, m), s in zip(first, started)]
        await asyncio.gather(*(s.wait() for s in started))
        await command("/v1/load_lora_adapter", {"lora_name": "cid", "lora_path": str(tiny_root / "cid")})
        later = [(p, "cid") for p in TINY_PROMPTS]
        streams += [asyncio.create_task(tgi_ids_async(client, p, m, n)) for p, m in later]
        await command("/v1/unload_lora_adapter", {"lora_name": "ada"})
        await command("/v1/load_lora_adapter", {"lora_name": "ada-again", "lora_path": str(tiny_root / "ada")})
        again = [(p, "ada-again") for p in TINY_PROMPTS]
        streams += [asyncio.create_task(tgi_ids_async(client, p, m, n)) for p, m in again]
        results = await asyncio.gather(*streams, return_exceptions=True)
        await http.aclose()
        return first + later + again, results

    asked, results = asyncio.run(run())
    failed = [(pair, r) for pair, r in zip(asked, results) if isinstance(r, BaseException)]
    assert not failed, f"{len(failed)} requests failed, e.g. {failed[0]}"
    same_as = {"ada-again": "ada"}
    wrong = [(p, m) for (p, m), r in zip(asked, results) if r != alone[(p, same_as.get(m, m))]]
    assert not wrong, f"{len(wrong)} of {len(asked)} differ from their solo run, e.g. {wrong[0]}"

    unload(tiny, "cid")
    unload(tiny, "ada-again")
    load(tiny, "ada", tiny_root / "ada")
    check_books(kv_and_slots(url), registered=2)
    assert [tgi_ids(url, TINY_PROMPTS[0], m, n) for m in ("ada", "bea")] == [
        alone[(TINY_PROMPTS[0], m)] for m in ("ada", "bea")]


BAD_LOADS = [
    # (adapter folder under the root, or an absolute path, words of the message)
    ("rank-16", ["r=16", "--max-lora-rank 8"]),
    ("other-base", ["another base model"]),
    ("config-only", ["no adapter_model.safetensors"]),
    ("lm-head", ["lm_head", "only the decoder layers"]),
    ("missing", ["does not exist"]),
    ("link-out", ["outside the allowed adapter folders"]),
    ("../not-allowed0/ada", ["outside the allowed adapter folders"]),
]


@pytest.mark.parametrize("folder,words", BAD_LOADS, ids=[f for f, _ in BAD_LOADS])
def test_bad_adapters_are_refused_at_load(tiny, tiny_root, folder, words):
    text = load(tiny, "bad", f"{tiny_root}/{folder}", expect=400)
    for word in words:
        assert word in text, text
    assert "bad" not in model_ids(tiny.base_url)
    assert tgi_ids(tiny.base_url, TINY_PROMPTS[1], "bea", 4)


def test_bad_names_are_refused(tiny, tiny_root):
    assert "already loaded" in load(tiny, "bea", tiny_root / "bea", expect=400)
    assert "names the base model" in load(tiny, served_name(tiny.base_url), tiny_root / "bea", expect=400)
    assert "no LoRA adapter `nope`" in unload(tiny, "nope", expect=404)
    body = {"model": "nope", "prompt": "hi", "max_tokens": 2}
    resp = httpx.post(f"{tiny.base_url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 404 and resp.json()["error"]["param"] == "model", resp.text
    assert "ada" in resp.json()["error"]["message"] and "bea" in resp.json()["error"]["message"]
    resp = httpx.post(f"{tiny.base_url}/generate", json={"inputs": "hi", "parameters": {"adapter_id": "nope"}},
                      timeout=60)
    assert resp.status_code == 404 and "bea" in resp.text, resp.text


def test_a_bad_adapter_at_start_stops_the_launcher_with_the_reason(tiny_model_dir, tiny_root, tmp_path):
    server = start_launcher("--model-id", str(tiny_model_dir), "--lora-adapters", f"big={tiny_root / 'rank-16'}",
                            "--max-lora-rank", "8", tmp=tmp_path, wait_ready=False)
    try:
        assert server.proc.wait(timeout=600) != 0
        server.output_ended.wait(30)
    finally:
        server.stop()
    assert "r=16" in server.output() and "--max-lora-rank 8" in server.output(), server.output()


# --- the bundled model --------------------------------------------------------------


@pytest.fixture(scope="module")
def bundled(model_dir, tmp_path_factory):
    """SmolLM2 in float32 (as the session launcher) with A and B."""
    # B's deviation as the tiny model's: with few tokens per prompt, the
    # adapters must change the greedy tokens early.
    folders = make_adapters(model_dir, tmp_path_factory.mktemp("bundled-adapters"), b_std=0.1)
    server = start_launcher(*SESSION_FLAGS, *adapter_flags(folders), "--max-lora-rank", "8",
                            tmp=tmp_path_factory.mktemp("bundled-lora"))
    yield server, folders
    server.stop()


def test_bundled_model_adapters_equal_peft_alone_and_mixed(bundled, model_dir):
    server, folders = bundled
    info = httpx.get(f"{server.base_url}/info", timeout=30).json()
    assert info["model_dtype"] == "float32" and info["lora"]["lora_dtype"] == "float32"
    # Only in flight: one request at a time on this model costs minutes on
    # CPU, and the tiny model's test covers requests alone and the OpenAI API.
    check_against_peft(server, model_dir, folders, BUNDLED_PROMPTS, BUNDLED_TOKENS, solo=False,
                       concurrent=BUNDLED_CONCURRENT)
    config = json.loads((folders["bea"] / "adapter_config.json").read_text())
    assert config["use_rslora"] and config["r"] == 8


def test_fast_path_serves_adapters_from_bfloat16_stacks(model_dir, tmp_path):
    """The default path (`--dtype auto` on the bundled GGUF: int8 activations
    on its blocks) keeps the adapters' stacks in bfloat16 (--lora-dtype
    auto): /info and the startup log say so, adapter B changes the greedy
    tokens, and B's tokens are the same alone and while base and adapter-A
    requests share its steps (each row gets its own adapter's update,
    whatever else the step holds). A step budget of 16 tokens keeps the
    steps on the block kernels, as in test_cpu_fast_path.py; the error
    against float32 stacks is server/tests/test_cpu_decoder.py's."""
    folders = make_adapters(model_dir, tmp_path / "adapters", b_std=0.1)
    server = start_launcher(
        "--max-batch-prefill-tokens", "16", "--max-total-tokens", "256", "--max-input-tokens", "128",
        "--kv-cache-bytes", str(64 * 2**20), *adapter_flags(folders), "--max-lora-rank", "8",
        tmp=tmp_path / "server",
    )
    try:
        url = server.base_url
        info = httpx.get(f"{url}/info", timeout=30).json()
        assert info["cpu_matmuls"].startswith("int8 activations on GGUF blocks"), info["cpu_matmuls"]
        assert info["lora"]["lora_dtype"] == "bfloat16"
        assert "bfloat16), applied by the cpu grouped matmul" in "\n".join(server.head)
        prompt, other = BUNDLED_PROMPTS
        # Long enough that the others start while it decodes (test_cpu_fast_path.py).
        ours = 192
        alone = tgi_ids(url, prompt, "bea", ours)
        assert alone != tgi_ids(url, prompt, None, ours), "adapter B changes nothing"

        async def shared():
            client = AsyncInferenceClient(base_url=url, timeout=600)
            started = asyncio.Event()
            task = asyncio.create_task(tgi_ids_async(client, prompt, "bea", ours, started))
            await started.wait()  # its prompt is prefilled; the others join its decode steps now
            firsts = [asyncio.Event() for _ in range(3)]
            others = [asyncio.create_task(tgi_ids_async(client, p, m, 16, e))
                      for (p, m), e in zip([(other, None), (other, "ada"), (prompt, None)], firsts)]
            got = await task
            joined = sum(e.is_set() for e in firsts)
            return got, await asyncio.gather(*others), joined

        together, rest, joined = asyncio.run(shared())
        assert together == alone
        assert all(rest)
        assert joined > 0, "no other request got a token while B's decoded"
    finally:
        server.stop()


# --- adapters from the Hub cache ----------------------------------------------------

HUB_MAIN = "0123456789abcdef0123456789abcdef01234567"
HUB_V2 = "fedcba9876543210fedcba9876543210fedcba98"


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, tiny_root, tiny_model_dir) -> Path:
    """acme/tiny-lora holds A at main and B at tag v2; acme/tiny-model is a
    model, not an adapter."""
    from sluice_server.testing import add_to_hub_cache

    cache = tmp_path_factory.mktemp("hub-cache")
    add_to_hub_cache(tiny_root / "ada", cache, "acme/tiny-lora", HUB_MAIN)
    add_to_hub_cache(tiny_root / "bea", cache, "acme/tiny-lora", HUB_V2, refs=("v2",))
    add_to_hub_cache(tiny_model_dir, cache, "acme/tiny-model", HUB_MAIN)
    return cache


def offline(cache: Path) -> dict[str, str]:
    return {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}


def test_hub_adapters_equal_the_same_adapters_from_their_folders(tiny_model_dir, tiny_root, hub_cache, tmp_path):
    server = start_launcher(
        "--model-id", str(tiny_model_dir), "--max-input-tokens", "96", "--max-total-tokens", "160",
        "--lora-adapters", "sql=acme/tiny-lora", "sql2=acme/tiny-lora@v2",
        f"ada={tiny_root / 'ada'}", f"bea={tiny_root / 'bea'}", "--max-lora-rank", "8",
        env=offline(hub_cache), tmp=tmp_path,
    )
    try:
        url = server.base_url
        snapshots = hub_cache / "models--acme--tiny-lora" / "snapshots"
        cards = model_ids(url)
        assert (Path(cards["sql"]["root"]), Path(cards["sql2"]["root"])) == (snapshots / HUB_MAIN, snapshots / HUB_V2)
        assert "[download-adapter]" in server.output()
        prompts = TINY_PROMPTS[:2]
        got = {(p, m): tgi_ids(url, p, m, 16) for p in prompts for m in ("sql", "sql2", "ada", "bea")}
        for p in prompts:
            assert got[(p, "sql")] == got[(p, "ada")] and got[(p, "sql2")] == got[(p, "bea")], p
        assert any(got[(p, "sql")] != got[(p, "sql2")] for p in prompts), "the revisions are the same adapter"
        oracle = peft_greedy(tiny_model_dir, tiny_root / "ada", [tokenize(url, prompts[0])], 16)[0]
        assert got[(prompts[0], "sql")] == oracle
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        texts = [client.completions.create(model=m, prompt=prompts[1], max_tokens=16, temperature=0).choices[0].text
                 for m in ("sql", "ada")]
        assert texts[0] == texts[1]
    finally:
        server.stop()


BAD_HUB_STARTS = [
    # (--lora-adapters value, words of the launcher's last line)
    ("acme/not-cached", ["LoRA adapter `bad=acme/not-cached`", "not in the Hub cache", "HF_HUB_OFFLINE=1"]),
    ("acme/tiny-lora@v9", ["LoRA adapter `bad=acme/tiny-lora@v9`", "acme/tiny-lora@v9 is not in the Hub cache"]),
    ("acme/tiny-model", ["LoRA adapter `bad=acme/tiny-model`", "has no adapter_config.json"]),
    ("/no/such/adapter", ["--lora-adapters bad=/no/such/adapter: no such folder"]),
    ("acme/a/b", ["--lora-adapters bad=acme/a/b: neither an existing folder nor a Hugging Face Hub id"]),
]


@pytest.mark.parametrize("value,words", BAD_HUB_STARTS, ids=[v for v, _ in BAD_HUB_STARTS])
def test_an_adapter_that_cannot_be_found_stops_the_start_naming_it(tiny_model_dir, tiny_root, hub_cache, tmp_path,
                                                                   value, words):
    server = start_launcher("--model-id", str(tiny_model_dir), "--lora-adapters", f"ada={tiny_root / 'ada'}",
                            f"bad={value}", env=offline(hub_cache), tmp=tmp_path, wait_ready=False)
    try:
        # Before any shard starts: adapters are resolved first.
        assert server.proc.wait(timeout=120) != 0
        server.output_ended.wait(30)
    finally:
        server.stop()
    last = server.output().splitlines()[-1]
    for word in words:
        assert word in last, server.output()
    assert "Traceback" not in server.output() and "Started 1 shard" not in server.output(), server.output()
