"""A batch survives kill -9: the launcher's whole process group is killed
in the middle of a 500-line batch; a new server on the same --data-dir
finishes it with exactly 500 result lines, none twice, and does not run
again the lines that were done before the kill."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
from openai import OpenAI

from conftest import start_launcher, wait_gone

LINES = 500


def counts(base_url: str, batch_id: str) -> dict:
    batch = httpx.get(f"{base_url}/v1/batches/{batch_id}", timeout=10).json()
    return batch


def lines_run(base_url: str) -> float:
    total = 0.0
    for line in httpx.get(f"{base_url}/metrics").text.splitlines():
        if line.startswith("sluice_batch_api_lines_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_kill_9_mid_batch_then_restart_finishes_every_line_once(tiny_model_dir, tmp_path):
    data_dir = tmp_path / "data"
    flags = ("--model-id", str(tiny_model_dir), "--data-dir", str(data_dir), "--max-total-tokens", "256",
             "--max-batch-prefill-tokens", "256", "--max-batch-size", "32")
    first = start_launcher(*flags, tmp=tmp_path / "first")
    client = OpenAI(base_url=f"{first.base_url}/v1", api_key="-", max_retries=0)
    body = "".join(
        json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
                    "body": {"prompt": f"Item {i}:", "max_tokens": 3, "temperature": 0,
                             "ignore_eos": True}}) + "\n"
        for i in range(LINES))
    uploaded = client.files.create(file=("five-hundred.jsonl", body.encode()), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")

    deadline = time.monotonic() + 120
    while (done := counts(first.base_url, batch.id)["request_counts"]["completed"]) < 60:
        assert time.monotonic() < deadline, "the batch made no progress"
        time.sleep(0.05)
    pids = [first.proc.pid, *first.children()]
    os.killpg(first.proc.pid, signal.SIGKILL)
    first.proc.wait()
    assert wait_gone(pids) == [], "processes outlived kill -9 of the group"
    assert done < LINES, "the batch finished before the kill: make it longer"

    second = start_launcher(*flags, tmp=tmp_path / "second")
    try:
        deadline = time.monotonic() + 240
        while (state := counts(second.base_url, batch.id))["status"] != "completed":
            assert state["status"] in ("in_progress", "finalizing"), state
            assert time.monotonic() < deadline, state
            time.sleep(0.2)
        assert state["request_counts"] == {"total": LINES, "completed": LINES, "failed": 0}
        assert state["error_file_id"] is None
        output = httpx.get(f"{second.base_url}/v1/files/{state['output_file_id']}/content").text.splitlines()
        ids = [json.loads(line)["custom_id"] for line in output]
        assert len(ids) == LINES and sorted(set(ids)) == sorted(f"line-{i}" for i in range(LINES))
        # Lines done before the kill (at least `done`) did not run again.
        assert lines_run(second.base_url) <= LINES - done
        # The upload and the batch list came through the crash too.
        assert httpx.get(f"{second.base_url}/v1/files/{uploaded.id}").status_code == 200
    finally:
        second.stop()
