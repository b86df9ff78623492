"""`sluice-server serve --attention-backend`: the shard reports the backend it
runs in Info, the Triton one (under Triton's interpreter, on CPU) serves the
same greedy tokens as transformers, and Triton on CPU without the interpreter
is refused with one clear line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import pytest
import torch

from sluice_server.pb import shard_pb2, shard_pb2_grpc

from conftest import CHECKOUT_PYTHONPATH, make_tiny_model

BLOCK = 4
# A shard's start may include building the CPU kernels for this checkout
# (minutes on a busy 2-core machine); only a hang should reach this.
START_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("backend-model"), "tied", seed=11)


def serve(model_dir: Path, sock_dir: str, *args: str, env: dict | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "sluice_server.cli", "serve", str(model_dir), "--uds-path",
           os.path.join(sock_dir, "shard"), "--kv-cache-bytes", str(16 * 2**20), "--block-size", str(BLOCK),
           "--num-threads", "1", *args]
    full_env = dict(os.environ, PYTHONPATH=CHECKOUT_PYTHONPATH, RANK="0", WORLD_SIZE="1", **(env or {}))
    log = open(os.path.join(sock_dir, "server.log"), "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env)


def wait_started(proc: subprocess.Popen, sock_dir: str) -> grpc.Channel:
    log_path = Path(sock_dir) / "server.log"
    deadline = time.monotonic() + START_TIMEOUT_S
    while "Server started at unix://" not in log_path.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail("server did not start:\n" + log_path.read_text())
        time.sleep(0.1)
    return grpc.insecure_channel(f"unix://{sock_dir}/shard-0")


def test_triton_backend_flag_serves_greedy_tokens(model_dir):
    from sluice_server.testing import transformers_model

    tokens = [5, 9, 17, 33, 4, 81, 12]
    model = transformers_model(model_dir, dtype=torch.float32)
    want = model.generate(torch.tensor([tokens]), max_new_tokens=3, do_sample=False, eos_token_id=None,
                          pad_token_id=0, min_new_tokens=3)[0, len(tokens):].tolist()

    sock_dir = tempfile.mkdtemp(prefix="sluice-")
    proc = serve(model_dir, sock_dir, "--attention-backend", "triton", env={"TRITON_INTERPRET": "1"})
    try:
        channel = wait_started(proc, sock_dir)
        stub = shard_pb2_grpc.ShardStub(channel)
        assert stub.Info(shard_pb2.InfoRequest()).attention_backend == "triton"
        stub.Warmup(shard_pb2.WarmupRequest(max_batch_prefill_tokens=16, max_batch_size=2, max_total_tokens=16))
        r = stub.Step(shard_pb2.StepRequest(new_requests=[shard_pb2.NewRequest(
            id=1, token_ids=tokens, num_prompt_tokens=len(tokens), num_computed_tokens=0,
            num_new_tokens=len(tokens), block_ids=[3, 1], params=shard_pb2.SamplingParams(),
        )]))
        got = [r.generations[0].token_id]
        for new_blocks in ([2], []):
            r = stub.Step(shard_pb2.StepRequest(scheduled=[
                shard_pb2.ScheduledRequest(id=1, num_new_tokens=1, new_block_ids=new_blocks)]))
            got.append(r.generations[0].token_id)
        assert got == want
        channel.close()
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(sock_dir, ignore_errors=True)


def test_auto_backend_on_cpu_is_torch(model_dir):
    sock_dir = tempfile.mkdtemp(prefix="sluice-")
    proc = serve(model_dir, sock_dir)  # --attention-backend auto
    try:
        channel = wait_started(proc, sock_dir)
        assert shard_pb2_grpc.ShardStub(channel).Info(shard_pb2.InfoRequest()).attention_backend == "torch"
        channel.close()
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(sock_dir, ignore_errors=True)


def test_triton_on_cpu_without_interpreter_fails_clearly(model_dir):
    sock_dir = tempfile.mkdtemp(prefix="sluice-")
    try:
        proc = serve(model_dir, sock_dir, "--attention-backend", "triton", env={"TRITON_INTERPRET": "0"})
        assert proc.wait(timeout=START_TIMEOUT_S) == 1
        out = (Path(sock_dir) / "server.log").read_text()
        assert "attention backend 'triton' needs a CUDA device" in out and "TRITON_INTERPRET=1" in out, out
        assert "Traceback" not in out
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)
