"""Mixture-of-experts models through the launcher and HTTP: tiny random-weight
Qwen3-MoE, Qwen2-MoE (routed experts and a gated shared expert), Mixtral and
gpt-oss built from transformers' own config classes (with SmolLM2's
tokenizer) serve the greedy tokens transformers generates in float32, alone,
with 16 requests at once, and over 2 shards, tensor-parallel or (Mixtral)
expert-parallel (Qwen2-MoE's shards are server/tests/test_tensor_parallel.py's,
to spare CI time); /info counts their active and total parameters (a shared
expert whole) and says whether the shards hold whole experts. The
Qwen3-MoE runs YaRN over an original context of 64 positions, and a
200-token prompt is served beyond it as transformers computes it.

One launcher per family and shard count, shared by the module's tests."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import httpx
import pytest

from conftest import start_launcher

NEW_TOKENS = 12
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "Mixture of experts layers route each token",
]
# Served length 256: YaRN's 64 x 4 for the Qwen3-MoE, the tiny default elsewhere.
FLAGS = ("--dtype", "float32", "--max-total-tokens", "256", "--max-input-tokens", "224",
         "--max-batch-prefill-tokens", "256", "--kv-cache-bytes", str(16 * 1024 * 1024))
FAMILIES = {
    "qwen3_moe": dict(max_position_embeddings=256, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
    }),
    # Two expert layers (the first windowed), no dense one: the shortest that
    # runs the shared expert beside windowed and global attention.
    "qwen2_moe": dict(max_position_embeddings=256, num_hidden_layers=2, mlp_only_layers=[]),
    "mixtral": dict(max_position_embeddings=256),
    "gpt_oss": dict(max_position_embeddings=256),
}


def smollm2_folder() -> Path:
    from sluice_server.download import bundled_model_path, resolve_model

    return resolve_model(str(bundled_model_path()))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> tuple[str, Path]:
    """(kind, folder): the tiny model with SmolLM2's tokenizer."""
    from sluice_server.testing import make_tiny_model

    kind = request.param
    out = make_tiny_model(tmp_path_factory.mktemp(kind), kind, seed=11, vocab_size=49152, bos_token_id=1,
                          **FAMILIES[kind])
    source = smollm2_folder()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (source / name).exists():
            shutil.copy(source / name, out / name)
    return kind, out


@pytest.fixture(scope="module")
def reference(family):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(family[1], dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def server(family, tmp_path_factory):
    launcher = start_launcher("--model-id", str(family[1]), *FLAGS, tmp=tmp_path_factory.mktemp("one"))
    yield launcher
    launcher.stop()


def transformers_greedy(model, ids: list[int], n: int = NEW_TOKENS) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


async def generate(client: httpx.AsyncClient, prompt: str, n: int = NEW_TOKENS) -> tuple[list[int], list[int], str]:
    """(prompt ids as the router tokenized them, generated ids, finish reason)."""
    ids = [t["id"] for t in (await client.post("/tokenize", json={"inputs": prompt})).json()]
    resp = await client.post("/generate", json={"inputs": prompt, "parameters": {"max_new_tokens": n,
                                                                                 "details": True}})
    assert resp.status_code == 200, resp.text
    details = resp.json()["details"]
    return ids, [t["id"] for t in details["tokens"]], details["finish_reason"]


def check(reference, prompt_ids: list[int], got: list[int], finish: str, n: int = NEW_TOKENS) -> None:
    """Sluice's tokens are transformers' (up to an EOS, where it stops)."""
    want = transformers_greedy(reference, prompt_ids, n)
    assert got == want[: len(got)], (prompt_ids, got, want)
    assert len(got) == n or finish == "eos_token", (got, finish)


def run(base_url: str, prompts: list[str], n: int = NEW_TOKENS) -> list[tuple[list[int], list[int], str]]:
    """All prompts at once."""

    async def go():
        limits = httpx.Limits(max_connections=len(prompts) + 4)
        async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
            return await asyncio.gather(*(generate(client, p, n) for p in prompts))

    return asyncio.run(go())


def test_greedy_alone_matches_transformers(server, reference):
    for prompt in PROMPTS:
        check(reference, *run(server.base_url, [prompt])[0])


def test_sixteen_concurrent_requests_match_transformers(server, reference):
    prompts = [f"{p} ({i})" for i in range(4) for p in PROMPTS]
    assert len(prompts) == 16
    for prompt_ids, got, finish in run(server.base_url, prompts):
        check(reference, prompt_ids, got, finish)


def test_info_counts_active_and_total_parameters(server, family, reference):
    """Active: the routed experts' share of k in E, everything else (a
    shared expert too) whole."""
    info = httpx.get(f"{server.base_url}/info").json()
    total = sum(p.numel() for p in reference.parameters())
    routed = sum(p.numel() for name, p in reference.named_parameters() if ".experts." in name)
    config = reference.config
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    assert info["model_type"] == family[0]
    assert info["total_parameters"] == total
    assert info["active_parameters"] == total - routed + routed * config.num_experts_per_tok // experts
    assert info["expert_parallel"] is False  # one shard holds every expert


def test_long_prompt_beyond_the_original_context(server, family, reference):
    """Qwen3-MoE's YaRN: 200 prompt tokens, past the original 64 positions
    (gpt-oss's tiny YaRN context is 16: its prompts above are past it too)."""
    if family[0] != "qwen3_moe":
        pytest.skip("the YaRN long-context case is the Qwen3-MoE's")
    prompt = " ".join(f"word{i}" for i in range(60))
    prompt_ids, got, finish = run(server.base_url, [prompt])[0]
    assert 150 < len(prompt_ids) <= 224, len(prompt_ids)
    check(reference, prompt_ids, got, finish)


# How each family runs over 2 shards: each expert's width split (tensor
# parallel), or half the experts whole on each shard (--expert-parallel;
# Mixtral's 4 experts here, 2 on each). Qwen2-MoE over 2 and 4 shards is
# server/tests/test_tensor_parallel.py's, to spare CI time.
TWO_SHARDS = {"qwen3_moe": (), "gpt_oss": (), "mixtral": ("--expert-parallel",)}


def test_two_shards_match_transformers(family, reference, tmp_path):
    if family[0] not in TWO_SHARDS:
        pytest.skip("Qwen2-MoE over 2 and 4 shards: server/tests/test_tensor_parallel.py (CI time)")
    flags = TWO_SHARDS[family[0]]
    two = start_launcher("--model-id", str(family[1]), "--num-shard", "2", *flags, *FLAGS, tmp=tmp_path)
    try:
        info = httpx.get(f"{two.base_url}/info").json()
        assert (info["world_size"], info["expert_parallel"]) == (2, bool(flags)), info
        for prompt_ids, got, finish in run(two.base_url, PROMPTS):
            check(reference, prompt_ids, got, finish)
    finally:
        two.stop()
    assert two.proc.returncode == 0, two.output()
