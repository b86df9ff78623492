"""Triton kernels of the shard's CUDA path, each beside its plain-torch reference.

One module per kernel; each holds the `@triton.jit` kernel, a launcher that
checks the layout it expects, and `*_reference`, a plain-torch function with
the launcher's signature that the tests (`kernels/tests/`) compare it
with (README.md here has the design, the tolerances and GPU timings):

- `paged_attention`   - attention over the paged KV cache for a mixed batch
                        (decodes with split-KV, prefill chunks over cached prefixes).
- `reshape_and_cache` - writes a step's new k/v into the cache through the slot mapping.
- `rms_norm`          - RMSNorm fused with the residual add.
- `rotary`            - rotary embedding (GPT-NeoX rotate-half), in place on q and k.
- `silu_mul`          - SiLU(gate) * up for the MLP.
- `moe`               - the grouped expert MLP of mixture-of-experts layers
                        (tiles of one expert's tokens, a grouped GEMM).

Importing a module here imports triton; the CPU path of the shard never does.
Tests run the kernels under Triton's interpreter (TRITON_INTERPRET=1) on CPU
tensors, which must be set before triton is first imported. This file
itself imports no triton: `triton_interpreting` is safe on any path.
"""

import os


def triton_interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1),
    as the kernel tests do without a GPU. Read at call time."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
