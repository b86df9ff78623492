"""Building blocks of the models: each layer owns its parameters and knows how
to load its tensor-parallel slice of a safetensors checkpoint.

- `linear`    - column- and row-parallel linear layers.
- `embedding` - vocab-parallel embedding and LM head.
- `norm`      - RMSNorm (with a fused residual add).
- `rotary`    - rotary position embeddings (default and llama3 scaling).
- `attention` - the attention backend contract (`AttentionBackend`,
                `AttentionMetadata`: the flattened batch's layout).
- `torch_attention`, `triton_attention` - the two backends (CPU / CUDA).
- `backends`  - picks the backend (and its small ops, `ops`) for a device.
"""
