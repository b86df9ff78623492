"""Tiny random-weight models for tests (the shard's, the kernels' and the
end-to-end ones): a few MB, loaded in well under a second, in the same
Hugging Face layout as a real checkpoint. Imports torch and transformers
only when called.
"""

from __future__ import annotations

from pathlib import Path

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)


# Sliding windows of the tiny models: shorter than most test prompts.
TINY_WINDOW = 8


def transformers_model(folder: Path, **kwargs):
    """transformers' model for a model folder (`from_pretrained` kwargs, e.g.
    dtype): read from the folder, or, for a folder converted from a Llama/Qwen
    GGUF (whose block-served matrices stay in the .gguf: gguf_checkpoint.py),
    from the .gguf itself, which transformers dequantizes exactly as the
    folder's tensors are (server/tests/test_gguf_direct.py)."""
    import transformers

    from sluice_server.gguf_checkpoint import GGUFTensors

    folder = Path(folder)
    tensors = GGUFTensors.of_folder(folder)
    if tensors is None:
        return transformers.AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    from sluice_server.gguf_convert import _dequantize_option

    return transformers.AutoModelForCausalLM.from_pretrained(
        str(tensors.gguf.parent), gguf_file=tensors.gguf.name, **kwargs, **_dequantize_option()
    )


