"""One rank of a tensor-parallel run, started by test_tensor_parallel.py.

    python _tp_worker.py MODEL_DIR OUT_PREFIX TOKENS [--expert-parallel]
        (RANK, WORLD_SIZE, ... in the environment)

Writes OUT_PREFIX-RANK.pt with:
  logits       [len(TOKENS), vocab] from a prefill of all but two tokens, then two decodes
  param_bytes  bytes of this rank's parameters as loaded (tied ones counted once;
               a weight freed for its packed or GGUF-block form at its dense shape)
  rss_bytes    the process's resident set after loading the weights
  num_blocks   Warmup's block count; rank r offers (r + 1) x the KV budget of rank 0
  tokens       {request id: tokens} sampled by the servicer's Shard over 5 steps
               for a greedy request (1) and a seeded temperature-1 request (2)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import Driver  # noqa: E402
from sluice_server.distributed import init_distributed  # noqa: E402
from sluice_server.model_runner import ModelRunner  # noqa: E402
from sluice_server.options import ShardOptions  # noqa: E402
from sluice_server.pb import shard_pb2  # noqa: E402
from sluice_server.servicer import Shard  # noqa: E402

STEPS = 5


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def param_bytes(model: torch.nn.Module) -> int:
    dense = {id(m.weight): m.dense_shape for m in model.modules() if getattr(m, "dense_shape", None)}
    params = {id(p): p for p in model.parameters()}
    return sum(
        (p.numel() or int(torch.Size(dense.get(key, (0,))).numel())) * p.element_size() for key, p in params.items()
    )


def main() -> None:
    model_dir, out, tokens = sys.argv[1], sys.argv[2], [int(t) for t in sys.argv[3].split(",")]
    torch.set_num_threads(1)
    dist = init_distributed(torch.device("cpu"))
    options = ShardOptions(expert_parallel="--expert-parallel" in sys.argv[4:])
    runner = ModelRunner(model_dir, dtype="float32", block_size=4, dist=dist, options=options)
    result = {
        "param_bytes": param_bytes(runner.model),
        "rss_bytes": rss_bytes(),
    }

    d = Driver(runner, num_blocks=16)
    r = d.request(1, tokens)
    d.step([(r, len(tokens) - 2)])
    d.step([(r, 1)])
    d.step([(r, 1)])
    result["logits"] = d.computed(1, 0, len(tokens))

    block_bytes = runner.bytes_per_block()
    shard = Shard(runner, [], kv_cache_bytes=(dist.rank + 1) * 40 * block_bytes)
    warm = shard.warmup(shard_pb2.WarmupRequest(max_batch_prefill_tokens=32, max_batch_size=4, max_total_tokens=32))
    result["num_blocks"] = warm.num_blocks

    sampled = shard_pb2.SamplingParams(temperature=1.0, top_k=20, seed=1234)
    blocks = {1: [0, 1, 2, 3], 2: [4, 5, 6, 7]}
    got: dict[int, list[int]] = {1: [], 2: []}
    req = shard_pb2.StepRequest(new_requests=[
        shard_pb2.NewRequest(id=rid, token_ids=tokens, num_prompt_tokens=len(tokens), num_computed_tokens=0,
                             num_new_tokens=len(tokens), block_ids=blocks[rid], params=p)
        for rid, p in ((1, shard_pb2.SamplingParams()), (2, sampled))
    ])
    for _ in range(STEPS):
        response = shard.step(req)
        assert not response.errors, response.errors
        for g in response.generations:
            got[g.id].append(g.token_id)
        req = shard_pb2.StepRequest(scheduled=[shard_pb2.ScheduledRequest(id=rid, num_new_tokens=1) for rid in (1, 2)])
    result["tokens"] = got
    torch.save(result, f"{out}-{dist.rank}.pt")
    dist.shutdown()


if __name__ == "__main__":
    main()
