"""The mixture-of-experts MLP: a router picks k of E expert MLPs per token.

    logits = x W_router^T (+ b)                            [T, E]
    weights, ids = top-k of the routing (per family, below) [T, k]
    y[t] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t])
    expert_e(x) = down_e(act(gate_e(x), up_e(x))) (+ biases)

Routing, as each family's transformers model computes it:

    softmax_topk   p = softmax(logits) in float32, keep the k largest;
                   renormalize: divide them by their sum      (Qwen3-MoE with
                   norm_topk_prob, Mixtral always)
    topk_softmax   keep the k largest logits, softmax over them (gpt-oss)

A family may add a shared expert (Qwen2-MoE): a dense MLP every token
goes through, its output scaled per token by sigmoid(x w_gate^T) when the
family gates it, and added to the routed experts' sum:

    y[t] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t])
           + sigmoid(x[t] . shared_expert_gate) * shared_expert(x[t])

The shared expert is the model's own dense MLP module (fused gate/up,
column- then row-parallel), built by the family and handed to the layer
unreduced, so the layer's one all-reduce sums both.

Activations: `silu` (SwiGLU: silu(gate) * up), `swiglu_oai` (gpt-oss:
gate clamped above at `limit`, up clamped to [-limit, limit],
(up + 1) * gate * sigmoid(alpha * gate)).

The experts themselves run as one grouped computation per layer
(sluice_kernels.moe: tokens grouped by expert, each selected expert's
weights read once; the plain-torch reference, the C++ kernel on GGUF or
MXFP4 blocks on CPU, Triton's grouped GEMM through the backend's ops). Each token's experts are listed in ascending order,
the order transformers adds their outputs in.

Tensor parallelism splits every expert's intermediate dimension, as the
dense MLP's (each rank holds rows [rank * I/N, (rank + 1) * I/N) of every
expert's gate and up and those columns of its down): one all-reduce per
layer, the router and the down biases whole on every rank (the bias added
on rank 0 only, before the reduction). A shared expert's intermediate
dimension is split the same way, its gate whole on every rank: the gate
scales each rank's partial sum alike, so the sum of the scaled parts is the
scaled sum.

Expert parallelism (`dist.expert_parallel`, --expert-parallel) splits the
experts instead: rank r holds experts [r * E/N, (r + 1) * E/N) whole, and
computes, for every token that chose one of them, their weighted outputs;
the other ranks' slots get weight 0 (pointed at one of the token's experts
here, so no other expert is read). Each chosen expert lives on one rank, so
the same all-reduce sums every token's k outputs, each down bias added once
(by its expert's rank). The router stays whole on every rank; a shared
expert is still split by its intermediate dimension.

    E = 8, N = 2, token t chose experts 2 and 5:
      rank 0 (experts 0-3): slots (2, w0), (2, 0)  -> w0 y_2
      rank 1 (experts 4-7): slots (1, 0), (1, w1)  -> w1 y_5   (local ids)
      all-reduce                                   -> w0 y_2 + w1 y_5

Weights, per layer (this rank's slice; I_r = intermediate_size / world;
with expert parallelism I_r = intermediate_size and E_r = E / world
experts in place of E):

    router.weight   [E, H]            router.bias  [E]          (router_bias)
    w13_weight      [E, 2 I_r, H]     rows [gate | up] of each expert
    w2_weight       [E, H, I_r]
    w13_bias        [E, 2 I_r]        w2_bias      [E, H]        (expert_bias)
    shared_expert.gate_up_proj.weight [2 S_r, H], .down_proj.weight [H, S_r]
                                      (S_r = shared_expert_size / world)
    shared_expert_gate.weight [1, H]                              (shared_expert_gate)

Checkpoints store them one tensor per expert and projection (Qwen3-MoE's
`experts.{e}.gate_proj`, Mixtral's `experts.{e}.w1`), or stacked (gpt-oss's
`experts.gate_up_proj`, transposed with gate and up interleaved, optionally
as MXFP4 blocks); each family's model maps its names onto the loaders here
(`load_expert` for one expert's tensor as stored, `load_whole_expert_`
for one a family has converted to this layout).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sluice_kernels.moe import ACTIVATIONS, Activation
from sluice_kernels.ops import TorchOps
from sluice_server.distributed import Distributed, shard_range

SOFTMAX_TOPK = "softmax_topk"
TOPK_SOFTMAX = "topk_softmax"


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    hidden_size: int
    # Each expert's intermediate size (whole, before the tensor-parallel split).
    intermediate_size: int
    scoring: str = SOFTMAX_TOPK
    # softmax_topk only: divide the k kept probabilities by their sum.
    renormalize: bool = True
    router_bias: bool = False
    expert_bias: bool = False
    activation: str = "silu"
    # swiglu_oai's constants (gpt-oss: alpha 1.702, limit 7).
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # The shared expert's intermediate size (whole), 0 without one, and
    # whether a sigmoid gate scales its output (Qwen2-MoE).
    shared_expert_size: int = 0
    shared_expert_gate: bool = False

    def __post_init__(self):
        if self.scoring not in (SOFTMAX_TOPK, TOPK_SOFTMAX):
            raise ValueError(f"expert scoring {self.scoring!r} is not supported ({SOFTMAX_TOPK}, {TOPK_SOFTMAX})")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"expert activation {self.activation!r} is not supported ({', '.join(ACTIVATIONS)})")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.shared_expert_gate and not self.shared_expert_size:
            raise ValueError("a shared expert gate without a shared expert (shared_expert_size 0)")

    @property
    def act(self) -> Activation:
        return Activation(self.activation, self.swiglu_alpha, self.swiglu_limit)

    @property
    def expert_parameters(self) -> int:
        """Weights (and biases) of one whole expert."""
        h, i = self.hidden_size, self.intermediate_size
        return 3 * h * i + (2 * i + h if self.expert_bias else 0)


def route(logits: torch.Tensor, spec: MoESpec) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k], expert ids [T, k] int64), each row's
    slots in ascending expert order (the order their outputs are summed in)."""
    if spec.scoring == SOFTMAX_TOPK:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, spec.top_k, dim=-1)
        if spec.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(logits.dtype)
    else:
        top, ids = torch.topk(logits, spec.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1, dtype=top.dtype)
    ids, slot_order = ids.sort(dim=-1)
    return weights.gather(-1, slot_order), ids


