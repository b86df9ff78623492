"""Batched logits processing and seeded sampling.

One call to `sample` picks the next token of every request in a step. The
per-request parameters (proto `SamplingParams`) become tensors, so the cost
grows with the batch through tensor ops, not Python loops over the
vocabulary.

Pipeline, per row (the order is transformers' `generate`):

    raw logits
      -> repetition penalty   (CTRL: every token in prompt + generated)
      -> frequency/presence   (OpenAI: counts in the generated tokens only)
      -> logit bias           (added)
      -> min_tokens           (EOS ids masked until enough were generated)
      =  processed logits  --> logprob / top_tokens = log_softmax(processed)
      -> greedy: argmax                                (temperature == 0)
      -> else: / temperature -> top_k -> top_p -> min_p -> typical_p
               -> softmax -> inverse-CDF draw with u = U(seed, position)

Seeded randomness: the token at position p of a request is drawn with one
uniform number u = hash(seed, p) through the inverse CDF of its row's
distribution. Nothing depends on a generator's running state or on the other
rows, so a request yields the same tokens alone, inside any batch, and after
a preemption that replays it from scratch.

Neutral values disable a feature (proto3 leaves unset fields at 0, so 0 is
neutral too where 0 would make no sense): temperature 0 = greedy, top_k 0
(or >= vocab), top_p 0 or 1, min_p 0, typical_p 0 or 1, repetition_penalty
0 or 1, frequency/presence penalty 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from sluice_server.pb import shard_pb2

_MASK64 = (1 << 64) - 1


@dataclass
class SamplingRow:
    """One request about to get a token.

    token_ids:  prompt + generated so far; the new token goes at position
                len(token_ids).

        token_ids: [ p0 p1 ... p(P-1) | g0 g1 ... g(G-1) ]   new token at P+G
                    '--- prompt -----'  '-- generated --'
                    num_prompt_tokens = P
    """

    params: shard_pb2.SamplingParams
    token_ids: Sequence[int]
    num_prompt_tokens: int


@dataclass
class SampledToken:
    token_id: int
    # log_softmax of the processed logits at token_id; nan unless the request
    # asked for logprobs or top_n_tokens.
    logprob: float
    # The top_n_tokens most likely (token id, logprob), most likely first.
    top_tokens: list[tuple[int, float]] = field(default_factory=list)
    # Set when this row could not be sampled (its logits were NaN, or every
    # token was masked); the other fields are then meaningless. The failure
    # belongs to this request alone.
    error: str | None = None


def check_params(params: shard_pb2.SamplingParams, vocab_size: int) -> None:
    """Raises ValueError naming the field when `params` cannot be sampled.

    The router validates requests first; this is the shard's own guard, so a
    bad value that slipped through fails one request instead of a step.
    """

    def finite(name: str, value: float) -> None:
        if not math.isfinite(value):
            raise ValueError(f"sampling parameter {name} must be finite, got {value}")

    for name in ("temperature", "top_p", "min_p", "typical_p", "repetition_penalty",
                 "frequency_penalty", "presence_penalty"):
        finite(name, getattr(params, name))
    if params.temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {params.temperature}")
    for name in ("top_p", "min_p", "typical_p"):
        value = getattr(params, name)
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value}")
    if params.repetition_penalty < 0:
        raise ValueError(f"repetition_penalty must be > 0, got {params.repetition_penalty}")
    if params.top_n_tokens > vocab_size:
        raise ValueError(f"top_n_tokens {params.top_n_tokens} exceeds the vocabulary size {vocab_size}")
    for bias in params.logit_bias:
        if bias.token_id >= vocab_size:
            raise ValueError(
                f"logit_bias token id {bias.token_id} is outside the vocabulary (size {vocab_size})"
            )
        finite("logit_bias", bias.bias)


def sample(
    logits: torch.Tensor, rows: list[SamplingRow], eos_token_ids: Sequence[int]
) -> list[SampledToken]:
    """Picks one token per row.

    logits: [len(rows), vocab] float32, any device; not modified.
    """
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits of shape {tuple(logits.shape)} do not match {len(rows)} rows")
    if not rows:
        return []
    batch = _BatchParams(rows, logits.shape[1], logits.device)
    if batch.plain_greedy:
        return _greedy_fast_path(logits)

    processed = logits.float().clone()
    _apply_penalties(processed, rows, batch)
    _apply_logit_bias(processed, rows, batch)
    _mask_eos(processed, rows, batch, eos_token_ids)

    # A row is broken when NaN reached it or every token got masked; it is
    # reported alone and neutralised so it cannot disturb the batched math.
    row_max = processed.amax(dim=-1)
    broken = torch.isnan(row_max) | torch.isneginf(row_max)
    broken_rows = broken.nonzero().flatten().tolist()
    if broken_rows:
        processed[broken] = 0.0

    chosen = processed.argmax(dim=-1)
    if batch.sampled_rows:
        idx = torch.tensor(batch.sampled_rows, device=processed.device)
        chosen[idx] = _draw(processed[idx], batch)

    results = _report(processed, chosen, batch)
    for i in broken_rows:
        reason = "NaN in logits" if torch.isnan(logits[i].float()).any() else "every token was masked"
        results[i] = SampledToken(0, math.nan, [], error=f"cannot sample: {reason}")
    return results


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[i, token_ids[i]] for every row (prompt logprobs).

    logits: [n, vocab]; token_ids: [n] int64 on the same device -> [n] float32.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return logprobs.gather(1, token_ids.view(-1, 1).long()).view(-1)


def uniform_for(seed: int, position: int) -> float:
    """The uniform number in [0, 1) that draws the token at `position`.

    A counter-based hash (two splitmix64 rounds) of (seed, position): no state
    is carried from one draw to the next.
    """
    h = _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64))
    return (h >> 11) * (1.0 / (1 << 53))


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class _BatchParams:
    """The rows' parameters as column tensors, plus the row subsets each
    processor touches (so a feature nobody uses costs nothing)."""

    def __init__(self, rows: list[SamplingRow], vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device
        n = len(rows)
        temperature = [0.0] * n
        top_k = [vocab_size] * n
        top_p = [1.0] * n
        min_p = [0.0] * n
        typical_p = [1.0] * n
        self.sampled_rows: list[int] = []
        self.repetition_rows: list[int] = []
        self.freq_presence_rows: list[int] = []
        self.bias_rows: list[int] = []
        self.min_tokens_rows: list[int] = []
        self.logprob_rows: list[int] = []
        self.top_k_rows: list[int] = []
        self.top_p_rows: list[int] = []
        self.min_p_rows: list[int] = []
        self.typical_rows: list[int] = []
        self.top_n = [0] * n
        for i, row in enumerate(rows):
            p = row.params
            if p.repetition_penalty not in (0.0, 1.0):
                self.repetition_rows.append(i)
            if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
                self.freq_presence_rows.append(i)
            if len(p.logit_bias):
                self.bias_rows.append(i)
            if p.min_tokens and len(row.token_ids) - row.num_prompt_tokens < p.min_tokens:
                self.min_tokens_rows.append(i)
            if p.logprobs or p.top_n_tokens:
                self.logprob_rows.append(i)
                self.top_n[i] = min(p.top_n_tokens, vocab_size)
            if p.temperature > 0.0:
                self.sampled_rows.append(i)
                temperature[i] = p.temperature
                if 0 < p.top_k < vocab_size:
                    top_k[i] = p.top_k
                    self.top_k_rows.append(i)
                if 0.0 < p.top_p < 1.0:
                    top_p[i] = p.top_p
                    self.top_p_rows.append(i)
                if p.min_p > 0.0:
                    min_p[i] = p.min_p
                    self.min_p_rows.append(i)
                if 0.0 < p.typical_p < 1.0:
                    typical_p[i] = p.typical_p
                    self.typical_rows.append(i)
        self.plain_greedy = not (
            self.sampled_rows or self.repetition_rows or self.freq_presence_rows
            or self.bias_rows or self.min_tokens_rows or self.logprob_rows
        )
        if self.plain_greedy:
            return
        self.uniforms = [uniform_for(rows[i].params.seed, len(rows[i].token_ids)) for i in self.sampled_rows]
        self.temperature = torch.tensor(temperature, device=device)
        self.top_k = torch.tensor(top_k, device=device)
        self.top_p = torch.tensor(top_p, device=device)
        self.min_p = torch.tensor(min_p, device=device)
        self.typical_p = torch.tensor(typical_p, device=device)


def _greedy_fast_path(logits: torch.Tensor) -> list[SampledToken]:
    values, ids = logits.max(dim=-1)
    ids = ids.tolist()
    broken = torch.isnan(values).tolist()
    return [
        SampledToken(0, math.nan, [], error="cannot sample: NaN in logits") if bad
        else SampledToken(token_id, math.nan, [])
        for token_id, bad in zip(ids, broken)
    ]


def _flat_token_index(
    rows: list[SamplingRow], selected: list[int], device: torch.device, generated_only: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) index pairs of the selected rows' tokens, flattened:

        selected = [3, 7]; rows[3].token_ids = [a b c], rows[7] = [d e]
        -> row index [0 0 0 1 1], token ids [a b c d e]
    (row indices count within `selected`).
    """
    ids: list[int] = []
    counts: list[int] = []
    for i in selected:
        row = rows[i]
        tokens = row.token_ids[row.num_prompt_tokens:] if generated_only else row.token_ids
        ids.extend(tokens)
        counts.append(len(tokens))
    row_index = torch.repeat_interleave(
        torch.arange(len(selected)), torch.tensor(counts, dtype=torch.long)
    ).to(device)
    return row_index, torch.tensor(ids, dtype=torch.long, device=device)


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow], batch: _BatchParams) -> None:
    vocab, device = batch.vocab_size, logits.device
    if batch.repetition_rows:
        sel = torch.tensor(batch.repetition_rows, device=device)
        row_index, ids = _flat_token_index(rows, batch.repetition_rows, device, generated_only=False)
        seen = torch.zeros(len(sel), vocab, dtype=torch.bool, device=device)
        seen[row_index, ids] = True
        penalty = torch.tensor(
            [rows[i].params.repetition_penalty for i in batch.repetition_rows], device=device
        ).view(-1, 1)
        part = logits[sel]
        penalized = torch.where(part < 0, part * penalty, part / penalty)
        logits[sel] = torch.where(seen, penalized, part)
    if batch.freq_presence_rows:
        sel = torch.tensor(batch.freq_presence_rows, device=device)
        row_index, ids = _flat_token_index(rows, batch.freq_presence_rows, device, generated_only=True)
        counts = torch.zeros(len(sel), vocab, device=device)
        counts.index_put_((row_index, ids), torch.ones_like(ids, dtype=counts.dtype), accumulate=True)
        freq = torch.tensor([rows[i].params.frequency_penalty for i in batch.freq_presence_rows], device=device)
        presence = torch.tensor([rows[i].params.presence_penalty for i in batch.freq_presence_rows], device=device)
        logits[sel] -= counts * freq.view(-1, 1) + (counts > 0).float() * presence.view(-1, 1)


