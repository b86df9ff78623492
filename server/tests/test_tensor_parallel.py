"""Tensor parallelism on CPU (gloo): 1, 2 and 3 shard processes, each loading
its slice of every layer, give the same logits, the same greedy and seeded
sampled tokens, one Warmup block count, and about 1/N of the weights each.

Each run starts one process per rank (`_tp_worker.py`) with the
torch.distributed environment the launcher sets."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import CHECKOUT_PYTHONPATH, make_tiny_model, reference_logits
from sluice_server.distributed import Distributed
from sluice_server.model_runner import ModelRunner

WORKER = Path(__file__).resolve().parent / "_tp_worker.py"
TOKENS = [4, 8, 15, 16, 23, 42, 7, 9, 11, 5]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(model_dir: Path, out: Path, world_size: int, tokens: list[int] = TOKENS,
              flags: tuple[str, ...] = ()) -> list[dict]:
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), PYTHONPATH=CHECKOUT_PYTHONPATH, OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(
            [sys.executable, str(WORKER), str(model_dir), str(out), ",".join(map(str, tokens)), *flags],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        ))
    for p in procs:
        output, _ = p.communicate(timeout=600)
        assert p.returncode == 0, output
    return [torch.load(f"{out}-{rank}.pt") for rank in range(world_size)]


def norm_bytes(model_dir: Path) -> int:
    """Bytes of the RMSNorm weights, which every rank holds whole."""
    runner = ModelRunner(model_dir, dtype="float32", block_size=4)
    return sum(p.numel() * 4 for n, p in runner.model.named_parameters() if n.endswith("norm.weight"))


# Every model splits over 2 and 3 shards: "gqa" 12 query / 6 key-value heads
# (split evenly); "mqa" 6 query heads and one key-value head (replicated on
# every shard), with q/k/v biases.
MODELS = {
    "gqa": dict(kind="llama", num_attention_heads=12, num_key_value_heads=6, hidden_size=96, intermediate_size=96),
    "mqa": dict(kind="qwen2", num_attention_heads=6, num_key_value_heads=1, hidden_size=48, intermediate_size=96),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_tiny_models_agree_over_1_2_3_shards(tmp_path, name):
    spec = dict(MODELS[name])
    model_dir = make_tiny_model(tmp_path / "model", spec.pop("kind"), seed=3, **spec)
    want = reference_logits(model_dir, TOKENS)
    runs = {n: run_ranks(model_dir, tmp_path / f"tp{n}", n) for n in (1, 2, 3)}
    single = runs[1][0]
    torch.testing.assert_close(single["logits"], want, atol=1e-4, rtol=0)
    norms = norm_bytes(model_dir)
    for n, ranks in runs.items():
        for r in ranks:
            torch.testing.assert_close(r["logits"], single["logits"], atol=2e-5, rtol=0)
            # Sampling reads only the gathered logits and (seed, position): every
            # rank, and every shard count, draws the same tokens.
            assert r["tokens"] == single["tokens"]
            # Rank r offered (r + 1) x rank 0's KV budget; all use rank 0's count.
            assert r["num_blocks"] == 40
            # Everything but the norms is split; the vocabulary split pads it to
            # a multiple of n (128 -> 129 rows for 3), and a replicated KV head
            # adds its k/v rows (+ biases) on each rank.
            split = (single["param_bytes"] - norms) / n
            slack = 2 * spec["hidden_size"] * 4 * (n - 1)  # padding row of embedding + LM head
            if spec["num_key_value_heads"] < n:
                head_dim = spec["hidden_size"] // spec["num_attention_heads"]
                slack += 2 * head_dim * (spec["hidden_size"] + 1) * 4 * (1 - 1 / n) * 2  # 2 layers
            assert abs(r["param_bytes"] - (split + norms)) <= slack, (n, r["param_bytes"], split + norms)
    assert len(set(runs[1][0]["tokens"][2])) > 1  # the sampled request really sampled


# The other families over every shard count up to 4 that their head counts
# allow (4 query heads: 2 and 4; 6 query / 3 key-value heads: 3; 6 / 2: 2);
# the 10-token prompt is longer than the 8-token sliding windows (Phi-3's is 16;
# its LongRoPE runs the long factors past 8 positions). Gemma 3's one
# key-value head is copied on every shard. The mixtures of experts split each
# expert's intermediate size (Qwen3-MoE's 32 over 4: 8 rows each), Qwen2-MoE
# its shared expert's too (48 over 4: 12 rows), gpt-oss its sinks with the
# query heads.
FAMILIES = {
    "qwen3_moe": (dict(num_attention_heads=4, num_key_value_heads=2), (2, 4)),
    "qwen2_moe": (dict(num_attention_heads=4, num_key_value_heads=2), (2, 4)),
    "mixtral": (dict(num_attention_heads=4, num_key_value_heads=2), (2,)),
    "gpt_oss": (dict(num_attention_heads=4, num_key_value_heads=2), (2, 4)),
    "qwen3": (dict(num_attention_heads=4, num_key_value_heads=2), (2, 4)),
    "gemma3": (dict(num_attention_heads=4, num_key_value_heads=1), (2, 4)),
    "phi3": (dict(num_attention_heads=6, num_key_value_heads=3, hidden_size=96), (3,)),
    "mistral": (dict(num_attention_heads=6, num_key_value_heads=2, hidden_size=96), (2,)),
}


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_other_families_agree_over_shards(tmp_path, kind):
    spec, world_sizes = FAMILIES[kind]
    model_dir = make_tiny_model(tmp_path / "model", kind, seed=5, **spec)
    want = reference_logits(model_dir, TOKENS)
    single = run_ranks(model_dir, tmp_path / "tp1", 1)[0]
    torch.testing.assert_close(single["logits"], want, atol=1e-4, rtol=0)
    for n in world_sizes:
        for r in run_ranks(model_dir, tmp_path / f"tp{n}", n):
            torch.testing.assert_close(r["logits"], single["logits"], atol=2e-5, rtol=0)
            assert r["tokens"] == single["tokens"]


def test_smollm2_agrees_over_1_and_3_shards(tmp_path, smollm2_dir):
    """SmolLM2-135M: 9 query / 3 key-value heads split over 3 shards (2 does
    not divide 9: see test_uneven_split_is_a_clear_error)."""
    runs = {n: run_ranks(smollm2_dir, tmp_path / f"tp{n}", n, TOKENS[:6]) for n in (1, 3)}
    single = runs[1][0]
    for r in runs[3]:
        torch.testing.assert_close(r["logits"], single["logits"], atol=5e-4, rtol=1e-4)
        assert r["tokens"] == single["tokens"]
        assert r["num_blocks"] == 40
        # Embedding (tied LM head) and every projection split, norms replicated:
        # each rank holds about a third.
        assert 0.32 < r["param_bytes"] / single["param_bytes"] < 0.35
    mib = lambda b: f"{b / 2**20:.0f} MiB"  # noqa: E731
    print(f"\nSmolLM2 fp32 parameters per rank: 1 shard {mib(single['param_bytes'])}, "
          f"3 shards {[mib(r['param_bytes']) for r in runs[3]]}; RSS 1 shard {mib(single['rss_bytes'])}, "
          f"3 shards {[mib(r['rss_bytes']) for r in runs[3]]}")


# Expert parallelism (--expert-parallel): each of 2 shards holds half the
# experts whole (the tiny Qwen3-MoE's 8; gpt-oss's 4, as MXFP4 blocks, with
# down biases that each expert's rank adds); every token's experts are summed
# by the one all-reduce, so the shards equal transformers and one shard.
@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
def test_expert_parallel_equals_transformers(tmp_path, kind):
    from sluice_server.testing import to_mxfp4_checkpoint

    model_dir = make_tiny_model(tmp_path / "model", kind, seed=5, num_attention_heads=4, num_key_value_heads=2)
    if kind == "gpt_oss":
        model_dir = to_mxfp4_checkpoint(model_dir)
    want = reference_logits(model_dir, TOKENS)
    single = run_ranks(model_dir, tmp_path / "tp1", 1)[0]
    torch.testing.assert_close(single["logits"], want, atol=1e-4, rtol=0)
    for r in run_ranks(model_dir, tmp_path / "ep2", 2, flags=("--expert-parallel",)):
        torch.testing.assert_close(r["logits"], want, atol=1e-4, rtol=0)
        assert r["tokens"] == single["tokens"]


def test_expert_parallel_holds_whole_experts(tmp_path):
    """Rank 1 of 2 holds experts 4-7 of each layer, whole (loading needs no
    process group; no step runs here)."""
    from safetensors.torch import load_file

    from sluice_server.options import ShardOptions

    model_dir = make_tiny_model(tmp_path, "qwen3_moe", num_attention_heads=4, num_key_value_heads=2)
    runner = ModelRunner(model_dir, dtype="float32", dist=Distributed(rank=1, world_size=2), pack_weights=False,
                         options=ShardOptions(expert_parallel=True))
    moe = runner.model.model.layers[0].mlp
    assert (moe.expert_first, moe.expert_last, tuple(moe.w13_weight.shape)) == (4, 8, (4, 64, 64))
    checkpoint = load_file(str(model_dir / "model.safetensors"))
    experts = "model.layers.0.mlp.experts"
    for e in range(4, 8):
        whole = torch.cat([checkpoint[f"{experts}.{e}.gate_proj.weight"], checkpoint[f"{experts}.{e}.up_proj.weight"]])
        torch.testing.assert_close(moe.w13_weight[e - 4], whole, atol=0, rtol=0)
        torch.testing.assert_close(moe.w2_weight[e - 4], checkpoint[f"{experts}.{e}.down_proj.weight"], atol=0, rtol=0)


def test_expert_parallel_refuses_experts_that_do_not_divide(tmp_path):
    from sluice_server.options import ShardOptions

    model_dir = make_tiny_model(tmp_path, "qwen3_moe", num_experts=6, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError) as err:
        ModelRunner(model_dir, dtype="float32", dist=Distributed(rank=0, world_size=4),
                    options=ShardOptions(expert_parallel=True))
    assert str(err.value) == ("the model cannot be split over 4 shards: num_experts=6 is not divisible by 4 "
                              "(--expert-parallel gives each shard whole experts)")


@pytest.mark.parametrize("heads,kv_heads,inter,world,message", [
    (4, 2, 96, 3, "num_attention_heads=4 is not divisible by 3; num_key_value_heads=2 neither divides nor is "
                  "divisible by 3"),
    (6, 3, 96, 2, "num_key_value_heads=3 neither divides nor is divisible by 2"),
    (4, 4, 90, 4, "intermediate_size=90 is not divisible by 4"),
])
def test_uneven_split_is_a_clear_error(tmp_path, heads, kv_heads, inter, world, message):
    model_dir = make_tiny_model(tmp_path, "llama", num_attention_heads=heads, num_key_value_heads=kv_heads,
                                hidden_size=8 * heads, intermediate_size=inter)
    with pytest.raises(ValueError) as err:
        ModelRunner(model_dir, dtype="float32", dist=Distributed(rank=0, world_size=world))
    assert str(err.value) == f"the model cannot be split over {world} shards: {message}"
