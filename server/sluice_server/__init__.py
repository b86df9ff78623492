"""Sluice model shard: weights, the paged KV cache, kernels and sampling.

A Step travels through the modules in this order:

1. `servicer`      - the grpc.aio service; keeps per-request state.
2. `batch`         - flattens a StepRequest into one batch of tokens
                     (positions, slot mapping, cu_seqlens, block tables).
3. `model_runner`  - runs the model over the batch; owns the KV cache
                     (`kv_cache`) and warmup.
4. `models`        - one file per model family (`models/llama.py`).
5. `layers`        - tensor-parallel linear/embedding, norms, rotary,
                     attention backends.
6. `sampling`      - batched logits processing and seeded sampling.

`download` resolves a model id (Hub, local folder, .gguf) to a folder
(`gguf_convert` turns a .gguf into one; `model_folder` says what a folder
must hold); `cli` is the `sluice-server` command.
"""

__version__ = "0.1.0"
