"""Tensor parallelism on CPU (gloo): two shard processes, each loading its
slice of every layer, produce transformers' logits."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from conftest import make_tiny_model, reference_logits

SERVER_DIR = Path(__file__).resolve().parents[1]
TESTS_DIR = Path(__file__).resolve().parent

WORKER = """
import sys, torch
from sluice_server.distributed import init_distributed
from sluice_server.model_runner import ModelRunner
from conftest import Driver
model_dir, out, tokens = sys.argv[1], sys.argv[2], [int(t) for t in sys.argv[3].split(",")]
dist = init_distributed(torch.device("cpu"))
runner = ModelRunner(model_dir, dtype="float32", block_size=4, dist=dist)
d = Driver(runner)
r = d.request(1, tokens)
d.step([(r, len(tokens) - 2)])  # prefill, then two decodes
d.step([(r, 1)])
d.step([(r, 1)])
torch.save(d.computed(1, 0, len(tokens)), f"{out}-{dist.rank}.pt")
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_shards_match_transformers(tmp_path):
    model_dir = make_tiny_model(tmp_path / "model", "qwen2", seed=3)
    tokens = [4, 8, 15, 16, 23, 42, 7, 9, 11, 5]
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   PYTHONPATH=f"{SERVER_DIR}{os.pathsep}{TESTS_DIR}", OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(
            [sys.executable, "-c", WORKER, str(model_dir), str(tmp_path / "logits"), ",".join(map(str, tokens))],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        ))
    for p in procs:
        out, _ = p.communicate(timeout=180)
        assert p.returncode == 0, out
    want = reference_logits(model_dir, tokens)
    for rank in range(2):
        got = torch.load(tmp_path / f"logits-{rank}.pt")
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
