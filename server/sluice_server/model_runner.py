"""Runs a step: the batch, the forward pass, prompt logprobs and sampling.

Owns the weights, the LoRA adapter slots (adapters.py), the KV cache and
warmup. `run_step` is the whole step on the model's side; what it returns
(`StepOutput`) is plain data that the shard (servicer.py) commits to its
request table and maps to the reply.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sluice_kernels import cpu_kernels
from sluice_kernels.cpu_matmuls import ALL_ROWS, CpuMatmuls, cpu_flags, native_bf16, plan_cpu_matmuls
from sluice_server import constraints, sampling
from sluice_server.adapters import AdapterSlots
from sluice_server.batch import Batch, RequestState, Work, build_batch
from sluice_server.distributed import SINGLE, Distributed
from sluice_server.kv_cache import KVCache
from sluice_server.layers.backends import get_backend
from sluice_server.gguf_checkpoint import GGUFTensors
from sluice_server.layers.gguf_weights import attach_block_experts, attach_gguf_blocks, attach_gguf_weights
from sluice_server.layers.linear import (
    dense_copy_bytes, free_unread_weights, let_blocks_take_every_step, pack_linear_weights, weight_bytes,
)
from sluice_server.layers.moe import FusedMoE
from sluice_server.models import build_model, load_weights, parameter_counts
from sluice_server.models.llama_cpu_decoder import LlamaCpuDecoder, build_llama_cpu_decoder
from sluice_server.options import KV_CACHE_DTYPES, LORA_DTYPES, ShardOptions
from sluice_server.pb import shard_pb2

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Without --kv-cache-bytes, the CPU shards of one host give their KV caches
# this fraction of MemAvailable at warmup, together (each takes its share):
# the rest stays for activations, the router and the OS.
CPU_KV_FRACTION = 0.30
# On CUDA, the share of the memory free after the warmup peak left unused
# (allocator fragmentation, NCCL buffers, sampling temporaries).
CUDA_KV_MARGIN = 0.10


class KVBudgetError(RuntimeError):
    """The KV cache cannot hold even one request of max_total_tokens."""


class CpuKernelsUnavailable(RuntimeError):
    """--cpu-kernels on, and the C++ CPU kernels cannot be built here."""


class WeightMemoryError(RuntimeError):
    """The model's weights exceed --max-weight-memory with no dense copy of
    a block-served matrix left to drop."""


def use_cpu_kernels(mode: str, device: torch.device) -> bool:
    """Whether this shard runs the C++ CPU kernels (loading them if so)."""
    if device.type != "cpu" or mode == "off":
        return False
    if cpu_kernels.load():  # BuildError where a compiler exists and the build fails
        return True
    if mode == "on":
        raise CpuKernelsUnavailable(
            f"--cpu-kernels on: the C++ CPU kernels cannot be built here: {cpu_kernels.unavailable_reason()}"
        )
    return False


def choose_dtype(requested: str, device: torch.device, config: dict, flags: set[str] | None = None) -> torch.dtype:
    """`auto`: on CUDA the checkpoint's half type (or bfloat16). On CPU
    bfloat16 only where both hold: the processor multiplies bf16 natively, and
    the checkpoint itself is bfloat16, so computing in it changes no weight
    (a float32 checkpoint, such as a converted GGUF, would be rounded).
    Otherwise float32, which is also what the numerics tests compare against.
    """
    if requested != "auto":
        if requested not in DTYPES:
            raise ValueError(f"dtype {requested!r} is not one of auto, {', '.join(DTYPES)}")
        return DTYPES[requested]
    stored = config.get("torch_dtype") or config.get("dtype")
    if device.type == "cpu":
        native = native_bf16(cpu_flags() if flags is None else flags)
        return torch.bfloat16 if native and stored == "bfloat16" else torch.float32
    return DTYPES[stored] if stored in ("bfloat16", "float16") else torch.bfloat16


def choose_kv_dtype(
    dtype: torch.dtype, plan: CpuMatmuls | None, requested: str = "auto", device_type: str = "cpu"
) -> torch.dtype:
    """The KV cache's element type (--kv-cache-dtype `requested`). auto: the
    model's dtype, except on the CPU fast path (`--dtype auto` with int8
    activations on GGUF blocks, a float32 model), which stores K and V as
    bfloat16. Decode attention reads the whole context every step, so its
    time is mostly bytes: bf16 halves them (and doubles the tokens a cache
    budget holds), and the C++ kernel widens each element back to float32
    exactly as it reads it. Like the int8 activations, the rounding is
    measured against float32 by benchmarks/quality.py. float32 or bfloat16
    set it on CPU (to compare the two); a CUDA shard's Triton kernels read
    a cache of the model's dtype only."""
    if requested == "auto":
        if plan is not None and plan.int8 and plan.block_rows > 0 and dtype == torch.float32:
            return torch.bfloat16
        return dtype
    if requested not in DTYPES:
        raise ValueError(f"--kv-cache-dtype {requested!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    if device_type != "cpu" and DTYPES[requested] != dtype:
        model = str(dtype).removeprefix("torch.")
        raise ValueError(
            f"--kv-cache-dtype {requested}: a {device_type} shard keeps its KV cache in the model's dtype "
            f"({model}); other cache dtypes run on CPU only"
        )
    return DTYPES[requested]


def choose_lora_dtype(
    dtype: torch.dtype, plan: CpuMatmuls | None, kernel: str, requested: str = "auto", max_rank: int = 0
) -> torch.dtype:
    """The LoRA adapter stacks' element type (--lora-dtype `requested`) for
    the grouped matmul `kernel` (layers.lora.KERNELS). The C++ kernel
    ("cpu", float32 models only) reads float32 or bfloat16 stacks; auto
    picks bfloat16 on the CPU fast path (`--dtype auto` with int8
    activations on GGUF blocks, as the KV cache's auto does): a decode step
    with adapters there is bound by reading their stacks, bf16 halves those
    bytes, and the base model's arithmetic is already not float32's. On a
    CPU with AVX512-BF16 the kernel multiplies bf16 stacks in bfloat16
    pairs (x and h rounded to bfloat16 too, every sum float32), elsewhere it
    widens each element exactly (sluice_kernels.lora); server/tests/
    test_cpu_decoder.py bounds either against float32 stacks. bf16 stacks
    hold ranks in pairs, so an odd --max-lora-rank (`max_rank`) keeps
    float32 under auto and is refused for bfloat16. Elsewhere
    auto keeps float32, so `--dtype float32` stays the peft oracle's
    arithmetic. The torch and Triton paths keep the model's dtype and refuse
    another one."""
    if requested not in LORA_DTYPES:
        raise ValueError(f"--lora-dtype {requested!r} is not one of {', '.join(LORA_DTYPES)}")
    if kernel == "cpu":
        if requested == "auto":
            fast = plan is not None and plan.int8 and plan.block_rows > 0
            return torch.bfloat16 if fast and max_rank % 2 == 0 else torch.float32
        if requested == "bfloat16" and max_rank % 2:
            raise ValueError(f"--lora-dtype bfloat16 holds ranks in pairs: --max-lora-rank {max_rank} must be even")
        return DTYPES[requested]
    if requested != "auto" and DTYPES[requested] != dtype:
        model = str(dtype).removeprefix("torch.")
        raise ValueError(
            f"--lora-dtype {requested}: the {kernel} LoRA path keeps adapters in the model's dtype ({model}); "
            "other LoRA dtypes run on the C++ CPU kernel only (a CPU shard with the CPU kernels and float32 weights)"
        )
    return dtype


def eos_token_ids(folder: Path, config: dict) -> list[int]:
    """EOS ids from generation_config.json, else config.json (int or list)."""
    for source in (folder / "generation_config.json", None):
        data = json.loads(source.read_text()) if source is not None and source.is_file() else config
        eos = data.get("eos_token_id")
        if eos is not None:
            return [eos] if isinstance(eos, int) else [int(e) for e in eos]
    return []


def available_ram_bytes() -> int:
    """MemAvailable from /proc/meminfo (psutil is not a dependency)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable not found in /proc/meminfo")


def local_world_size(dist: Distributed) -> int:
    """Shards on this host: LOCAL_WORLD_SIZE (the launcher sets it), else
    the whole group (the launcher starts every rank on its own host)."""
    raw = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(raw) if raw.isdigit() and int(raw) > 0 else dist.world_size


def cpu_kv_budget(available: int, shards_on_host: int) -> int:
    """One CPU shard's KV bytes. The shards of a host warm up at once, so
    each sees the same MemAvailable: they split one budget rather than each
    taking the fraction of all of it (3 shards once took 90% of the RAM)."""
    return int(available * CPU_KV_FRACTION) // max(shards_on_host, 1)


@dataclass
class StepOutput:
    """What one step computed, nothing committed yet. Lists are in batch order."""

    # The batch's work items (decodes first): every one advanced to its `end`.
    work: list[Work]
    # Prompt logprobs computed this step, per request that asked for them:
    # (token id, logprob) of the prompt tokens this chunk scored.
    prompt_logprobs: list[tuple[Work, list[tuple[int, float]]]] = field(default_factory=list)
    # The token sampled for every request whose work reached its last token
    # and carried no drafts (a result with `error` set fails that request alone).
    sampled: list[tuple[Work, sampling.SampledToken]] = field(default_factory=list)
    # Requests that carried drafts: the tokens they emit (accepted drafts,
    # then the token drawn after them; see `verify_drafts`), or an error.
    verified: list[tuple[Work, list[sampling.SampledToken] | str]] = field(default_factory=list)
    # Seconds spent building the batch, in the forward pass, and on prompt
    # logprobs + sampling.
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sampling_s: float = 0.0


def verify_drafts(draft: list[int], draws: list[sampling.SampledToken]) -> list[sampling.SampledToken] | str:
    """The tokens a speculating request emits: the longest prefix of `draft`
    that its draws reproduce, then the first draw that differs (or the draw
    after the last draft). draws[i] is the token drawn for position L + i.

        draft   a  b  c        draws  a  b  x  y   ->  emits a b x (2 accepted)
        draft   a  b  c        draws  a  b  c  z   ->  emits a b c z (all + 1)

    Each draw is the one the request would make at that position without
    speculation, so a draft is accepted exactly when the request would have
    produced it: with probability p(draft) for a sampled request (rejection
    sampling against a point-mass proposal), and when it is the argmax for a
    greedy one. A failed draw that is reached fails the request (the error
    message); draws after the first mismatch are never looked at.
    """
    emitted: list[sampling.SampledToken] = []
    for i, draw in enumerate(draws):
        if draw.error is not None:
            return draw.error
        emitted.append(draw)
        if i == len(draft) or draw.token_id != draft[i]:
            break
    return emitted


@dataclass
class WarmupResult:
    num_blocks: int
    kv_cache_bytes: int
    # Later steps may still compile kernels (see WarmupResponse in the proto).
    compilation_pending: bool
    lora_bytes: int = 0


class ModelRunner:
    def __init__(
        self,
        model_dir: Path | str,
        *,
        dtype: str = "auto",
        device: str = "cpu",
        block_size: int = 16,
        dist: Distributed = SINGLE,
        attention_backend: str = "auto",
        pack_weights: bool = True,
        options: ShardOptions = ShardOptions(),
        max_loras: int = 0,
        max_lora_rank: int = 64,
        lora_roots: list[Path | str] = (),
    ):
        self.model_dir = Path(model_dir)
        config_path = self.model_dir / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"{config_path} not found: is {self.model_dir} a model folder?")
        self.config = json.loads(config_path.read_text())
        self.device = torch.device(device)
        self.dtype = choose_dtype(dtype, self.device, self.config)
        self.cpu_matmuls: CpuMatmuls | None = None
        # Decode steps in one C++ call (models.llama_cpu_decoder), where it applies.
        self.cpu_decoder: LlamaCpuDecoder | None = None
        self.block_size = block_size
        # The layers read the expert layout from the group they run in.
        self.dist = dist = dataclasses.replace(dist, expert_parallel=options.expert_parallel)
        self.options = options
        # The C++ CPU kernels in use: attention, small ops, GGUF block
        # matmuls, the decoder; their instruction-set path ("none": unused).
        self.uses_cpu_kernels = use_cpu_kernels(options.cpu_kernels, self.device)
        self.cpu_kernels_isa = cpu_kernels.isa_path() if self.uses_cpu_kernels else "none"
        self.backend = get_backend(self.device, attention_backend, cpu_kernels=self.uses_cpu_kernels)
        self.model = build_model(self.config, dist, self.backend, self.dtype, self.device)
        plan = blocks = on_loaded = None
        if self.device.type == "cpu" and pack_weights:
            plan = plan_cpu_matmuls(dtype, self.dtype, cpu_flags(), self.options.cpu_block_rows)
            blocks = self._attach_gguf_blocks(plan)
            if blocks is not None:  # blocks attached already: each weight is packed as soon as it is loaded
                plan = self._fit_weight_limit(self._plan_with_blocks(plan, blocks))
                on_loaded = self._pack_when_loaded(plan.dense_dtype)
        else:
            self._fit_weight_limit(None)  # no packing: the weights as allocated are those held
        load_weights(self.model, self.model_dir, skip=self._emptied_parameters(), on_loaded=on_loaded)
        if plan is not None:
            self.cpu_matmuls = self._prepare_cpu_weights(plan, blocks)
            if self.cpu_matmuls.block_rows > 0:
                self.cpu_decoder = build_llama_cpu_decoder(self.model)
        self.kv_dtype = choose_kv_dtype(self.dtype, self.cpu_matmuls, options.kv_cache_dtype, self.device.type)
        # Bytes of this rank's weights in memory, every form counted.
        self.weight_bytes = weight_bytes(self.model)
        # Of those, the dense forms of block-served matrices (0: each held once, as blocks).
        self.dense_copy_bytes = dense_copy_bytes(self.model)
        cfg = self.model.config
        self.model_type: str = cfg.model_type
        self.vocab_size: int = cfg.vocab_size
        self.max_position_embeddings: int = cfg.max_position_embeddings
        self.eos_token_ids = eos_token_ids(self.model_dir, self.config)
        self.num_layers = cfg.num_hidden_layers
        # This rank's key/value heads (replicated ones count: each rank caches its own).
        self.num_kv_heads = self.model.num_local_kv_heads
        self.head_dim = cfg.head_dim
        self.total_parameters, self.active_parameters = parameter_counts(self.model_dir, cfg)
        # Whether this rank holds whole experts (--expert-parallel over shards).
        self.expert_parallel = any(getattr(m, "expert_parallel", False) for m in self.model.modules()
                                   if isinstance(m, FusedMoE))
        log.info("parameters: %s total, %s active per token", f"{self.total_parameters:,}",
                 f"{self.active_parameters:,}")
        self.kv_cache: KVCache | None = None
        # Allocated at warmup, beside the KV cache, in this dtype.
        self.adapters = AdapterSlots(self.model, max_loras, max_lora_rank, list(lora_roots))
        self.lora_dtype = choose_lora_dtype(self.dtype, self.cpu_matmuls, self.lora_kernel(), options.lora_dtype,
                                            max_lora_rank)

    def _attach_gguf_blocks(self, plan: CpuMatmuls) -> int | None:
        """For a folder whose block-served matrices stay in the .gguf
        (gguf_checkpoint.py), attaches their blocks before any weight is
        loaded, and empties the dense weights nothing will read (the blocks
        take every step), so those are never written (build_model's
        torch.empty reserved their address space only: no page of theirs is
        ever touched, so none is resident); returns how many
        layers got blocks, or None for a folder of float32 weights (attached
        after loading, by content: `_prepare_cpu_weights`)."""
        tensors = GGUFTensors.of_folder(self.model_dir)
        if tensors is None:
            return None
        if not self.uses_cpu_kernels:
            return 0
        blocks = attach_gguf_blocks(
            self.model, tensors, self.dist.world_size, int8=plan.int8, max_rows=plan.block_rows
        )
        free_unread_weights(self.model)
        return blocks

    def _pack_when_loaded(self, dtype: torch.dtype):
        """load_weights' `on_loaded`: packs a linear layer's weight for oneDNN
        (in `dtype`, freeing its float32 form) as soon as it is loaded, so a
        plan that keeps dense weights (`--dtype float32`'s large steps, bf16
        above a row limit) never holds the whole model in float32 first."""
        modules = dict(self.model.named_modules())

        def loaded(name: str) -> None:
            module = modules.get(name.rpartition(".")[0])
            if name.endswith(".weight") and hasattr(module, "pack_for_cpu_"):
                module.pack_for_cpu_(dtype)

        return loaded

    def _emptied_parameters(self) -> frozenset[str]:
        """Parameters emptied before loading (`_attach_gguf_blocks`): not loaded."""
        return frozenset(n for n, p in self.model.named_parameters(remove_duplicate=False) if p.numel() == 0)

    def _plan_with_blocks(self, plan: CpuMatmuls, blocks: int) -> CpuMatmuls:
        """The plan that holds once `blocks` layers got GGUF blocks (none:
        dense only), its dense dtype named (None meant the model's)."""
        if not blocks:
            plan = CpuMatmuls(int8=False, block_rows=0, dense_dtype=None)
        return dataclasses.replace(plan, dense_dtype=plan.dense_dtype or self.dtype)

    def _fit_weight_limit(self, plan: CpuMatmuls | None) -> CpuMatmuls | None:
        """The plan under which this rank's weights fit --max-weight-memory
        (`plan` None: a shard that packs nothing). Decided from the layers'
        shapes and the blocks already attached, before any dense form of a
        block-served matrix is packed (or, for a folder whose blocks stay in
        the .gguf, loaded): `plan` itself, or, where its dense copies for
        steps above the blocks' row limit would cross the limit, the same
        plan with every step on the blocks and those copies never made.
        Raises WeightMemoryError where the weights exceed the limit even so."""
        limit = self.options.max_weight_memory
        if limit is None:
            return plan
        packed_in = plan.dense_dtype if plan is not None else None
        total = weight_bytes(self.model, packed_in)
        copies = dense_copy_bytes(self.model, packed_in)
        if total > limit and copies:
            let_blocks_take_every_step(self.model)
            free_unread_weights(self.model)
            plan = dataclasses.replace(plan, block_rows=ALL_ROWS)
            log.info(
                "--max-weight-memory %.1f MiB: dropped the plan's dense copies of GGUF-block matrices, which "
                "would take the weights to %.1f MiB (%.1f MiB saved); every step runs on the blocks",
                limit / 2**20, total / 2**20, copies / 2**20,
            )
            total = weight_bytes(self.model, packed_in)
        if total > limit:
            blocks = any(getattr(m, "quantized", None) is not None for m in self.model.modules())
            raise WeightMemoryError(
                f"the model's weights take {total} bytes ({total / 2**20:.1f} MiB) on this shard"
                f"{' with no dense copy of a block-served matrix' if blocks else ''}, more than "
                f"--max-weight-memory {limit} bytes ({limit / 2**20:.1f} MiB)"
            )
        return plan

    def _prepare_cpu_weights(self, plan: CpuMatmuls, blocks: int | None) -> CpuMatmuls:
        """Attaches the GGUF blocks (unless `_attach_gguf_blocks` did:
        `blocks` is then how many it attached, and `plan` the one that holds
        with them) and packs the dense weights as the plan says
        (sluice_kernels.cpu_matmuls); returns the plan that holds."""
        if blocks is None:
            blocks = 0
            if self.uses_cpu_kernels:  # the block matmuls are C++ kernels
                blocks = attach_gguf_weights(
                    self.model, self.model_dir, self.dist.world_size, int8=plan.int8, max_rows=plan.block_rows
                ) + attach_block_experts(self.model, int8=plan.int8, max_rows=plan.block_rows)
            plan = self._fit_weight_limit(self._plan_with_blocks(plan, blocks))
        pack_linear_weights(self.model, plan.dense_dtype)  # those not packed as they loaded
        packed = sum(getattr(m, "packed", None) is not None for m in self.model.modules())
        freed = free_unread_weights(self.model)  # each matrix once per kind of step
        log.info(
            "CPU matmuls: %s; %d run GGUF blocks, %d packed dense, %d dense weights freed",
            plan.describe(), blocks, packed, freed,
        )
        return plan

    # -- KV cache -----------------------------------------------------------

    def bytes_per_block(self) -> int:
        return KVCache.bytes_per_block(
            self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.kv_dtype
        )

    def new_kv_cache(self, num_blocks: int) -> KVCache:
        return KVCache(
            self.num_layers, num_blocks, self.block_size, self.num_kv_heads, self.head_dim, self.kv_dtype, self.device
        )

    def allocate_kv_cache(self, num_blocks: int) -> KVCache:
        self.kv_cache = None  # free the old one first
        self.kv_cache = self.new_kv_cache(num_blocks)
        return self.kv_cache

    # -- forward ------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, batch: Batch, kv_cache: KVCache | None = None) -> torch.Tensor:
        """Runs the batch, writing its KV into the cache; returns the logits of
        batch.logits_indices, [N, vocab] float32 (on CPU)."""
        cache = kv_cache or self.kv_cache
        if cache is None:
            raise RuntimeError("KV cache not allocated: call warmup first")
        if self.decoder_takes(batch):
            hidden = self._decode_on_cpu_decoder(batch, cache)
        else:
            self.backend.prepare(batch.attn)
            with self.adapters.applied(batch.lora):
                hidden = self.model(batch.input_ids, batch.positions, cache.layers, batch.attn)
        if batch.logits_indices.numel() == 0:
            return torch.empty(0, self.vocab_size)
        return self.model.compute_logits(hidden[batch.logits_indices]).cpu()

    def lora_kernel(self) -> str:
        """Which grouped matmul applies LoRA adapters (layers.lora): Triton's
        with the triton backend, the C++ one on CPU in float32 where the CPU
        kernels are loaded, else plain torch."""
        if self.backend.name == "triton":
            return "triton"
        if self.device.type == "cpu" and self.dtype == torch.float32 and getattr(self.backend, "cpu_kernels", False):
            return "cpu"
        return "torch"

    def decoder_takes(self, batch: Batch) -> bool:
        """Whether the C++ decoder runs this step: at most its row limit, and
        every work item computes one token of its own (a decode, perhaps
        followed by draft tokens to verify); prefill chunks and mixed steps
        run the model's forward, as do steps with LoRA adapter rows while the
        decoder has no LoRA stacks."""
        if self.cpu_decoder is None or (batch.lora is not None and self.cpu_decoder.lora_scales is None):
            return False
        tokens = batch.input_ids.numel()
        if not 0 < tokens <= self.cpu_decoder.max_rows:
            return False
        return batch.attn.num_decodes == tokens or all(w.num_new_tokens == 1 for w in batch.work)

    def _decode_on_cpu_decoder(self, batch: Batch, cache: KVCache) -> torch.Tensor:
        """The step as the decoder's rows: with drafts, every token is a
        decode row of its sequence that sees the cache up to its own position.

            work     seq 0: token + 2 drafts        seq 1: token
            rows     r0  r1  r2                     r3
            tables   bt[0] bt[0] bt[0]              bt[1]
            seq_lens p0+1 p0+2 p0+3                 p1+1      (positions + 1)
        """
        meta = batch.attn
        block_tables, seq_lens = meta.block_tables, meta.seq_lens
        if meta.num_decodes != batch.input_ids.numel():
            rows = torch.repeat_interleave(
                torch.arange(len(meta.query_lens_list)), torch.tensor(meta.query_lens_list)
            )
            block_tables, seq_lens = block_tables[rows], batch.positions + 1
        return self.cpu_decoder.forward(
            batch.input_ids, batch.positions, meta.slot_mapping, block_tables, seq_lens, cache.layers, batch.lora
        )

    def build_batch(self, work: list[Work]) -> Batch:
        return build_batch(work, self.block_size, self.device)

    # -- a whole step -------------------------------------------------------

    def run_step(self, work: list[Work], constrained: bool = False) -> StepOutput:
        """Builds the batch, runs the forward pass, then computes the prompt
        logprobs and samples. Request state is read, never changed.

        constrained: some request of `work` may have a grammar; when False no
        row is even looked at for one."""
        t0 = time.perf_counter()
        batch = self.build_batch(work)
        t1 = time.perf_counter()
        logits = self.execute(batch)
        t2 = time.perf_counter()
        sampled, verified = self._sample(batch, logits, constrained)
        output = StepOutput(
            work=batch.work,
            prompt_logprobs=self._prompt_logprobs(batch, logits),
            sampled=sampled,
            verified=verified,
        )
        output.prepare_s, output.forward_s, output.sampling_s = t1 - t0, t2 - t1, time.perf_counter() - t2
        return output

    def _prompt_logprobs(self, batch: Batch, logits: torch.Tensor) -> list[tuple[Work, list[tuple[int, float]]]]:
        """Logits row p (position p) scores prompt token p + 1:

            positions:  start ............ end-1      (this chunk)
            scores:     token start+1 ..... token end  (kept while < num_prompt_tokens)
        """
        rows: list[int] = []
        targets: list[int] = []
        owners: list[tuple[Work, int, int]] = []
        for w, (first, _) in zip(batch.work, batch.logits_rows):
            if not w.wants_prompt_logprobs:
                continue
            last = min(w.end, w.state.num_prompt_tokens - 1)  # positions [start, last) score a prompt token
            owners.append((w, len(rows), last - w.start))
            rows.extend(range(first, first + last - w.start))
            targets.extend(w.state.token_ids[w.start + 1 : last + 1])
        if not rows:
            return []
        values = sampling.token_logprobs(logits[rows], torch.tensor(targets)).tolist()
        scored = []
        for w, offset, count in owners:
            tokens = w.state.token_ids[w.start + 1 : w.start + 1 + count]
            scored.append((w, list(zip(tokens, values[offset : offset + count]))))
        return scored

    def _sample(
        self, batch: Batch, logits: torch.Tensor, constrained: bool = False
    ) -> tuple[list[tuple[Work, sampling.SampledToken]], list[tuple[Work, list[sampling.SampledToken] | str]]]:
        """One draw per logits row of every sampling request, all in one
        `sampling.sample` call: a request with K drafts has K + 1 rows, row i
        drawn as if drafts [0, i) had been generated (its penalties,
        min_tokens and seed position follow). Returns (plain requests' tokens,
        speculating requests' emitted tokens)."""
        owners: list[tuple[Work, int]] = []  # (work, its first row in `rows`)
        picked: list[int] = []
        rows: list[sampling.SamplingRow] = []
        for w, (first, count) in zip(batch.work, batch.logits_rows):
            if not w.samples:
                continue
            owners.append((w, len(rows)))
            if not w.draft:
                picked.append(first + count - 1)
                rows.append(
                    sampling.SamplingRow(w.state.params, w.state.token_ids, w.state.num_prompt_tokens, w.state.logit_bias)
                )
                continue
            for i in range(len(w.draft) + 1):
                picked.append(first + i)
                rows.append(
                    sampling.SamplingRow(
                        w.state.params, w.state.token_ids + w.draft[:i], w.state.num_prompt_tokens, w.state.logit_bias
                    )
                )
        if not rows:
            return [], []
        # A decode step picks every row in order: no copy of [rows, vocab]
        # then (0.6 ms at 32 rows), unless grammar masks are written into it.
        identity = not constrained and picked == list(range(logits.shape[0]))
        chosen = logits if identity else logits[picked]
        if constrained:
            # On CUDA the forward pass may still be running: the masks are
            # computed on the CPU meanwhile, only their application waits.
            # (Constrained requests never carry drafts: one row each.)
            masked = [(first, w.state.grammar) for w, first in owners if w.state.grammar is not None]
            constraints.mask_logits(chosen, [i for i, _ in masked], [g for _, g in masked])
        try:
            results = sampling.sample(chosen, rows, self.eos_token_ids)
        except Exception:
            # Find the row(s) at fault so only their requests fail.
            log.exception("batched sampling failed; sampling rows one by one")
            results = [self._sample_one(chosen[i : i + 1], row) for i, row in enumerate(rows)]
        sampled, verified = [], []
        for w, first in owners:
            if w.draft:
                verified.append((w, verify_drafts(w.draft, results[first : first + len(w.draft) + 1])))
            else:
                sampled.append((w, results[first]))
        return sampled, verified

    def _sample_one(self, logits: torch.Tensor, row: sampling.SamplingRow) -> sampling.SampledToken:
        try:
            return sampling.sample(logits, [row], self.eos_token_ids)[0]
        except Exception as e:  # noqa: BLE001 - any failure here belongs to this request
            return sampling.SampledToken(0, math.nan, [], error=f"sampling failed: {e}")

    # -- warmup -------------------------------------------------------------

    def warmup(
        self, max_batch_prefill_tokens: int, max_batch_size: int, max_total_tokens: int, kv_cache_bytes: int | None
    ) -> WarmupResult:
        """Allocates the adapter slots, runs the largest step the router may
        send, then sizes the KV cache from the memory left.

        The dummy step prefills max_batch_prefill_tokens tokens, split into
        sequences of at most max_total_tokens, with logits for every token (the
        prompt_logprobs worst case), in a temporary cache just big enough;
        with adapters on, its sequences use every slot at the highest rank.
        The weights (every expert's, for mixtures of experts) are loaded
        before, so the budget is what is left beside them; an expert layer's
        activations are T x top_k rows however its tokens are routed, so the
        dummy step's routing (every token alike) is its worst case too.
        """
        if min(max_batch_prefill_tokens, max_batch_size, max_total_tokens) == 0:
            raise ValueError("warmup limits must all be > 0")
        self.kv_cache = None
        lora_bytes = self.adapters.allocate(self.lora_kernel(), self.lora_dtype)
        if self.cpu_decoder is not None and self.adapters.enabled:
            self.cpu_decoder.attach_lora()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        with self.adapters.at_full_rank():
            self._dummy_step(max_batch_prefill_tokens, max_total_tokens)
        per_block = self.bytes_per_block()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
            torch.cuda.empty_cache()
            free, _ = torch.cuda.mem_get_info()
            budget = int(free * (1 - CUDA_KV_MARGIN)) - peak
        elif kv_cache_bytes:
            budget = kv_cache_bytes
        else:
            budget = cpu_kv_budget(available_ram_bytes(), local_world_size(self.dist))
        # Every rank holds the same block ids, so all use the smallest count.
        num_blocks = self.dist.min_over_ranks(max(budget, 0) // per_block)
        needed = -(-max_total_tokens // self.block_size)
        if num_blocks < needed:
            raise KVBudgetError(
                f"KV cache budget of {budget} bytes gives {num_blocks} blocks, but one request of "
                f"max_total_tokens={max_total_tokens} needs {needed}"
            )
        cache = self.allocate_kv_cache(num_blocks)
        log.info(
            "KV cache: %d blocks of %d tokens, %s (%.1f MiB)",
            num_blocks, self.block_size, str(self.kv_dtype).removeprefix("torch."), cache.nbytes / 2**20,
        )
        if self.adapters.enabled:
            log.info(
                "LoRA: %d adapter slots of rank <= %d (%.1f MiB, %s), applied by the %s grouped matmul",
                self.adapters.max_loras, self.adapters.max_rank, lora_bytes / 2**20,
                str(self.lora_dtype).removeprefix("torch."), self.lora_kernel(),
            )
        return WarmupResult(
            num_blocks=num_blocks, kv_cache_bytes=cache.nbytes, compilation_pending=self.backend.compiles_lazily,
            lora_bytes=lora_bytes,
        )

    def forward_probe(self) -> None:
        """One token through the whole model in a one-block scratch cache."""
        state = RequestState(
            id=0, token_ids=[0], num_prompt_tokens=1, num_computed_tokens=0,
            block_ids=[0], params=shard_pb2.SamplingParams(),
        )
        logits = self.execute(self.build_batch([Work(state, 0, 1, [0])]), self.new_kv_cache(1))
        if not torch.isfinite(logits).all():
            raise RuntimeError("health probe: the model produced non-finite logits")

    def _dummy_step(self, num_tokens: int, max_seq_len: int) -> None:
        work: list[Work] = []
        next_block = 0
        remaining = num_tokens
        while remaining > 0:
            n = min(remaining, max_seq_len)
            blocks = list(range(next_block, next_block + -(-n // self.block_size)))
            next_block += len(blocks)
            slot = len(work) % self.adapters.max_loras + 1 if self.adapters.enabled else 0
            state = RequestState(
                id=len(work), token_ids=[0] * n, num_prompt_tokens=n, num_computed_tokens=0,
                block_ids=blocks, params=shard_pb2.SamplingParams(), prompt_logprobs=[], adapter_slot=slot,
            )
            work.append(Work(state, 0, n, blocks))
            remaining -= n
        self.execute(self.build_batch(work), self.new_kv_cache(next_block))