def _apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow], batch: _BatchParams) -> None:
    if not batch.bias_rows:
        return
    row_index, token_index, bias = [], [], []
    for i in batch.bias_rows:
        for entry in rows[i].params.logit_bias:
            row_index.append(i)
            token_index.append(entry.token_id)
            bias.append(entry.bias)
    device = logits.device
    logits.index_put_(
        (torch.tensor(row_index, device=device), torch.tensor(token_index, device=device)),
        torch.tensor(bias, device=device, dtype=logits.dtype),
        accumulate=True,
    )


def _mask_eos(
    logits: torch.Tensor, rows: list[SamplingRow], batch: _BatchParams, eos_token_ids: Sequence[int]
) -> None:
    eos = [t for t in eos_token_ids if 0 <= t < batch.vocab_size]
    if not batch.min_tokens_rows or not eos:
        return
    device = logits.device
    sel = torch.tensor(batch.min_tokens_rows, device=device).view(-1, 1)
    logits[sel, torch.tensor(eos, device=device).view(1, -1)] = -math.inf


def _draw(logits: torch.Tensor, batch: _BatchParams) -> torch.Tensor:
    """Samples the rows batch.sampled_rows, whose processed logits are
    `logits` [len(sampled_rows), vocab] in that order."""
    device = logits.device
    local = {row: k for k, row in enumerate(batch.sampled_rows)}
    rows = torch.tensor(batch.sampled_rows, device=device)
    scores = logits / batch.temperature[rows].view(-1, 1)
    # Each warper runs on the rows that enabled it only: a feature nobody in
    # the batch uses costs nothing, and a sort is paid only where needed.
    for subset, warp, param in (
        (batch.top_k_rows, _top_k, batch.top_k),
        (batch.top_p_rows, _top_p, batch.top_p),
        (batch.min_p_rows, _min_p, batch.min_p),
        (batch.typical_rows, _typical, batch.typical_p),
    ):
        if subset:
            sub = torch.tensor([local[r] for r in subset], device=device)
            scores[sub] = warp(scores[sub], param[torch.tensor(subset, device=device)])
    probs = torch.softmax(scores, dim=-1)
    u = torch.tensor(batch.uniforms, dtype=torch.float64, device=device)
    return _inverse_cdf(probs, u)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The first token whose cumulative probability exceeds u * total.

        probs  .2  0  .5  .3        cdf  .2 .2 .7 1.0
        u=.5 -> x=.5 -> first cdf > .5 is index 2

    A zero-probability token never has cdf > x where its predecessor did not,
    so masked tokens cannot be drawn (a float32 cumsum of non-negative terms
    never decreases). x is kept strictly below the total so the search always
    lands inside the row.
    """
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1]
    x = torch.minimum((u * total.double()).float(), torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, x.view(-1, 1), right=True).view(-1)


# top_p and typical_p first look for their kept set among this many best
# candidates (a partial top-k is far cheaper than sorting the vocabulary);
# only a row whose candidates do not reach the requested mass (a very flat
# distribution) pays for a full sort.
_CANDIDATES = 256


def _top_k(scores: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    k_max = int(k.max())
    top = torch.topk(scores, k_max, dim=-1).values
    threshold = top.gather(1, (k - 1).view(-1, 1))
    return scores.masked_fill(scores < threshold, -math.inf)


def _top_p(scores: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keeps the most likely tokens until their mass reaches top_p (nucleus).

    transformers' TopPLogitsWarper drops, in ascending order, the tokens whose
    cumulative probability is <= 1 - top_p. In descending order that is: keep
    a token iff the mass of the tokens ranked above it is < top_p. The most
    likely token always stays.
    """
    probs = torch.softmax(scores, dim=-1)
    top_p = top_p.view(-1, 1)

    def smallest_kept(sorted_probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
        n_keep = (mass_above < top_p).sum(dim=-1).clamp(min=1)
        return sorted_probs.gather(1, (n_keep - 1).view(-1, 1))

    candidates = torch.topk(probs, min(_CANDIDATES, probs.shape[-1]), dim=-1).values
    threshold = smallest_kept(candidates, top_p)
    flat = (candidates.sum(dim=-1) < top_p.view(-1)).nonzero().flatten()
    if len(flat):
        full = torch.sort(probs[flat], dim=-1, descending=True).values
        threshold[flat] = smallest_kept(full, top_p[flat])
    return scores.masked_fill(probs < threshold, -math.inf)


def _min_p(scores: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    # Keep tokens with prob >= min_p * max prob; the top token always passes.
    probs = torch.softmax(scores, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.view(-1, 1)
    return scores.masked_fill(probs < threshold, -math.inf)


def _typical(scores: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Locally typical sampling, as transformers' TypicalLogitsWarper.

    Tokens are ranked by how far their information content (-log p) is from
    the entropy; with cum the cumulative probability in that order, the kept
    tokens are those no farther than the token at rank #{cum < mass}.
    """
    logp = torch.log_softmax(scores, dim=-1)
    probs = logp.exp()
    entropy = -(logp * probs).nansum(dim=-1, keepdim=True)
    distance = (-logp - entropy).abs()
    mass = mass.view(-1, 1)

    def farthest_kept(order: torch.Tensor, mass: torch.Tensor, distance: torch.Tensor, probs: torch.Tensor):
        cumulative = probs.gather(1, order).cumsum(dim=-1)
        last = (cumulative < mass).sum(dim=-1).clamp(max=order.shape[-1] - 1)
        return distance.gather(1, order).gather(1, last.view(-1, 1)), cumulative[:, -1]

    k = min(_CANDIDATES, scores.shape[-1])
    order = torch.topk(distance, k, dim=-1, largest=False).indices
    threshold, reached = farthest_kept(order, mass, distance, probs)
    flat = (reached < mass.view(-1)).nonzero().flatten()
    if len(flat):
        full_order = torch.sort(distance[flat], dim=-1).indices
        threshold[flat], _ = farthest_kept(full_order, mass[flat], distance[flat], probs[flat])
    return scores.masked_fill(distance > threshold, -math.inf)


def _report(processed: torch.Tensor, chosen: torch.Tensor, batch: _BatchParams) -> list[SampledToken]:
    chosen_list = chosen.tolist()
    results = [SampledToken(t, math.nan, []) for t in chosen_list]
    if not batch.logprob_rows:
        return results
    sel = torch.tensor(batch.logprob_rows, device=processed.device)
    logprobs = torch.log_softmax(processed[sel], dim=-1)
    chosen_logprob = logprobs.gather(1, chosen[sel].view(-1, 1)).view(-1).tolist()
    n_max = max(batch.top_n[i] for i in batch.logprob_rows)
    if n_max:
        top_values, top_ids = torch.topk(logprobs, n_max, dim=-1)
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
    for k, i in enumerate(batch.logprob_rows):
        results[i].logprob = chosen_logprob[k]
        n = batch.top_n[i]
        if n:
            results[i].top_tokens = list(zip(top_ids[k][:n], top_values[k][:n]))
    return results
