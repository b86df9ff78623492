"""Rank, world size and the collectives the tensor-parallel layers use.

Rank and world size come from the torch.distributed environment variables
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) that the launcher sets. With
WORLD_SIZE 1 (or unset) no process group is created and every collective is
the identity, so a single shard needs no rendezvous at all.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Distributed:
    rank: int
    world_size: int
    # How expert layers split over the ranks (--expert-parallel): False,
    # every expert's intermediate dimension (tensor parallel); True, whole
    # experts, E / world_size per rank (layers/moe.py).
    expert_parallel: bool = False

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums `x` over the ranks, in place."""
        if self.is_parallel:
            dist.all_reduce(x)
        return x

    def shutdown(self) -> None:
        """Waits for every rank, then tears the process group down, so no
        rank exits while its communication threads still run (with gloo an
        exit in that state can abort the process at interpreter shutdown)."""
        if self.is_parallel and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()

    def min_over_ranks(self, value: int) -> int:
        """The smallest `value` any rank passed (a collective: every rank calls it)."""
        if not self.is_parallel:
            return value
        # NCCL reduces only CUDA tensors; gloo takes CPU ones.
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenates every rank's `x` along the last dimension, rank order."""
        if not self.is_parallel:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


SINGLE = Distributed(rank=0, world_size=1)


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def init_distributed(device: torch.device) -> Distributed:
    """Joins the process group described by the environment (NCCL on CUDA, gloo on CPU)."""
    rank = _env_int("RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"invalid RANK={rank} / WORLD_SIZE={world_size}")
    if world_size == 1:
        return SINGLE
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(name):
            raise ValueError(f"WORLD_SIZE={world_size} needs {name} to be set")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size)
    return Distributed(rank=rank, world_size=world_size)


def shard_range(size: int, d: Distributed) -> tuple[int, int]:
    """[start, end) of this rank's equal share of `size` (which must divide evenly)."""
    if size % d.world_size != 0:
        raise ValueError(f"dimension {size} does not split over {d.world_size} shards")
    part = size // d.world_size
    return d.rank * part, (d.rank + 1) * part
