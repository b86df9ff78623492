"""--max-weight-memory through the launcher, on the bundled model in float32
(the session launcher's flags): its plan keeps packed float32 copies of the
GGUF-block matrices for steps above 16 rows.

- a limit between the blocks and blocks + copies: the shard drops the copies
  (its log says how many MiB), /info shows the limit, dense_copy_bytes 0 and
  every step on the blocks, and greedy tokens are the session launcher's;
- a limit below the blocks: the launcher exits non-zero with the shard's
  message, which names the weights' bytes and the limit.
"""

from __future__ import annotations

import httpx
import pytest

from conftest import SESSION_FLAGS, start_launcher
from test_cpu_fast_path import generate

# A prompt of more than 16 tokens: its prefill is a step the unlimited plan
# runs on the dense copies.
PROMPT = "Here is a short list of the largest cities of Europe, with their populations and countries: 1."


@pytest.fixture(scope="module")
def full_info(launcher) -> dict:
    info = httpx.get(f"{launcher.base_url}/info", timeout=30).json()
    if info["model_device_type"] != "cpu" or info["dense_copy_bytes"] == 0:
        pytest.skip(f"dense copies beside GGUF blocks are a CPU plan's (with the C++ kernels): {info}")
    return info


def test_a_limit_between_drops_the_dense_copies(launcher, full_info, tmp_path):
    assert full_info["max_weight_memory"] is None
    blocks = full_info["weight_bytes"] - full_info["dense_copy_bytes"]
    limit = blocks + full_info["dense_copy_bytes"] // 2
    server = start_launcher(*SESSION_FLAGS, "--max-weight-memory", str(limit), tmp=tmp_path)
    try:
        info = httpx.get(f"{server.base_url}/info", timeout=30).json()
        assert info["max_weight_memory"] == limit, info
        assert (info["dense_copy_bytes"], info["weight_bytes"]) == (0, blocks), info
        assert info["cpu_matmuls"] == "GGUF blocks expanded to float32 for every step", info
        startup = "\n".join(server.head)
        assert "dropped the plan's dense copies" in startup and "MiB saved" in startup, startup
        assert generate(server, PROMPT) == generate(launcher, PROMPT)
    finally:
        server.stop()


def test_a_limit_below_the_blocks_stops_the_launcher_with_both_sizes(full_info, tmp_path):
    blocks = full_info["weight_bytes"] - full_info["dense_copy_bytes"]
    limit = blocks // 2
    server = start_launcher(*SESSION_FLAGS, "--max-weight-memory", str(limit), wait_ready=False, tmp=tmp_path)
    try:
        assert server.proc.wait(timeout=600) != 0
        server.output_ended.wait(30)
    finally:
        server.stop()
    output = server.output()
    assert f"take {blocks} bytes" in output and f"more than --max-weight-memory {limit} bytes" in output, output
