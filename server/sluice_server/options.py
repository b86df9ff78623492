"""The shard's settings beyond the model and the socket: one typed value,
built from `sluice-server serve`'s arguments (which the launcher passes on)
and checked once, at start. Nothing here is read from the environment.
"""

from __future__ import annotations

from dataclasses import dataclass

KV_CACHE_DTYPES = ("auto", "float32", "bfloat16")
LORA_DTYPES = ("auto", "float32", "bfloat16")
CPU_KERNEL_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class ShardOptions:
    """The shard's knobs that change its outputs, memory or speed beyond
    --dtype (`sluice-server serve` flags, which the launcher passes on),
    checked once when built. What each decided shows in Info and the log."""

    # --kv-cache-dtype: the KV cache's element type; auto picks it by path
    # (choose_kv_dtype).
    kv_cache_dtype: str = "auto"
    # --cpu-kernels: auto uses the C++ CPU kernels where they build (plain
    # torch without a compiler); on refuses to start without them; off never
    # loads them.
    cpu_kernels: str = "auto"
    # --cpu-block-rows: matmuls of at most this many rows run on a GGUF's
    # blocks (0: never); None: the CPU's own limit (cpu_matmuls).
    cpu_block_rows: int | None = None
    # --expert-parallel: with several shards, each holds E / N whole experts
    # of every expert layer instead of a slice of every expert (layers/moe.py).
    expert_parallel: bool = False
    # --lora-dtype: the element type of the LoRA adapter stacks; auto picks
    # it by path (model_runner.choose_lora_dtype).
    lora_dtype: str = "auto"
    # --max-weight-memory: bytes this rank's weights may hold, every form
    # counted (Info.weight_bytes); the plan drops the dense copies of
    # block-served matrices to fit, and the shard refuses to start where
    # the weights exceed it even so (model_runner). None: no limit.
    max_weight_memory: int | None = None

    def __post_init__(self):
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
        if self.lora_dtype not in LORA_DTYPES:
            raise ValueError(f"--lora-dtype {self.lora_dtype!r} is not one of {', '.join(LORA_DTYPES)}")
        if self.cpu_kernels not in CPU_KERNEL_MODES:
            raise ValueError(f"--cpu-kernels {self.cpu_kernels!r} is not one of {', '.join(CPU_KERNEL_MODES)}")
        if self.cpu_block_rows is not None and self.cpu_block_rows < 0:
            raise ValueError(f"--cpu-block-rows must be >= 0, got {self.cpu_block_rows}")
        if self.max_weight_memory is not None and self.max_weight_memory <= 0:
            raise ValueError(f"--max-weight-memory must be > 0 bytes, got {self.max_weight_memory}")