class FusedMoE(nn.Module):
    """The expert MLP of one layer (module docstring): router, grouped
    experts, the shared expert when the family has one, one all-reduce.

    `shared_expert`: a module x [T, H] -> this rank's partial [T, H] (not
    reduced), of intermediate size `spec.shared_expert_size`.

    `quantized`: on CPU, the experts' GGUF or MXFP4 blocks
    (sluice_kernels.moe.QuantizedExperts, attached by layers.gguf_weights),
    which every step then runs on; the dense expert weights are freed."""

    quantized = None

    def __init__(
        self, spec: MoESpec, dist: Distributed, ops: TorchOps | None = None, shared_expert: nn.Module | None = None
    ):
        super().__init__()
        if (shared_expert is not None) != bool(spec.shared_expert_size):
            raise ValueError(f"shared_expert_size={spec.shared_expert_size} but the shared expert module is "
                             f"{'missing' if shared_expert is None else 'given'}")
        self.spec = spec
        self.dist = dist
        # The backend's ops: their expert_mlp is the grouped computation
        # (plain torch, or Triton's grouped GEMM on CUDA).
        self.ops = ops or TorchOps()
        e, h, i = spec.num_experts, spec.hidden_size, spec.intermediate_size
        self.expert_parallel = dist.expert_parallel and dist.is_parallel
        if self.expert_parallel:
            # This rank's experts [expert_first, expert_last), whole.
            if e % dist.world_size:
                raise ValueError(f"--expert-parallel: num_experts={e} is not divisible by {dist.world_size} shards")
            self.expert_first, self.expert_last = shard_range(e, dist)
            self.first, self.last = 0, i
        else:
            self.expert_first, self.expert_last = 0, e
            # shard_range raises when the intermediate size does not split evenly.
            self.first, self.last = shard_range(i, dist)
        local = self.last - self.first
        self.router = nn.Module()
        self.router.weight = _param(torch.empty(e, h), self._load_whole)
        self.router.bias = _param(torch.empty(e), self._load_whole) if spec.router_bias else None
        # Checkpoints whose experts come as blocks (gpt-oss's MXFP4) leave
        # them here, {"w13" | "w2": (per-expert records, block types)}, for
        # the CPU shard to attach as `quantized`.
        self.block_records: dict = {}
        # This rank's experts; pieces: every expert's, this rank's or not
        # (each is read, and its shape checked).
        mine = self.expert_last - self.expert_first
        self.w13_weight = _param(torch.empty(mine, 2 * local, h), self.load_expert, pieces=2 * e)
        self.w2_weight = _param(torch.empty(mine, h, local), self.load_expert, pieces=e)
        if spec.expert_bias:
            self.w13_bias = _param(torch.empty(mine, 2 * local), self.load_expert, pieces=2 * e)
            self.w2_bias = _param(torch.empty(mine, h), self.load_expert, pieces=e)
        else:
            self.w13_bias = self.w2_bias = None
        self.shared_expert = shared_expert
        if spec.shared_expert_gate:
            self.shared_expert_gate = nn.Module()
            self.shared_expert_gate.weight = _param(torch.empty(1, h), self._load_whole)
        else:
            self.shared_expert_gate = None

    # -- loading -----------------------------------------------------------

    @staticmethod
    def _load_whole(param: nn.Parameter, checkpoint, shard_id: int = 0) -> None:
        if tuple(checkpoint.get_shape()) != tuple(param.shape):
            raise ValueError(f"router or shared expert gate: checkpoint shape {tuple(checkpoint.get_shape())} "
                             f"!= {tuple(param.shape)}")
        param.data.copy_(checkpoint[:])

    def load_expert(self, param: nn.Parameter, checkpoint, shard_id: int) -> None:
        """One expert's gate, up or down tensor (or bias), as most checkpoints
        store them. shard_id: expert * 2 + (0 gate, 1 up) for w13, the
        expert for w2."""
        local = self.last - self.first
        h, i = self.spec.hidden_size, self.spec.intermediate_size
        shape = tuple(checkpoint.get_shape())
        w13 = param is self.w13_weight or param is self.w13_bias
        expert, piece = divmod(shard_id, 2) if w13 else (shard_id, 0)
        mine = self.local_expert(expert)
        if w13:
            want = (i, h) if param.dim() == 3 else (i,)
            _check(shape, want, "expert gate/up")
            if mine is not None:
                param.data[mine, piece * local : (piece + 1) * local].copy_(checkpoint[self.first : self.last])
        elif param is self.w2_weight:
            _check(shape, (h, i), "expert down")
            if mine is not None:
                param.data[mine].copy_(checkpoint[:, self.first : self.last])
        else:  # w2_bias: whole, added on rank 0 only (with expert parallelism: by the expert's rank)
            _check(shape, (h,), "expert down bias")
            if mine is not None:
                param.data[mine].copy_(checkpoint[:])

    def local_expert(self, expert: int) -> int | None:
        """Where expert `expert` is in this rank's weights (None: another rank's)."""
        if not 0 <= expert < self.spec.num_experts:
            raise ValueError(f"expert {expert} of a layer with {self.spec.num_experts} experts")
        if self.expert_first <= expert < self.expert_last:
            return expert - self.expert_first
        return None

    def load_whole_expert_(self, param: nn.Parameter, expert: int, whole: torch.Tensor) -> None:
        """One expert's tensor in our layout but whole (every rank's part):
        w13 [2 I, H] ([gate | up] rows), w2 [H, I], w13 bias [2 I], w2 bias
        [H]; this rank keeps its slice (nothing, for another rank's expert). For checkpoints that store experts
        otherwise (gpt-oss's stacked, transposed, interleaved ones), the
        family converts each expert and hands it here."""
        i = self.spec.intermediate_size
        expert = self.local_expert(expert)
        if expert is None:
            return
        if param is self.w13_weight or param is self.w13_bias:
            mine = torch.cat([whole[self.first : self.last], whole[i + self.first : i + self.last]])
        elif param is self.w2_weight:
            mine = whole[:, self.first : self.last]
        else:
            mine = whole
        if mine.shape != param.shape[1:]:
            raise ValueError(f"expert tensor of shape {tuple(whole.shape)} does not fit {tuple(param.shape)}")
        param.data[expert].copy_(mine)

    def use_blocks_(self, blocks) -> None:
        """Runs the experts on `blocks` (a QuantizedExperts) from now on and
        frees the dense expert weights."""
        self.quantized = blocks
        self.block_records = {}
        for weight in (self.w13_weight, self.w2_weight):
            weight.data = torch.empty(0, dtype=weight.dtype)

    # -- forward -----------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H], summed over the tensor-parallel ranks."""
        logits = F.linear(x, self.router.weight, self.router.bias)
        weights, ids = route(logits, self.spec)
        if self.expert_parallel:
            y = x.new_zeros(x.shape)
            rows, ids, weights = self.local_slots(ids, weights)
            if rows.numel():
                y[rows] = self._experts(x[rows], ids, weights, self.w2_bias)
        else:
            y = self._experts(x, ids, weights, self.w2_bias if self.dist.rank == 0 else None)
        if self.shared_expert is not None:
            y = y + self._shared(x)
        return self.dist.all_reduce(y)

    def _experts(self, x, ids, weights, b2) -> torch.Tensor:
        if self.quantized is not None and self.quantized.handles(x):
            return self.quantized.mlp(x, ids, weights, self.w13_bias, b2, self.spec.act)
        return self.ops.expert_mlp(x, ids, weights, self.w13_weight, self.w2_weight, self.w13_bias, b2, self.spec.act)

    def local_slots(self, ids: torch.Tensor, weights: torch.Tensor):
        """Expert parallelism: (rows [T'] of the tokens that chose one of this
        rank's experts, their slots' local expert ids [T', k] and weights
        [T', k]). Another rank's slot points at the token's first local
        expert with weight 0 (module docstring), the slots kept in ascending
        order."""
        local = (ids >= self.expert_first) & (ids < self.expert_last)
        rows = local.any(dim=-1).nonzero().squeeze(-1)
        ids, weights, local = ids[rows] - self.expert_first, weights[rows], local[rows]
        first = torch.where(local, ids, self.expert_last).amin(dim=-1, keepdim=True)
        ids = torch.where(local, ids, first)
        weights = torch.where(local, weights, torch.zeros_like(weights))
        ids, order = ids.sort(dim=-1, stable=True)
        return rows, ids, weights.gather(-1, order)

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's part of the shared expert's output, gated per token."""
        s = self.shared_expert(x)
        if self.shared_expert_gate is not None:
            s = torch.sigmoid(F.linear(x, self.shared_expert_gate.weight)) * s
        return s


def _param(t: torch.Tensor, loader, pieces: int = 1) -> nn.Parameter:
    p = nn.Parameter(t, requires_grad=False)
    p.weight_loader = loader
    p.num_pieces = pieces
    return p


def _check(got, want, what: str) -> None:
    if tuple(got) != tuple(want):
        raise ValueError(f"{what}: checkpoint shape {tuple(got)} != expected {tuple(want)}")
