"""Supervision and shutdown, each test with its own launcher and a tiny model."""

import json
import os
import signal
import threading
import time

import httpx
import pytest

from conftest import start_launcher, wait_gone


def metric(base_url: str, name: str) -> float:
    """Sum of every sample of `name` (any labels) on /metrics."""
    total, found = 0.0, False
    for line in httpx.get(f"{base_url}/metrics").text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    assert found, f"{name} missing from /metrics"
    return total


def shard_pids(launcher) -> list[int]:
    pids = []
    for pid in launcher.children():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ")
        except OSError:
            continue
        if b" serve " in cmd:
            pids.append(pid)
    return pids


def wait_exit(launcher, timeout: float) -> int:
    try:
        return launcher.proc.wait(timeout=timeout)
    except Exception:
        pytest.fail(f"launcher still running after {timeout}s:\n{launcher.output()}")


def test_disconnect_frees_blocks(launcher):
    """The shared launcher: a client that goes away mid-stream frees its blocks."""
    model = httpx.get(f"{launcher.base_url}/v1/models").json()["data"][0]["id"]
    before = metric(launcher.base_url, "sluice_kv_blocks_used")
    body = {"model": model, "prompt": "Tell me everything about the sea.", "max_tokens": 1000,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{launcher.base_url}/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        for i, _ in enumerate(resp.iter_lines()):
            if i == 6:
                assert metric(launcher.base_url, "sluice_kv_blocks_used") > before
                break
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if metric(launcher.base_url, "sluice_kv_blocks_used") == before:
            break
        time.sleep(0.2)
    assert metric(launcher.base_url, "sluice_kv_blocks_used") == before


def test_killed_shard_stops_launcher(tiny_model_dir, tmp_path):
    server = start_launcher("--model-id", str(tiny_model_dir), tmp=tmp_path)
    try:
        shards = shard_pids(server)
        assert shards, server.output()
        children = server.children()
        os.kill(shards[0], signal.SIGKILL)
        code = wait_exit(server, 120)
        assert code != 0
        assert wait_gone(children) == [], server.output()
    finally:
        server.stop()


def test_sigterm_lets_stream_finish(tiny_model_dir, tmp_path):
    server = start_launcher("--model-id", str(tiny_model_dir), "--shutdown-timeout", "60", tmp=tmp_path)
    try:
        model = httpx.get(f"{server.base_url}/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "hello", "max_tokens": 300, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        chunks, done = [], threading.Event()
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=120) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: ") and len(chunks) == 3 and not done.is_set():
                    server.proc.send_signal(signal.SIGTERM)
                    done.set()
                if line.startswith("data: "):
                    chunks.append(line[len("data: "):])
        assert chunks[-1] == "[DONE]"
        usage = [json.loads(c)["usage"] for c in chunks[:-1] if json.loads(c).get("usage")]
        assert usage and usage[-1]["completion_tokens"] == 300
        assert wait_exit(server, 120) == 0
    finally:
        server.stop()


def test_startup_failure_is_quick_and_clear(tmp_path):
    """Quick: the launcher exits by itself (it does not wait for a readiness
    that cannot come), with the model named."""
    server = start_launcher("--model-id", str(tmp_path / "no-such-model"), wait_ready=False, tmp=tmp_path)
    code = wait_exit(server, 120)
    assert code != 0
    assert "no-such-model" in server.output()
