"""The default CPU path (`--dtype auto` on a GGUF model) end to end.

What a user gets with no flags: decode steps run int8 activations on the
GGUF's blocks through the C++ decoder, and so do prefill and big batches
where the CPU has VNNI and no AMX; elsewhere larger steps run dense weights
(bfloat16 where the CPU multiplies it natively). It is not
bitwise float32 (benchmarks/quality.py measures how far it is); these tests
check that this path is the one that serves, that it answers sensibly, and
what it promises about batches: a sequence's decoded tokens do not depend on
which other sequences share its steps.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import start_launcher

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def fast(tmp_path_factory):
    server = start_launcher(
        "--max-concurrent-requests", "32",
        "--max-total-tokens", "1024",
        "--max-input-tokens", "512",
        "--max-batch-prefill-tokens", "512",
        "--kv-cache-bytes", str(128 * 1024 * 1024),
        tmp=tmp_path_factory.mktemp("fast"),
    )
    yield server
    server.stop()


def generate(server, prompt: str, max_new_tokens: int = NEW_TOKENS) -> list[int]:
    resp = httpx.post(
        f"{server.base_url}/generate",
        json={"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "details": True}},
        timeout=300,
    )
    resp.raise_for_status()
    return [t["id"] for t in resp.json()["details"]["tokens"]]


def test_served_by_int8_blocks_and_the_cpu_decoder(fast, model_dir):
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"the int8 block kernels are written for x86-64; this host is {platform.machine()}")
    info = httpx.get(f"{fast.base_url}/info", timeout=30).json()
    if info["model_device_type"] != "cpu":
        pytest.skip(f"the CPU path is checked on CPU; this shard runs on {info['model_device_type']}")
    import torch

    from sluice_kernels.cpu_matmuls import cpu_flags, plan_cpu_matmuls

    startup = "\n".join(fast.head)
    assert "int8 activations on GGUF blocks" in startup, startup
    layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    blocks = re.search(r"(\d+) run GGUF blocks", startup)
    assert blocks and int(blocks.group(1)) == 4 * layers + 1, startup
    assert re.search(rf"runs? the C\+\+ decoder \({layers} layers\)", startup), startup
    # The plan this host gets (tests/test_model_numerics.py checks the plan
    # for each kind of CPU).
    plan = plan_cpu_matmuls("auto", torch.float32, cpu_flags())
    plan = dataclasses.replace(plan, dense_dtype=plan.dense_dtype or torch.float32)  # the model's, named
    assert f"CPU matmuls: {plan.describe()};" in startup, startup
    # /info shows what the shard decided, as its startup log does.
    assert info["cpu_matmuls"] == plan.describe(), info
    assert info["kv_cache_dtype"] == "bfloat16", info
    assert info["cpu_kernels"] in ("avx512_vnni", "avx_vnni", "avx2"), info
    assert f"KV cache bfloat16, CPU kernels {info['cpu_kernels']}, weights " in startup, startup
    # SmolLM2-135M's weights in memory: its GGUF blocks (about the file's
    # size: 94 MiB) and norms, plus the packed dense weights only where the
    # plan multiplies densely above a row limit (counted apart).
    from sluice_kernels.cpu_matmuls import ALL_ROWS
    from sluice_server.download import bundled_model_path

    file_bytes = bundled_model_path().stat().st_size
    assert 0.9 * file_bytes < info["weight_bytes"] - info["dense_copy_bytes"] < 1.2 * file_bytes, info
    assert (info["dense_copy_bytes"] == 0) == (plan.block_rows >= ALL_ROWS), info


def test_cpu_knobs_reach_the_shard(tmp_path):
    """The launcher's --cpu-kernels, --kv-cache-dtype and --cpu-block-rows
    (their env twins here, as a container would set them) change what the
    shard runs, and /info says so: no C++ kernels, hence no GGUF blocks,
    a float32 cache; the answer stays sensible on plain torch."""
    server = start_launcher(
        "--max-total-tokens", "256", "--max-input-tokens", "128", "--max-batch-prefill-tokens", "128",
        "--kv-cache-bytes", str(32 * 1024 * 1024),
        env={"SLUICE_CPU_KERNELS": "off", "SLUICE_KV_CACHE_DTYPE": "float32", "SLUICE_CPU_BLOCK_ROWS": "4"},
        tmp=tmp_path,
    )
    try:
        info = httpx.get(f"{server.base_url}/info", timeout=30).json()
        if info["model_device_type"] != "cpu":
            pytest.skip(f"CPU knobs; this shard runs on {info['model_device_type']}")
        assert (info["cpu_kernels"], info["kv_cache_dtype"]) == ("none", "float32"), info
        assert info["cpu_matmuls"].startswith("dense "), info
        startup = "\n".join(server.head)
        assert "C++ decoder" not in startup and "0 run GGUF blocks" in startup, startup
        assert_knows_the_capital_of_france(server)
    finally:
        server.stop()


def assert_knows_the_capital_of_france(server) -> None:
    text = httpx.post(
        f"{server.base_url}/generate",
        json={"inputs": "The capital of France is", "parameters": {"max_new_tokens": 8}},
        timeout=300,
    ).json()["generated_text"]
    assert "Paris" in text, text


def test_answers_sensibly(fast):
    assert_knows_the_capital_of_france(fast)


def test_decode_rows_do_not_depend_on_the_other_rows(tmp_path):
    """Steps of few rows (sluice_kernels/cpu_matmuls.py: every step with VNNI and no
    AMX, up to 64 rows with AMX) run the int8 kernels, which quantize each row
    on its own and sum its blocks in a fixed order, and decode attention
    splits keys at fixed positions: a sequence decodes the same tokens alone
    and while seven other requests prefill and decode in its steps. (Where
    larger steps run oneDNN's dense matmuls, their rows can change in the
    last bits with the step's size; the README says so.) A step budget of 16
    tokens keeps every step on the kernels."""
    server = start_launcher(
        "--max-batch-prefill-tokens", "16",
        "--max-total-tokens", "512",
        "--max-input-tokens", "128",
        "--kv-cache-bytes", str(64 * 1024 * 1024),
        tmp=tmp_path,
    )
    try:
        prompt = "Once upon a time, in a land far away,"
        # Long enough that the others start while it decodes: 64 tokens took
        # 0.4 s on a quiet Zen 4 host, less than the others' first tokens.
        ours = 192
        alone = generate(server, prompt, ours)
        others = [
            "def fibonacci(n):",
            "Les fleurs du printemps sont",
            "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
            "A list of prime numbers: 2, 3, 5, 7,",
            "The quick brown fox",
            "In 1969, the first humans",
            "SELECT name FROM users WHERE",
        ]
        order: list[str] = []
        together: list[int] = []
        body = {"inputs": prompt, "parameters": {"max_new_tokens": ours}}
        with ThreadPoolExecutor(len(others)) as pool, httpx.stream(
            "POST", f"{server.base_url}/generate_stream", json=body, timeout=300
        ) as resp:
            resp.raise_for_status()
            futures = []
            for line in resp.iter_lines():
                if not line.startswith("data:"):
                    continue
                together.append(json.loads(line[5:])["token"]["id"])
                if len(together) == 1:
                    # Its prompt is in the cache; the others join its steps now.
                    futures = [pool.submit(first_token_then_rest, server, p, order) for p in others]
            order.append("ours ended")
            rest = [f.result() for f in futures]
        assert together == alone
        assert all(rest)
        # The others really shared its steps: some got their first token before it ended.
        assert order.index("ours ended") > 0, order
    finally:
        server.stop()


def first_token_then_rest(server, prompt: str, order: list[str]) -> list[int]:
    ids = []
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 32}}
    with httpx.stream("POST", f"{server.base_url}/generate_stream", json=body, timeout=300) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data:"):
                ids.append(json.loads(line[5:])["token"]["id"])
                if len(ids) == 1:
                    order.append(prompt)
    return ids
