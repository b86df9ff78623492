"""Tensor parallelism through the launcher: `--num-shard N` serves the same
greedy texts as one shard, each shard holds a slice of the weights, one
killed shard stops everything, and a model that cannot be split fails at
startup with the numbers in the message.

SmolLM2-135M has 9 query heads, so it splits over 3 shards (not 2); the
2-shard runs use the tiny random-weight Llama (4 query / 2 key-value heads).
"""

from __future__ import annotations

import os
import signal

import httpx

from conftest import start_launcher, wait_gone
from test_greedy_golden import NEW_TOKENS, PROMPTS
from test_lifecycle import shard_pids, wait_exit


def greedy(base_url: str, prompt: str) -> tuple[str, list[int]]:
    resp = httpx.post(
        f"{base_url}/generate",
        json={"inputs": prompt, "parameters": {"max_new_tokens": NEW_TOKENS, "details": True}},
        timeout=300,
    )
    resp.raise_for_status()
    body = resp.json()
    return body["generated_text"], [t["id"] for t in body["details"]["tokens"]]


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def test_two_shards_serve_the_greedy_prompts_like_one(tiny_model_dir, tmp_path):
    texts = {}
    for n in (1, 2):
        (tmp_path / str(n)).mkdir()
        server = start_launcher("--model-id", str(tiny_model_dir), "--num-shard", str(n), tmp=tmp_path / str(n))
        try:
            assert len(shard_pids(server)) == n, server.output()
            texts[n] = [greedy(server.base_url, p) for p in PROMPTS]
        finally:
            server.stop()
        assert server.proc.returncode == 0, server.output()
    assert texts[2] == texts[1]
    assert all(len(ids) == NEW_TOKENS for _, ids in texts[1])


def test_three_shards_serve_bundled_model_like_one(launcher, tmp_path):
    """The shared 1-shard launcher against the same model on 3 shards."""
    server = start_launcher(
        # The exact path, as the shared launcher runs it: tokens compared one for one.
        "--dtype", "float32",
        "--num-shard", "3", "--max-total-tokens", "2048", "--max-input-tokens", "1536",
        "--kv-cache-bytes", str(64 * 1024 * 1024), tmp=tmp_path,
    )
    try:
        pids = shard_pids(server)
        assert len(pids) == 3, server.output()
        for prompt in PROMPTS:
            assert greedy(server.base_url, prompt) == greedy(launcher.base_url, prompt), prompt
        one = [rss_mib(p) for p in shard_pids(launcher)]
        three = [rss_mib(p) for p in pids]
        print(f"\nSmolLM2 shard RSS (MiB, includes the KV cache and the Python/torch runtime): "
              f"1 shard {one}, 3 shards {three}")
    finally:
        server.stop()
    assert server.proc.returncode == 0, server.output()


def test_killed_shard_of_two_stops_launcher(tiny_model_dir, tmp_path):
    server = start_launcher("--model-id", str(tiny_model_dir), "--num-shard", "2", tmp=tmp_path)
    try:
        shards = shard_pids(server)
        assert len(shards) == 2, server.output()
        children = server.children()
        os.kill(shards[1], signal.SIGKILL)
        assert wait_exit(server, 120) != 0
        alive = wait_gone(children)
        assert not alive, f"left running: {alive}\n{server.output()}"
    finally:
        server.stop()


def test_uneven_split_fails_at_startup_with_the_numbers(tiny_model_dir, tmp_path):
    server = start_launcher("--model-id", str(tiny_model_dir), "--num-shard", "3", wait_ready=False, tmp=tmp_path)
    code = wait_exit(server, 120)
    assert code != 0
    out = server.output()
    assert "cannot be split over 3 shards" in out and "num_attention_heads=4 is not divisible by 3" in out, out
