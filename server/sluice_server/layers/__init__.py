"""Building blocks of the models: each layer owns its parameters and knows how
to load its tensor-parallel slice of a safetensors checkpoint. The arithmetic
under them (Triton and C++ kernels, the small ops, the CPU matmul plan) is
the `sluice_kernels` package; layers import it, never the other way.

- `linear`    - column- and row-parallel linear layers (oneDNN-packed on CPU).
- `gguf_weights` - attaches a GGUF's quantized blocks to the linear layers
                they match, for the CPU's few-row matmuls.
- `embedding` - vocab-parallel embedding and LM head.
- `norm`      - RMSNorm (with a fused residual add).
- `rotary`    - rotary position embeddings (default and llama3 scaling).
- `attention` - the attention backend contract (`AttentionBackend`,
                `AttentionMetadata`: the flattened batch's layout).
- `torch_attention`, `triton_attention` - the two backends (CPU / CUDA).
- `backends`  - picks the backend (and its small ops, `sluice_kernels.ops`)
                for a device.
"""
