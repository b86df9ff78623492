"""Which arithmetic the CPU shard's matrix multiplies use, decided once at load.

A linear layer on CPU can hold up to two forms of its weight (the shard's
layers.linear): GGUF blocks for matmuls of few rows (gguf_blocks.QuantizedWeight)
and a dense weight packed for oneDNN for the rest. The plan says which forms and dtypes:

    --dtype      GGUF model + CPU kernels               otherwise
    auto         int8 activations on the blocks for      the dense weights in
                 every step (with AMX: steps of <= 64    the model's dtype
                 rows; above, dense bfloat16)
    float32      blocks expanded exactly (<= 16 rows),   float32
                 dense float32 above
    bfloat16 ... no blocks; dense in that dtype

`auto` is the fast path and not bitwise the float32 model; its accuracy
against float32 is measured by benchmarks/quality.py and reported in the
README. `float32` is token-identical to transformers in float32 (the golden
tests). The shard's `--cpu-block-rows N` replaces the row limit of either
block path (0: never use the blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Instructions that make bf16 matmuls faster than float32 (Intel AMX, AVX-512
# BF16 on Intel and AMD Zen 4+). Without them torch computes bf16 through
# conversions: on an AVX2-only EPYC a bf16 matmul ran 0.2 GFLOP/s against
# float32's 70.
NATIVE_BF16_FLAGS = {"amx_bf16", "avx512_bf16"}

# Rows up to which the blocks beat the dense weights (whole steps of the
# bundled SmolLM2; benchmarks/step_bench.py --block-rows compares limits):
# - int8 with VNNI against AMX bf16, on a Sapphire Rapids host with AMX:
#   32-row decode step 138 ms on the blocks against 247 dense, 64 rows 185 /
#   194, equal at 128, dense ahead above (a step that small reads its weights
#   more than it multiplies, and the blocks are 3.5x smaller than bf16);
# - int8 with VNNI where there is no AMX: the blocks at every size. On a
#   Sapphire Rapids VM without AMX, 2 threads: 128-row decode step 185 ms
#   against 418 on dense bf16; a 256-token prefill 222 ms against 352 on
#   dense float32 and 482 on bf16 (AVX512-BF16 ran slower than float32 FMAs);
# - AVX2 only (PMADDUBSW on the 4- and 6-bit blocks): the blocks at every
#   size too. On an AVX2-only EPYC (Zen 3), 2 threads: 16-row decode step
#   of the bundled model 52.8 ms against 89.8 with dense float32 above 8
#   rows, 64 rows 260 against 306; one 2,048 x 2,048 layer, one thread, 256
#   rows: Q4_K 115 GOP/s, dense float32 77 GFLOP/s;
# - the exact expansion against float32 on an AVX2 EPYC.
ALL_ROWS = 1 << 30
INT8_ROWS_AMX = 64
EXACT_ROWS = 16


def cpu_flags() -> set[str]:
    """The CPU feature flags of /proc/cpuinfo (empty where it does not exist)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def native_bf16(flags: set[str]) -> bool:
    return bool(NATIVE_BF16_FLAGS & flags)


@dataclass(frozen=True)
class CpuMatmuls:
    # Activations quantized to int8 on the blocks (else the exact expansion).
    int8: bool
    # Matmuls of at most this many rows run on the blocks (0: never).
    block_rows: int
    # dtype of the packed dense weights (None: the model's dtype).
    dense_dtype: torch.dtype | None

    def describe(self) -> str:
        dense = str(self.dense_dtype or "model dtype").removeprefix("torch.")
        if self.block_rows <= 0:
            return f"dense {dense} weights (oneDNN)"
        blocks = "int8 activations on GGUF blocks" if self.int8 else "GGUF blocks expanded to float32"
        if self.block_rows >= ALL_ROWS:
            return f"{blocks} for every step"
        return f"{blocks} for steps of <= {self.block_rows} rows, dense {dense} (oneDNN) above"


def plan_cpu_matmuls(
    requested_dtype: str, dtype: torch.dtype, flags: set[str], block_rows: int | None = None
) -> CpuMatmuls:
    """The plan for a model computed in `dtype`, asked for as `requested_dtype`
    (the --dtype flag), on a CPU with `flags`; `block_rows` (None: from the
    CPU, as above) replaces the row limit where a block path applies. Whether
    the blocks exist is found out later; without them only the dense weights
    run."""
    if block_rows is not None and block_rows < 0:
        raise ValueError(f"block rows must be >= 0, got {block_rows}")
    if requested_dtype == "auto" and dtype == torch.float32:
        rows = INT8_ROWS_AMX if "amx_int8" in flags else ALL_ROWS
        dense = torch.bfloat16 if native_bf16(flags) else None
        return CpuMatmuls(int8=True, block_rows=rows if block_rows is None else block_rows, dense_dtype=dense)
    rows = EXACT_ROWS if dtype == torch.float32 else 0
    if rows and block_rows is not None:
        rows = block_rows
    return CpuMatmuls(int8=False, block_rows=rows, dense_dtype=None)
