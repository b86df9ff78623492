"""Sluice's kernels: the Triton (CUDA) and C++ (CPU) kernels of the shard,
their loaders and ISA dispatch, each beside a plain-torch reference.

The model layers (`sluice_server.layers`) import this package; it imports
nothing of the shard, so a kernel can be built, tested and benchmarked on
its own (`kernels/tests`, `kernels/benchmarks`). Importing this file imports
neither triton nor the C++ build.

    ops           the small per-token ops of a decoder layer behind one
                  interface: TorchOps (the reference), CpuOps (C++),
                  TritonOps; the layers pick one per attention backend
    triton/       Triton kernels, one module per kernel with its launcher and
                  `*_reference`: paged attention (split-KV decode, prefill
                  over cached prefixes, attention sinks), reshape_and_cache,
                  rms_norm, rotary, silu_mul, moe (the grouped expert GEMM)
    csrc/         C++ CPU kernels (cpu_attention, cpu_ops, cpu_q8_linear,
                  cpu_moe, cpu_decoder), built for the host on first use
    cpu_kernels   builds and loads csrc/ (`load()`), and says which of its
                  instruction-set paths this CPU runs (`isa_path()`)
    cpu_matmuls   the CPU's features (`cpu_flags()`) and the plan of which
                  arithmetic each CPU matmul uses (GGUF blocks with int8 or
                  exact activations, dense float32/bfloat16)
    gguf_blocks   GGUF block formats unpacked into the records the block
                  matmuls read, and `QuantizedWeight`, a layer's packed blocks
    moe           the grouped expert MLP of mixture-of-experts layers: the
                  plain-torch reference, `QuantizedExperts` (every expert's
                  block records, one C++ call per layer), MXFP4 as records

README.md beside this package has the kernels' design, tolerances and timings.
"""
