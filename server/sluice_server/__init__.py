"""Sluice model shard: weights, the paged KV cache, kernels and sampling.

A Step travels through the modules in this order:

1. `servicer`      - the grpc.aio service; keeps per-request state, checks
                     each Step and commits what the runner computed.
2. `batch`         - flattens a StepRequest into one batch of tokens
                     (positions, slot mapping, cu_seqlens, block tables).
3. `model_runner`  - runs the whole step: forward pass, prompt logprobs,
                     sampling; owns the KV cache (`kv_cache`) and warmup.
4. `models`        - one file per model family (`models/llama.py`).
5. `layers`        - tensor-parallel linear/embedding, norms, rotary,
                     attention backends.
6. `sampling`      - batched logits processing and seeded sampling (called
                     by the runner).

`download` resolves a model id (Hub, local folder, .gguf) to a folder
(`gguf_convert` turns a .gguf into one; `model_folder` says what a folder
must hold); `cli` is the `sluice-server` command; `testing` builds the tiny
random-weight models the tests run on.
"""

__version__ = "0.1.0"
