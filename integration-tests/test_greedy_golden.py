"""Greedy generation through HTTP equals transformers' on the same folder,
served by the exact CPU path (`--dtype float32`: C++ kernels, GGUF blocks
expanded exactly), not a fallback. The default fast path is checked in
test_cpu_fast_path.py."""

import json
import re

import httpx
import pytest

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "Les fleurs du printemps sont",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def reference(model_dir):
    import torch
    from sluice_server.testing import transformers_model

    model = transformers_model(model_dir, dtype=torch.float32)
    model.eval()
    return model


def generate_ids(launcher, prompt: str) -> tuple[list[int], list[int]]:
    ids = [t["id"] for t in httpx.post(f"{launcher.base_url}/tokenize", json={"inputs": prompt}).json()]
    resp = httpx.post(
        f"{launcher.base_url}/generate",
        json={"inputs": prompt, "parameters": {"max_new_tokens": NEW_TOKENS, "details": True}},
        timeout=120,
    )
    resp.raise_for_status()
    return ids, [t["id"] for t in resp.json()["details"]["tokens"]]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_matches_transformers(launcher, reference, model_dir, prompt):
    import torch
    from transformers import GenerationConfig

    input_ids, served = generate_ids(launcher, prompt)
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=reference.generation_config.eos_token_id)
    with torch.no_grad():
        out = reference.generate(torch.tensor([input_ids]), generation_config=config, attention_mask=torch.ones(1, len(input_ids), dtype=torch.long))
    expected = out[0, len(input_ids):].tolist()
    assert served == expected


def test_served_by_the_cpu_kernels_and_gguf_blocks(launcher, model_dir):
    """The path that served the tokens above is the exact CPU one: the C++
    kernels loaded and every linear layer (4 per block, plus the output
    head) runs decodes on the GGUF's blocks. A shard that fell back to plain
    torch would serve the same tokens; its startup lines tell them apart."""
    info = httpx.get(f"{launcher.base_url}/info", timeout=30).json()
    if info["model_device_type"] != "cpu":
        pytest.skip(f"the CPU path is checked on CPU; this shard runs on {info['model_device_type']}")
    assert info["model_dtype"] == "float32"
    startup = "\n".join(launcher.head)
    assert "CPU kernels loaded" in startup, startup
    blocks = re.search(r"(\d+) run GGUF blocks", startup)
    layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    assert blocks and int(blocks.group(1)) == 4 * layers + 1, startup
