"""Constrained decoding on the shard: one llguidance matcher per constrained
request, a token mask beside sampling.

The router compiled and validated every constraint; `NewRequest.grammar`
carries it as llguidance grammar JSON (empty: unconstrained). A step:

    1. each sampled row whose request has a `Grammar` gets one bitmask row
       from its matcher (one bit per token id, 32 per int32 word);
    2. `mask_logits` sets the logits of disallowed tokens to -inf, in the
       rows about to be sampled, before penalties / bias / temperature: the
       sampled token, its logprob and top-n all come from the constrained
       distribution;
    3. the sampled token advances the matcher (`Grammar.accept`).

Bitmask layout, [rows, words] int32, little-endian:

    token t  ->  word t // 32, bit t % 32
    words = ceil(tokenizer_vocab / 32); logits columns past the bitmask's
    32 * words (an LM head wider than the tokenizer) are disallowed, bitmask
    bits past the logits' width are ignored.

A request resumed after preemption arrives whole (prompt + generated): its
matcher is rebuilt and fed the generated tokens, so it stands where it was.
Prefix caching changes nothing here (the matcher sees tokens, not KV).
Every tensor-parallel rank holds the same matchers and feeds them the same
sampled tokens, so their masks agree without communication.

llguidance is imported at warmup (to build its view of the tokenizer) and
used only by constrained requests: an unconstrained step never touches it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import numpy as np
import torch


class GrammarError(ValueError):
    """A constraint failed for one request (its matcher errored)."""


class GrammarTokenizer:
    """llguidance's view of the model's tokenizer.json, built once.

    Building the token trie takes about a second for a 50k vocabulary and
    holds the GIL throughout, so the shard builds it at warmup (`load`), not
    on the first constrained request, and not on a thread.
    """

    def __init__(self, tokenizer_json: Path, logits_width: int, eos_token_ids: Sequence[int]):
        self.path = tokenizer_json
        self.logits_width = logits_width
        self.eos_token_ids = list(eos_token_ids)
        self._tokenizer = None
        self._error: Exception | None = None

    def load(self) -> None:
        """Builds it (no-op without tokenizer.json, or once built); a failure
        is kept and reported to each constrained request."""
        if self._tokenizer is not None or self._error is not None or not self.path.is_file():
            return
        try:
            import llguidance

            path, eos = str(self.path), self.eos_token_ids or None
            try:
                # The trie spans the logits' width when the LM head has
                # padding rows (their bytes match nothing: never allowed).
                self._tokenizer = llguidance.LLTokenizer(path, n_vocab=self.logits_width, eos_token=eos)
            except ValueError:
                # The tokenizer is the wider one; _unpack trims its mask.
                self._tokenizer = llguidance.LLTokenizer(path, eos_token=eos)
        except Exception as e:  # noqa: BLE001 - reported to each constrained request
            self._error = e

    def get(self):
        if not self.path.is_file():
            raise GrammarError(f"constrained decoding needs {self.path.name} in the model folder")
        self.load()
        if self._error is not None:
            raise GrammarError(f"llguidance cannot read {self.path}: {self._error}")
        return self._tokenizer


class Grammar:
    """One request's matcher."""

    def __init__(self, tokenizer, grammar_json: str, generated: Sequence[int]):
        import llguidance

        self.matcher = llguidance.LLMatcher(tokenizer, grammar_json, log_level=0)
        self.words = (tokenizer.vocab_size + 31) // 32
        if generated and not self.matcher.consume_tokens(list(generated)):
            raise GrammarError(f"resuming a constrained request failed: {self.matcher.get_error()}")
        if self.matcher.is_error():
            raise GrammarError(f"invalid constraint: {self.matcher.get_error()}")

    def fill(self, row: torch.Tensor) -> None:
        """Writes the allowed tokens into `row` ([words] int32, contiguous, CPU)."""
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    def accept(self, token_id: int) -> str | None:
        """Advances past the sampled token; an error message if it could not."""
        if self.matcher.consume_token(token_id):
            return None
        return f"constrained decoding failed: {self.matcher.get_error() or 'the token was not allowed'}"


def mask_logits(logits: torch.Tensor, rows: Sequence[int], grammars: Sequence[Grammar]) -> None:
    """Sets logits[rows[i], t] = -inf for every token t grammars[i] disallows.

    logits: [n, vocab] float, any device, modified in place. The bitmask is
    filled on the CPU; on CUDA only the small int32 mask is copied over.
    """
    if not rows:
        return
    words = grammars[0].words
    bitmask = torch.empty((len(rows), words), dtype=torch.int32)
    for i, grammar in enumerate(grammars):
        grammar.fill(bitmask[i])
    index = torch.tensor(list(rows), dtype=torch.long, device=logits.device)
    allowed = _unpack(bitmask, logits.shape[1], logits.device)
    part = logits.index_select(0, index)
    logits.index_copy_(0, index, part.masked_fill_(~allowed, -math.inf))


def _unpack(bitmask: torch.Tensor, width: int, device: torch.device) -> torch.Tensor:
    """[n, words] int32 bits -> [n, width] bool on `device`: token t is word
    t // 32, bit t % 32; columns past the bitmask are False."""
    if device.type != "cpu":
        return _unpack_torch(bitmask, width, device)
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
    return _fit(torch.from_numpy(bits).view(torch.bool), width)


def _unpack_torch(bitmask: torch.Tensor, width: int, device: torch.device) -> torch.Tensor:
    """As `_unpack`, with tensor ops on the device (only the int32 words move)."""
    n, words = bitmask.shape
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    words_dev = bitmask.to(device, non_blocking=True)
    return _fit(((words_dev.unsqueeze(-1) >> shifts) & 1).view(n, words * 32).bool(), width)


def _fit(allowed: torch.Tensor, width: int) -> torch.Tensor:
    n, have = allowed.shape
    if have >= width:
        return allowed[:, :width]
    pad = torch.zeros((n, width - have), dtype=torch.bool, device=allowed.device)
    return torch.cat([allowed, pad], dim=1)
