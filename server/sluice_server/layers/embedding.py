"""Vocab-parallel token embedding and LM head.

The vocabulary is padded to a multiple of the world size and split into equal
row ranges; rank r owns token ids [r * part, (r + 1) * part):

    ids:   0 ........ part-1 | part ...... 2*part-1 | ...   (padding rows are zero)
    rank:        0           |          1           | ...

Embedding: each rank looks up the ids it owns (others give zeros) and an
all-reduce sums the rows. LM head: each rank computes the logits of its ids
and an all-gather concatenates them; the padding columns are dropped.
"""

from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from sluice_server.distributed import Distributed
from sluice_server.layers.linear import blocks_take_every_step, pack_for_cpu, packed_linear, packs_for_cpu


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dist: Distributed):
        super().__init__()
        self.dist = dist
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        part = -(-vocab_size // dist.world_size)
        self.start = dist.rank * part
        self.end = self.start + part
        # Allocated, not written: a table the shard serves from GGUF blocks is
        # emptied before loading and never takes memory (`_load` zeroes the padding).
        self.weight = nn.Parameter(torch.empty(part, hidden_size), requires_grad=False)
        self.weight.weight_loader = self._load
        # The table's GGUF blocks (layers.gguf_weights), which the lookup
        # reads once the dense table is freed; its [rows, hidden] shape then.
        self.quantized = None
        self.dense_shape: tuple[int, int] | None = None

    def _load(self, param: nn.Parameter, checkpoint, shard_id: int = 0) -> None:
        shape = tuple(checkpoint.get_shape())
        if shape != (self.vocab_size, self.hidden_size):
            raise ValueError(f"embedding: checkpoint shape {shape} != {(self.vocab_size, self.hidden_size)}")
        end = min(self.end, self.vocab_size)
        param.data.zero_()
        if end > self.start:
            param.data[: end - self.start].copy_(checkpoint[self.start : end])

    def reads_dense_weight(self) -> bool:
        return self.quantized is None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None and not self.weight.numel():
            return self.quantized.rows(ids.reshape(-1)).reshape(*ids.shape, self.hidden_size)
        if not self.dist.is_parallel:
            return F.embedding(ids, self.weight)
        owned = (ids >= self.start) & (ids < self.end)
        local = torch.where(owned, ids - self.start, torch.zeros_like(ids))
        x = F.embedding(local, self.weight) * owned.unsqueeze(-1).to(self.weight.dtype)
        return self.dist.all_reduce(x)


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states -> logits over the full vocabulary, float32.

    With tied embeddings the model points `weight` at the embedding's weight
    (same vocab split), and the checkpoint has no separate lm_head tensor.
    """

    packed: torch.Tensor | None = None

    def pack_for_cpu_(self, dtype: torch.dtype | None = None) -> bool:
        """Packs a copy of the weight for oneDNN (see layers.linear), unless
        the GGUF blocks take every step. The dense weight stays here; with
        tied embeddings it is also the embedding table; it is freed
        (layers.linear.free_unread_weights) once nothing reads it."""
        if not packs_for_cpu(self):
            return False
        self.packed = pack_for_cpu(self.weight, dtype)
        return True

    def reads_dense_weight(self) -> bool:
        return self.packed is None and not blocks_take_every_step(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None and self.quantized.handles(x):
            logits = self.quantized.linear(x)
        elif self.packed is not None:
            logits = packed_linear(x, self.packed, None)
        else:
            logits = F.linear(x, self.weight)
        logits = self.dist.all_gather_last_dim(logits)
        return logits[..., : self.vocab_size].float()