def make_tiny_model(folder: Path, kind: str = "llama", seed: int = 0, **overrides) -> Path:
    """Saves a random-weight model (float32) in HF layout into `folder`.

    kind: "llama" (GQA, untied), "qwen2" (q/k/v biases), "tied" (SmolLM2-like),
    "mha" (no GQA), "llama3" (rope_scaling type llama3), "mistral" (sliding
    window in every layer), "qwen3" (q/k norms, head_dim != hidden / heads,
    the second layer windowed), "gemma3" (a local and a global layer, linear
    rope on the global one, logit soft-capping), "phi3" (fused tensors,
    LongRoPE past 8 positions, half the head rotated, a window of 16),
    "yarn" (Qwen3 with YaRN over an original 16 positions, factor 16),
    "qwen3_moe" (8 experts, top 2, renormalized; head_dim 32), "qwen2_moe"
    (3 layers: the middle one dense (`mlp_only_layers`), the others 8
    experts, top 2, not renormalized, and a gated shared expert of width 48;
    the first layer windowed), "mixtral" (4
    experts, top 2, a window of 16), "gpt_oss" (4 experts, top 2, sinks,
    biases, alternating windows of 8, YaRN over an original 16 positions,
    the SwiGLU clamp at 1 so that it bites). Router weights are drawn with a
    unit deviation, so top-k choices are not near ties that rounding could
    flip. Norm weights are random too, so a norm that is not loaded, or loaded as
    the wrong variant, shows. `overrides` change TINY's sizes (and any other
    config field, e.g. vocab_size, bos_token_id). The weights depend only on
    the config and `seed`.
    """
    import torch
    import transformers

    torch.manual_seed(seed)
    args = dict(TINY, **(dict(num_hidden_layers=3) if kind == "qwen2_moe" else {}))
    args.update(overrides)
    if kind == "qwen2":
        config = transformers.Qwen2Config(**args, tie_word_embeddings=False)
    elif kind == "tied":
        config = transformers.LlamaConfig(**args, tie_word_embeddings=True, rope_theta=100000.0)
    elif kind == "mha":
        config = transformers.LlamaConfig(**dict(args, num_key_value_heads=4), tie_word_embeddings=False)
    elif kind == "llama3":
        config = transformers.LlamaConfig(
            **args,
            tie_word_embeddings=False,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        )
    elif kind == "mistral":
        config = transformers.MistralConfig(**dict(dict(sliding_window=TINY_WINDOW), **args), tie_word_embeddings=False)
    elif kind == "qwen3":
        config = transformers.Qwen3Config(
            **dict(dict(head_dim=32, use_sliding_window=True, sliding_window=TINY_WINDOW, max_window_layers=1), **args),
            tie_word_embeddings=False,
        )
    elif kind == "gemma3":
        layers = args["num_hidden_layers"]
        config = transformers.Gemma3TextConfig(
            **dict(dict(
                head_dim=32, query_pre_attn_scalar=24, sliding_window=TINY_WINDOW, final_logit_softcapping=3.0,
                layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
                rope_parameters={
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                    "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
                },
            ), **args),
            pad_token_id=0, bos_token_id=1,
        )
    elif kind == "phi3":
        rotated = args["hidden_size"] // args["num_attention_heads"] // 2
        config = transformers.Phi3Config(
            **dict(dict(
                partial_rotary_factor=0.5, original_max_position_embeddings=8, sliding_window=16,
                rope_scaling={
                    "type": "longrope",
                    "short_factor": [1.0 + 0.1 * i for i in range(rotated // 2)],
                    "long_factor": [1.0 + 0.7 * i for i in range(rotated // 2)],
                },
            ), **args),
            tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )
    elif kind == "yarn":
        config = transformers.Qwen3Config(
            **dict(dict(head_dim=32, rope_parameters={
                "rope_type": "yarn", "rope_theta": 10000.0, "factor": 16.0, "original_max_position_embeddings": 16,
            }), **args),
            tie_word_embeddings=False,
        )
    elif kind == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            **dict(dict(head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                        norm_topk_prob=True), **args),
            tie_word_embeddings=False,
        )
    elif kind == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(
            **dict(dict(mlp_only_layers=[1], num_experts=8, num_experts_per_tok=2,
                        moe_intermediate_size=32, shared_expert_intermediate_size=48, norm_topk_prob=False,
                        use_sliding_window=True, sliding_window=TINY_WINDOW, max_window_layers=2), **args),
            tie_word_embeddings=False,
        )
    elif kind == "mixtral":
        config = transformers.MixtralConfig(
            **dict(dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=16), **args),
            tie_word_embeddings=False,
        )
    elif kind == "gpt_oss":
        layers = args["num_hidden_layers"]
        config = transformers.GptOssConfig(
            **dict(dict(
                head_dim=16, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                sliding_window=TINY_WINDOW, swiglu_limit=1.0,
                layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
                rope_parameters={
                    "rope_type": "yarn", "rope_theta": 150000.0, "factor": 16.0, "beta_fast": 32.0,
                    "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16,
                },
            ), **args),
            tie_word_embeddings=False,
        )
    elif kind == "llama":
        config = transformers.LlamaConfig(**args, tie_word_embeddings=False)
    else:
        raise ValueError(kind)
    config.eos_token_id = 2
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random biases and norms, so a loading bug cannot hide behind zeros or ones
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
            elif name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.2)
            elif name.endswith(("router.weight", "mlp.gate.weight", "shared_expert_gate.weight", "sinks")):
                p.normal_(0, 1)
            elif kind == "gpt_oss" and ".experts." in name:
                p.mul_(10)
    model.save_pretrained(folder)
    return folder


def teacher_forced_logits(runner, tokens: list[int], chunk: int):
    """Logits [len(tokens), vocab] of one sequence under teacher forcing, run
    through `runner` (a model_runner.ModelRunner) in steps of `chunk` tokens
    (1: one decode step per position, the decode path; more: prefill chunks).
    Row p scores token p + 1."""
    import torch

    from sluice_server.batch import RequestState, Work
    from sluice_server.pb import shard_pb2

    bs = runner.block_size
    blocks = list(range(-(-len(tokens) // bs)))
    runner.allocate_kv_cache(len(blocks))
    state = RequestState(id=0, token_ids=list(tokens), num_prompt_tokens=len(tokens), num_computed_tokens=0,
                         block_ids=blocks, params=shard_pb2.SamplingParams())
    out = []
    start = 0
    while start < len(tokens):
        n = min(chunk, len(tokens) - start)
        batch = runner.build_batch([Work(state, start, n, blocks)])
        batch.logits_indices = torch.arange(n)
        out.append(runner.execute(batch))
        start += n
    return torch.cat(out)


def fidelity(logits, reference, tokens: list[int]) -> dict[str, float]:
    """How far teacher-forced `logits` are from `reference` (float32's) on
    `tokens`: top-1 agreement over the positions that score a token, this
    path's perplexity, and each row's relative logit error ||l - ref|| / ||ref||
    (mean and worst, with the worst row's position)."""
    import math

    import torch

    targets = torch.tensor(tokens[1:])
    logprobs = torch.log_softmax(logits[:-1].double(), -1)
    nll = -logprobs.gather(1, targets.view(-1, 1)).mean().item()
    agree = (logits[:-1].argmax(-1) == reference[:-1].argmax(-1)).double().mean().item()
    rel = ((logits - reference).double().norm(dim=-1) / reference.double().norm(dim=-1))
    return {
        "top1": agree, "ppl": math.exp(nll), "logit_error": rel.mean().item(),
        "worst_logit_error": rel.max().item(), "worst_row": int(rel.argmax()),
    }


def quantize_mxfp4(weight) -> tuple:
    """weight [..., K] (K a multiple of 32) -> (blocks [..., K/32, 16] uint8,
    scales [..., K/32] uint8): per block of 32 the smallest power of two that
    brings it within FP4's +-6, each value rounded to the nearest FP4 code,
    two codes a byte, the earlier in the low nibble (gpt-oss's layout)."""
    import torch
    from sluice_kernels.moe import FP4_VALUES

    w = weight.float().reshape(*weight.shape[:-1], -1, 32)
    amax = w.abs().amax(-1).clamp(min=2.0**-126)
    exponents = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    lut = torch.tensor(FP4_VALUES)
    scaled = w / torch.exp2(exponents).unsqueeze(-1)
    codes = (scaled.unsqueeze(-1) - lut).abs().argmin(-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponents + 127).to(torch.uint8)


def to_mxfp4_checkpoint(folder: Path) -> Path:
    """Rewrites a saved gpt-oss folder (make_tiny_model "gpt_oss") as the
    released checkpoints are: expert weights as MXFP4 blocks and scales
    (rows not transposed), `quantization_config` naming mxfp4."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(tensors.pop(name).transpose(1, 2).contiguous())
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks.contiguous(), scales.contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                   "lm_head"],
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def add_bpe_vocabulary(writer, tokens: list[str], merges: list[str]) -> None:
    """A byte-level BPE vocabulary in a GGUF's metadata (gguf.GGUFWriter):
    its tokens (the last one end-of-text, also the bos, eos and pad token)
    and merges, as transformers' GGUF reader turns them into a tokenizer."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 1) + [3])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(len(tokens) - 1)
    writer.add_eos_token_id(len(tokens) - 1)
    writer.add_pad_token_id(len(tokens) - 1)
def make_lora_adapter(
    base: Path,
    folder: Path,
    seed: int,
    r: int = 4,
    alpha: float = 8.0,
    target_modules: tuple[str, ...] = ("q_proj", "v_proj"),
    use_rslora: bool = False,
    b_std: float = 0.1,
) -> Path:
    """Saves a LoRA adapter over the model in `base` with peft into `folder`
    (adapter_config.json + adapter_model.safetensors). A and B are random
    (peft starts B at zero, which would change nothing), B with standard
    deviation `b_std`, so the adapter's outputs differ from the base model's.
    The weights depend only on the base, the arguments and `seed`."""
    import peft
    import torch
    import transformers

    model = transformers_model(base, dtype=torch.float32)
    config = peft.LoraConfig(
        r=r, lora_alpha=alpha, target_modules=list(target_modules), use_rslora=use_rslora, lora_dropout=0.0,
        init_lora_weights=False, task_type="CAUSAL_LM",
    )
    adapted = peft.get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_A" in name:
                p.copy_(torch.randn(p.shape, generator=generator) / p.shape[1] ** 0.5)
            elif "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * b_std)
    adapted.save_pretrained(folder)
    return folder


def add_to_hub_cache(folder: Path, cache: Path, repo_id: str, commit: str, refs: tuple[str, ...] = ("main",)) -> Path:
    """Puts the files of `folder` into the Hub cache `cache` the way
    huggingface_hub stores a download, as revision `commit` of `repo_id`
    (and of each ref), so that HF_HUB_OFFLINE=1 finds them; returns the
    snapshot folder:

        <cache>/models--ORG--NAME/blobs/<sha256>                the bytes
        <cache>/models--ORG--NAME/snapshots/<commit>/<file>     -> ../../blobs/<sha256>
        <cache>/models--ORG--NAME/refs/<ref>                    "<commit>"
    """
    import hashlib
    import os

    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for file in sorted(p for p in folder.iterdir() if p.is_file()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).unlink(missing_ok=True)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / file.name)
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot
