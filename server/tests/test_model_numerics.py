"""The shard's model against transformers, fp32, on tiny random models: the
same logits however a sequence is split into steps and batched."""

from __future__ import annotations

import pytest
import torch

from sluice_kernels import cpu_kernels
from sluice_kernels.cpu_matmuls import ALL_ROWS, CpuMatmuls, plan_cpu_matmuls
from sluice_server.model_runner import ModelRunner, choose_dtype, choose_kv_dtype, choose_lora_dtype
from sluice_server.models import model_class

from conftest import Driver, make_tiny_model, reference_logits

ATOL = 1e-4
KINDS = ["llama", "qwen2", "tied", "mha", "llama3", "mistral", "qwen3", "gemma3", "phi3", "yarn", "qwen3_moe", "mixtral",
         "gpt_oss", "qwen2_moe"]


def prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (length,), generator=g).tolist()


@pytest.fixture(scope="module", params=KINDS)
def model(request, tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp(request.param), request.param, seed=KINDS.index(request.param))
    return folder, ModelRunner(folder, dtype="float32", block_size=4)


def check(driver: Driver, folder, rid: int, tokens: list[int], start: int = 0) -> None:
    want = reference_logits(folder, tokens)[start:]
    got = driver.computed(rid, start, len(tokens))
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_whole_sequence_at_once(model):
    folder, runner = model
    d = Driver(runner)
    tokens = prompt(37, 1)
    d.step([(d.request(1, tokens), 37)])
    check(d, folder, 1, tokens)


def test_prefill_then_decodes(model):
    folder, runner = model
    d = Driver(runner)
    tokens = prompt(30, 2)
    r = d.request(1, tokens)
    d.step([(r, 25)])
    for _ in range(5):
        d.step([(r, 1)])
    check(d, folder, 1, tokens)


def test_chunked_prefill(model):
    folder, runner = model
    d = Driver(runner)
    tokens = prompt(41, 3)
    r = d.request(1, tokens)
    for n in (5, 7, 1, 16, 12):  # chunk edges inside and on block boundaries
        d.step([(r, n)])
    check(d, folder, 1, tokens)


@pytest.mark.parametrize("cached", [8, 11])
def test_cached_prefix(model, cached):
    """A second request reuses the blocks filled by the first for its first
    `cached` tokens (block-aligned, and mid-block as after a chunk)."""
    folder, runner = model
    d = Driver(runner)
    tokens = prompt(29, 4)
    first = d.request(1, tokens)
    d.step([(first, 29)])
    second = d.request(2, tokens, num_computed=cached, block_ids=first.block_ids)
    d.step([(second, 29 - cached)])
    check(d, folder, 2, tokens, start=cached)


def test_mixed_batch(model):
    """Requests at different stages share steps: decodes, prefill chunks, a
    cached-prefix request and a fresh prompt."""
    folder, runner = model
    d = Driver(runner)
    seqs = {i: prompt(n, 10 + i) for i, n in enumerate([23, 31, 18, 27, 9], start=1)}
    a = d.request(1, seqs[1])
    b = d.request(2, seqs[2])
    d.step([(a, 20), (b, 6)])
    prefix_owner = d.request(3, seqs[3])
    d.step([(a, 1), (b, 10), (prefix_owner, 18)])
    # Shares request 3's first 3 blocks (12 tokens), then its own 4 blocks.
    own_blocks = [d.free.pop() for _ in range(4)]
    c = d.request(4, seqs[3][:12] + seqs[4][12:], num_computed=12, block_ids=prefix_owner.block_ids[:3] + own_blocks)
    e = d.request(5, seqs[5])
    d.step([(a, 1), (b, 15), (c, 5), (e, 9)])
    d.step([(a, 1), (c, 9)])
    d.step([(c, 1)])
    check(d, folder, 1, seqs[1])
    check(d, folder, 2, seqs[2])
    check(d, folder, 3, seqs[3])
    check(d, folder, 4, c.token_ids, start=12)
    check(d, folder, 5, seqs[5])


def test_unsupported_model_type_names_supported():
    with pytest.raises(
        ValueError, match="supported: gemma3_text, gpt_oss, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3, "
                          "qwen3_moe"
    ):
        model_class("gpt2")


# --- the real bundled model ---------------------------------------------------

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "<|im_start|>user\nWhat is the boiling point of water?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]
NEW_TOKENS = 32


def shard_greedy(runner: ModelRunner, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy tokens through the servicer's Step logic, all prompts in one batch
    (prefill together, then decode together)."""
    from sluice_server.pb import shard_pb2
    from sluice_server.servicer import Shard

    shard = Shard(runner, urls=[])
    blocks_each = -(-(max(map(len, prompts)) + n) // runner.block_size)
    runner.allocate_kv_cache(blocks_each * len(prompts))
    new = [
        shard_pb2.NewRequest(
            id=i, token_ids=p, num_prompt_tokens=len(p), num_new_tokens=len(p),
            block_ids=range(i * blocks_each, (i + 1) * blocks_each), params=shard_pb2.SamplingParams(),
        )
        for i, p in enumerate(prompts)
    ]
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    step = shard_pb2.StepRequest(new_requests=new)
    for _ in range(n):
        response = shard.step(step)
        assert not response.errors
        for g in response.generations:
            out[g.id].append(g.token_id)
        step = shard_pb2.StepRequest(scheduled=[shard_pb2.ScheduledRequest(id=i, num_new_tokens=1) for i in out])
    return [out[i] for i in range(len(prompts))]


def transformers_greedy(folder, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers' generate, greedy, exactly n tokens per prompt (EOS ignored), one prompt at a time."""
    from sluice_server.testing import transformers_model

    reference = transformers_model(folder, dtype=torch.float32)
    with torch.no_grad():
        return [
            reference.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
            for p in prompts
        ]


def test_smollm2_greedy_matches_transformers(smollm2_dir):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    prompts = [tokenizer.encode(p, add_special_tokens=False).ids for p in PROMPTS]
    want = transformers_greedy(smollm2_dir, prompts, NEW_TOKENS)

    # The exact path (--dtype float32): the default fast one (int8 activations)
    # is measured against it by benchmarks/quality.py, not token for token.
    runner = ModelRunner(smollm2_dir, dtype="float32", block_size=16)
    assert runner.dtype == torch.float32 and runner.vocab_size == 49152
    # The decodes below (<= 4 rows) run on the GGUF's Q4_1/Q8_0 blocks (each
    # expanded to exactly the float32 weight) where
    # the CPU kernels can be built (load() raises where a build fails), prefill
    # on the float32 weights.
    if cpu_kernels.load():
        assert runner.model.lm_head.quantized is not None
        assert all(layer.mlp.down_proj.quantized is not None for layer in runner.model.model.layers)
    batched = shard_greedy(runner, prompts, NEW_TOKENS)
    alone = [shard_greedy(runner, [p], NEW_TOKENS)[0] for p in prompts]
    for i, text in enumerate(PROMPTS):
        assert alone[i] == want[i], f"prompt {i} ({text!r}) alone"
        assert batched[i] == want[i], f"prompt {i} ({text!r}) batched"


# --- dtype choice -----------------------------------------------------------

@pytest.mark.parametrize(
    "device,stored,flags,want",
    [
        ("cpu", "bfloat16", {"avx2", "fma"}, torch.float32),  # no native bf16 (this machine)
        ("cpu", "bfloat16", {"avx2", "avx512_bf16"}, torch.bfloat16),
        ("cpu", "bfloat16", {"amx_bf16"}, torch.bfloat16),
        ("cpu", "float32", {"amx_bf16"}, torch.float32),  # a bf16 copy would round the weights
        ("cpu", None, {"avx512_bf16"}, torch.float32),
        ("cuda", "float16", set(), torch.float16),
        ("cuda", "float32", set(), torch.bfloat16),
    ],
)
def test_auto_dtype(device, stored, flags, want):
    config = {"torch_dtype": stored} if stored else {}
    assert choose_dtype("auto", torch.device(device), config, flags) == want
    assert choose_dtype("float16", torch.device(device), config, flags) == torch.float16


INT8_PLAN = CpuMatmuls(int8=True, block_rows=64, dense_dtype=torch.bfloat16)
EXACT_PLAN = CpuMatmuls(int8=False, block_rows=16, dense_dtype=None)
NO_BLOCKS = CpuMatmuls(int8=False, block_rows=0, dense_dtype=None)


VNNI = {"avx2", "avx512f", "avx512_vnni"}


@pytest.mark.parametrize(
    "requested,dtype,flags,block_rows,want",
    [
        # --dtype auto on a float32 model: int8 blocks, up to the host's limit.
        ("auto", torch.float32, {"avx2"}, None, CpuMatmuls(True, ALL_ROWS, None)),
        ("auto", torch.float32, VNNI, None, CpuMatmuls(True, ALL_ROWS, None)),
        ("auto", torch.float32, VNNI | {"avx512_bf16"}, None, CpuMatmuls(True, ALL_ROWS, torch.bfloat16)),
        ("auto", torch.float32, VNNI | {"avx512_bf16", "amx_bf16", "amx_int8"}, None, INT8_PLAN),
        # --cpu-block-rows replaces the limit of either block path.
        ("auto", torch.float32, VNNI, 32, CpuMatmuls(True, 32, None)),
        ("auto", torch.float32, VNNI, 0, CpuMatmuls(True, 0, None)),
        ("float32", torch.float32, VNNI, 4, CpuMatmuls(False, 4, None)),
        # Exact blocks for --dtype float32; none for a reduced-precision model,
        # whatever --cpu-block-rows says.
        ("float32", torch.float32, VNNI, None, EXACT_PLAN),
        ("auto", torch.bfloat16, VNNI | {"avx512_bf16"}, None, NO_BLOCKS),
        ("bfloat16", torch.bfloat16, VNNI, 64, NO_BLOCKS),
    ],
)
def test_cpu_matmul_plan(requested, dtype, flags, block_rows, want):
    assert plan_cpu_matmuls(requested, dtype, flags, block_rows) == want


def test_cpu_matmul_plan_says_where_the_blocks_stop():
    assert INT8_PLAN.describe() == "int8 activations on GGUF blocks for steps of <= 64 rows, dense bfloat16 (oneDNN) above"
    assert CpuMatmuls(True, ALL_ROWS, None).describe() == "int8 activations on GGUF blocks for every step"


@pytest.mark.parametrize(
    "dtype,plan,requested,device,want",
    [
        (torch.float32, INT8_PLAN, "auto", "cpu", torch.bfloat16),  # --dtype auto on GGUF blocks
        (torch.float32, EXACT_PLAN, "auto", "cpu", torch.float32),  # --dtype float32: exact
        (torch.float32, NO_BLOCKS, "auto", "cpu", torch.float32),  # no GGUF blocks: the float32 model as it is
        (torch.bfloat16, NO_BLOCKS, "auto", "cpu", torch.bfloat16),
        (torch.float32, None, "auto", "cpu", torch.float32),  # unpacked weights
        (torch.float16, None, "auto", "cuda", torch.float16),
        # --kv-cache-dtype: any of the two on CPU; on CUDA only the model's.
        (torch.float32, INT8_PLAN, "float32", "cpu", torch.float32),
        (torch.float32, EXACT_PLAN, "bfloat16", "cpu", torch.bfloat16),
        (torch.bfloat16, NO_BLOCKS, "float32", "cpu", torch.float32),
        (torch.bfloat16, None, "bfloat16", "cuda", torch.bfloat16),
    ],
)
def test_kv_cache_dtype(dtype, plan, requested, device, want):
    assert choose_kv_dtype(dtype, plan, requested, device) == want


def test_kv_cache_dtype_refusals_name_the_choices():
    with pytest.raises(ValueError, match="--kv-cache-dtype 'fp8' is not one of auto, float32, bfloat16"):
        choose_kv_dtype(torch.float32, INT8_PLAN, "fp8")
    with pytest.raises(ValueError, match=r"--kv-cache-dtype bfloat16: a cuda shard keeps its KV cache in the model's dtype \(float16\)"):
        choose_kv_dtype(torch.float16, None, "bfloat16", "cuda")


@pytest.mark.parametrize(
    "dtype,plan,kernel,requested,want",
    [
        (torch.float32, INT8_PLAN, "cpu", "auto", torch.bfloat16),  # --dtype auto on GGUF blocks
        (torch.float32, CpuMatmuls(True, ALL_ROWS, None), "cpu", "auto", torch.bfloat16),
        (torch.float32, EXACT_PLAN, "cpu", "auto", torch.float32),  # --dtype float32: peft's arithmetic
        (torch.float32, NO_BLOCKS, "cpu", "auto", torch.float32),
        (torch.float32, None, "cpu", "auto", torch.float32),
        (torch.bfloat16, NO_BLOCKS, "torch", "auto", torch.bfloat16),  # the other paths: the model's dtype
        (torch.float16, None, "triton", "auto", torch.float16),
        # --lora-dtype: either on the C++ kernel, the model's elsewhere.
        (torch.float32, INT8_PLAN, "cpu", "float32", torch.float32),
        (torch.float32, EXACT_PLAN, "cpu", "bfloat16", torch.bfloat16),
        (torch.bfloat16, None, "triton", "bfloat16", torch.bfloat16),
    ],
)
def test_lora_dtype(dtype, plan, kernel, requested, want):
    assert choose_lora_dtype(dtype, plan, kernel, requested) == want


def test_lora_dtype_odd_ranks_keep_float32_stacks():
    """bfloat16 stacks hold ranks in pairs: an odd --max-lora-rank keeps
    float32 under auto, and bfloat16 is refused naming the rank."""
    assert choose_lora_dtype(torch.float32, INT8_PLAN, "cpu", "auto", 7) == torch.float32
    assert choose_lora_dtype(torch.float32, INT8_PLAN, "cpu", "auto", 8) == torch.bfloat16
    with pytest.raises(ValueError, match="--max-lora-rank 7 must be even"):
        choose_lora_dtype(torch.float32, INT8_PLAN, "cpu", "bfloat16", 7)


def test_lora_dtype_refusals_name_the_choices():
    with pytest.raises(ValueError, match="--lora-dtype 'fp8' is not one of auto, float32, bfloat16"):
        choose_lora_dtype(torch.float32, INT8_PLAN, "cpu", "fp8")
    with pytest.raises(ValueError, match=r"--lora-dtype bfloat16: the torch LoRA path keeps adapters in the "
                                         r"model's dtype \(float32\)"):
        choose_lora_dtype(torch.float32, None, "torch", "bfloat16")


def test_unknown_dtype_names_the_choices():
    with pytest.raises(ValueError, match="not one of auto, float32, bfloat16, float16"):
        choose_dtype("int4", torch.device("cpu"), {})
