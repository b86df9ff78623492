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
      -> else: / temperature -> top_k (the row goes on with its k best
               tokens only) -> top_p -> min_p -> typical_p
               -> exp -> inverse-CDF draw with u = U(seed, position)

Cost: the greedy rows of a batch with nothing else asked take one max pass
over [batch, vocab]; sampling adds about four (shift+scale, exp, cumsum),
or one top-k with top_k set, after which the row is k wide;
each enabled warper adds a few, and top_p / typical_p on a very flat row a
sort. Penalties and logit bias cost in proportion to the tokens they touch.

Seeded randomness: the token at position p of a request is drawn with one
uniform number u = hash(seed, p) through the inverse CDF of its row's
distribution. Nothing depends on a generator's running state or on the other
rows, so a request yields the same tokens alone, inside any batch, and after
a preemption that replays it from scratch.

Ranges: the router is the one place that checks them
(router/src/validation/sampling.rs: temperature >= 0, top_p and typical_p in
(0, 1], min_p in [0, 1], repetition_penalty in (0, 100], penalties in
[-2, 2], biases in [-100, 100], all finite) and always sends every field;
the shard applies what it validated as it is. Neutral values disable a
feature: temperature 0 = greedy, top_k 0 (or >= vocab), top_p 1, min_p 0,
typical_p 1, repetition_penalty 1, frequency/presence penalty 0. A 0 in
top_p, typical_p or repetition_penalty never comes from the router (it
answers 400); here it is proto3's unset field, and off too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from sluice_kernels import cpu_kernels
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
    # params.logit_bias as tensors (`logit_bias_tensors`), built once when the
    # request arrived; None: built here from params when it has any.
    logit_bias: LogitBias | None = None


# A request's logit bias: token ids (int64) and biases (float32), both [n].
LogitBias = tuple[torch.Tensor, torch.Tensor]


def logit_bias_tensors(params: shard_pb2.SamplingParams) -> LogitBias | None:
    """The request's logit bias as two tensors, or None without any. Built
    once per request, so a step adds each row's biases with one scatter
    instead of a Python loop over every entry of every row."""
    if not len(params.logit_bias):
        return None
    ids = torch.tensor([b.token_id for b in params.logit_bias], dtype=torch.long)
    values = torch.tensor([b.bias for b in params.logit_bias], dtype=torch.float32)
    return ids, values


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
    """Raises ValueError naming the field when `params` reaches past this
    model's vocabulary, which would fail the whole step's tensors instead of
    one request.

    Sampling ranges are not checked here: the router checks them, once (see
    the module docstring).
    """
    if params.top_n_tokens > vocab_size:
        raise ValueError(f"top_n_tokens {params.top_n_tokens} exceeds the vocabulary size {vocab_size}")
    for bias in params.logit_bias:
        if bias.token_id >= vocab_size:
            raise ValueError(
                f"logit_bias token id {bias.token_id} is outside the vocabulary (size {vocab_size})"
            )


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

    # The caller's tensor is read, never written: copied only when a
    # processor edits it.
    processed = logits.float()
    if batch.edits_logits:
        if processed is logits:
            processed = processed.clone()
        _apply_penalties(processed, rows, batch)
        _apply_logit_bias(processed, rows, batch)
        _mask_eos(processed, rows, batch, eos_token_ids)

    # One pass gives the greedy choice and each row's maximum, which also
    # flags a broken row (NaN or +inf reached it, or every token got masked).
    # A broken row is reported alone and neutralised so it cannot disturb
    # the rest.
    row_max, chosen = processed.max(dim=-1)
    broken = ~torch.isfinite(row_max)
    broken_rows = broken.nonzero().flatten().tolist()
    if broken_rows:
        processed = processed.clone() if processed is logits else processed
        processed[broken] = 0.0
        row_max[broken] = 0.0

    if batch.sampled_rows:
        idx = batch.sampled_index
        chosen[idx] = _draw(_take_rows(processed, idx), row_max[idx].view(-1, 1), batch)

    results = _report(processed, chosen, batch)
    for i in broken_rows:
        results[i] = SampledToken(0, math.nan, [], error=f"cannot sample: {_why_broken(logits[i])}")
    return results


def _why_broken(row_logits: torch.Tensor) -> str:
    if torch.isnan(row_logits).any():
        return "NaN in logits"
    if torch.isposinf(row_logits).any():
        return "an infinite logit"
    return "every token was masked"


def _take_rows(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """t[idx], without the copy when idx is every row in order."""
    if len(idx) == len(t) and bool((idx == torch.arange(len(t), device=idx.device)).all()):
        return t
    return t[idx]


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
                if 0.0 < p.top_p < 1.0:
                    top_p[i] = p.top_p
                    self.top_p_rows.append(i)
                if p.min_p > 0.0:
                    min_p[i] = p.min_p
                    self.min_p_rows.append(i)
                if 0.0 < p.typical_p < 1.0:
                    typical_p[i] = p.typical_p
                    self.typical_rows.append(i)
        self.edits_logits = bool(
            self.repetition_rows or self.freq_presence_rows or self.bias_rows or self.min_tokens_rows
        )
        self.plain_greedy = not (self.sampled_rows or self.edits_logits or self.logprob_rows)
        if self.plain_greedy:
            return
        self.sampled_index = torch.tensor(self.sampled_rows, dtype=torch.long, device=device)
        self.uniforms = [uniform_for(rows[i].params.seed, len(rows[i].token_ids)) for i in self.sampled_rows]
        self.temperature = torch.tensor(temperature, device=device)
        self.top_k = torch.tensor(top_k, device=device)
        self.top_p = torch.tensor(top_p, device=device)
        self.min_p = torch.tensor(min_p, device=device)
        self.typical_p = torch.tensor(typical_p, device=device)


def _greedy_fast_path(logits: torch.Tensor) -> list[SampledToken]:
    values, ids = _row_max(logits)
    ids = ids.tolist()
    broken = torch.isnan(values).tolist()
    return [
        SampledToken(0, math.nan, [], error="cannot sample: NaN in logits") if bad
        else SampledToken(token_id, math.nan, [])
        for token_id, bad in zip(ids, broken)
    ]


def _row_max(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits.max(dim=-1): on CPU float32 through the C++ kernel when the
    shard loaded them (torch's max with indices over a 49K vocabulary took
    0.25-0.36 ms for 8 rows, 1.3-1.6 ms for 32; the kernel returns the same
    values and indices in about an eighth of that)."""
    on_cpu = logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.stride(-1) == 1
    if on_cpu and cpu_kernels.loaded():
        return torch.ops.sluice_cpu.argmax_rows(logits)
    return logits.max(dim=-1)


def _flat_token_index(
    rows: list[SamplingRow], selected: list[int], device: torch.device, generated_only: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) index pairs of the selected rows' tokens, flattened:

        selected = [3, 7]; rows[3].token_ids = [a b c], rows[7] = [d e]
        -> row index [3 3 3 7 7], token ids [a b c d e]
    """
    ids: list[int] = []
    row_index: list[int] = []
    for i in selected:
        row = rows[i]
        tokens = row.token_ids[row.num_prompt_tokens:] if generated_only else row.token_ids
        ids.extend(tokens)
        row_index.extend([i] * len(tokens))
    return (
        torch.tensor(row_index, dtype=torch.long, device=device),
        torch.tensor(ids, dtype=torch.long, device=device),
    )


def _per_row(rows: list[SamplingRow], name: str, row_index: torch.Tensor) -> torch.Tensor:
    """params.<name> of each row, expanded along row_index."""
    values = torch.tensor([getattr(row.params, name) for row in rows], device=row_index.device)
    return values[row_index]


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow], batch: _BatchParams) -> None:
    # Sparse: the work is proportional to the number of tokens seen, not to
    # the vocabulary. A token listed twice is written twice with the same
    # value (repetition) or charged once per occurrence (frequency), as meant.
    device = logits.device
    if batch.repetition_rows:
        row_index, ids = _flat_token_index(rows, batch.repetition_rows, device, generated_only=False)
        penalty = _per_row(rows, "repetition_penalty", row_index)
        seen = logits[row_index, ids]
        logits[row_index, ids] = torch.where(seen < 0, seen * penalty, seen / penalty)
    if batch.freq_presence_rows:
        row_index, ids = _flat_token_index(rows, batch.freq_presence_rows, device, generated_only=True)
        if not len(ids):
            return
        logits.index_put_((row_index, ids), -_per_row(rows, "frequency_penalty", row_index), accumulate=True)
        # Presence is charged once per distinct (row, token).
        flat = torch.unique(row_index * batch.vocab_size + ids)
        distinct_rows = flat // batch.vocab_size
        logits.view(-1).index_add_(0, flat, -_per_row(rows, "presence_penalty", distinct_rows))


def _apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow], batch: _BatchParams) -> None:
    if not batch.bias_rows:
        return
    per_row = [rows[i].logit_bias or logit_bias_tensors(rows[i].params) for i in batch.bias_rows]
    ids = torch.cat([b[0] for b in per_row])
    values = torch.cat([b[1] for b in per_row])
    row_index = torch.repeat_interleave(
        torch.tensor(batch.bias_rows, dtype=torch.long), torch.tensor([len(b[0]) for b in per_row])
    )
    device = logits.device
    logits.index_put_(
        (row_index.to(device), ids.to(device)), values.to(device=device, dtype=logits.dtype), accumulate=True
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


def _draw(logits: torch.Tensor, row_max: torch.Tensor, batch: _BatchParams) -> torch.Tensor:
    """Samples the rows batch.sampled_rows, whose processed logits are
    `logits` [len(sampled_rows), vocab] in that order, with maxima row_max
    [len(sampled_rows), 1]."""
    device = logits.device
    # (logits - max) / temperature in one pass: the row maximum becomes 0, so
    # exp() below cannot overflow, and no warper depends on the shift.
    inverse_temperature = 1.0 / batch.temperature[batch.sampled_index].view(-1, 1)
    scores = torch.addcmul(-row_max * inverse_temperature, logits, inverse_temperature)
    u = torch.tensor(batch.uniforms, dtype=torch.float64, device=device)
    chosen = torch.empty(len(batch.sampled_rows), dtype=torch.long, device=device)
    # A row with top_k continues on its k best tokens only ([rows, k] instead
    # of [rows, vocab]; exactly k, where transformers would also keep ties
    # with the k-th). Rows are grouped by their own k, so what a row computes
    # never depends on the other rows of the batch.
    for k, members in _group_by_top_k(batch).items():
        m = torch.tensor(members, device=device)
        part = _take_rows(scores, m)
        token_ids = None
        if k < batch.vocab_size:
            part, token_ids = torch.topk(part, k, dim=-1)
        part = _warp(part, [batch.sampled_rows[j] for j in members], batch)
        pick = _inverse_cdf(part.exp_(), u[m])
        chosen[m] = pick if token_ids is None else token_ids.gather(1, pick.view(-1, 1)).view(-1)
    return chosen


def _group_by_top_k(batch: _BatchParams) -> dict[int, list[int]]:
    """k -> positions in batch.sampled_rows; k = vocab for rows without top_k."""
    top_k = batch.top_k[batch.sampled_index].tolist()
    groups: dict[int, list[int]] = {}
    for position, k in enumerate(top_k):
        groups.setdefault(k, []).append(position)
    return groups


def _warp(scores: torch.Tensor, rows: list[int], batch: _BatchParams) -> torch.Tensor:
    """top_p, min_p and typical_p on scores [len(rows), n], each on the
    rows (batch row numbers `rows`) that enabled it: a feature nobody uses
    costs nothing."""
    position = {row: j for j, row in enumerate(rows)}
    for enabled, warp, param in (
        (batch.top_p_rows, _top_p, batch.top_p),
        (batch.min_p_rows, _min_p, batch.min_p),
        (batch.typical_rows, _typical, batch.typical_p),
    ):
        subset = [r for r in enabled if r in position]
        if not subset:
            continue
        selected = param[torch.tensor(subset, device=scores.device)]
        if len(subset) == len(rows):
            scores = warp(scores, selected)
        else:
            sub = torch.tensor([position[r] for r in subset], device=scores.device)
            scores[sub] = warp(scores[sub], selected)
    return scores


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The first token whose cumulative weight exceeds u * total (weights are
    unnormalised probabilities, [n, vocab]; u is [n] float64 in [0, 1)).

        weights  .2  0  .5  .3        cdf  .2 .2 .7 1.0
        u=.5 -> x=.5 -> first cdf > .5 is index 2

    A zero-weight token never has cdf > x where its predecessor did not, so
    masked tokens cannot be drawn (a float32 cumsum of non-negative terms
    never decreases). x is kept strictly below the total so the search always
    lands inside the row.
    """
    cdf = weights.cumsum(dim=-1)
    total = cdf[:, -1]
    x = torch.minimum((u * total.double()).float(), torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, x.view(-1, 1), right=True).view(-1)


# top_p and typical_p look for their kept set among the best candidates
# first, in growing tiers (a partial top-k is far cheaper than sorting the
# vocabulary); only rows whose candidates do not reach the requested mass
# (very flat distributions) pay for a full sort. One tier: on CPU a larger
# top-k (4096) measured slower than numpy's full sort.
_CANDIDATE_TIERS = (256,)


def _tiers(vocab: int) -> list[int]:
    return [k for k in _CANDIDATE_TIERS if k < vocab]


# numpy's vectorised sorts are several times faster than torch's on CPU
# (measured 10x for values, 3x for indices at [64, 49152]).
def _sort_values_descending(values: torch.Tensor) -> torch.Tensor:
    if values.device.type != "cpu":
        return torch.sort(values, dim=-1, descending=True).values
    ascending = np.sort(values.numpy(), axis=-1)
    return torch.from_numpy(np.ascontiguousarray(ascending[:, ::-1]))


def _argsort(values: torch.Tensor) -> torch.Tensor:
    if values.device.type != "cpu":
        return torch.sort(values, dim=-1).indices
    return torch.from_numpy(np.argsort(values.numpy(), axis=-1)).long()


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

    threshold = torch.empty_like(top_p)
    pending = torch.arange(len(probs), device=probs.device)
    for k in _tiers(probs.shape[-1]):
        candidates = torch.topk(probs[pending], k, dim=-1).values
        covered = candidates.sum(dim=-1) >= top_p[pending].view(-1)
        done = pending[covered]
        threshold[done] = smallest_kept(candidates[covered], top_p[done])
        pending = pending[~covered]
        if not len(pending):
            break
    if len(pending):
        threshold[pending] = smallest_kept(_sort_values_descending(probs[pending]), top_p[pending])
    return scores.masked_fill(probs < threshold, -math.inf)


def _min_p(scores: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    # p < min_p * p_max  <=>  score < score_max + log(min_p): no softmax
    # needed. The top token always passes.
    threshold = scores.amax(dim=-1, keepdim=True) + min_p.view(-1, 1).log()
    return scores.masked_fill(scores < threshold, -math.inf)


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

    threshold = torch.empty_like(mass)
    pending = torch.arange(len(scores), device=scores.device)
    for k in _tiers(scores.shape[-1]):
        order = torch.topk(distance[pending], k, dim=-1, largest=False).indices
        found, reached = farthest_kept(order, mass[pending], distance[pending], probs[pending])
        covered = reached >= mass[pending].view(-1)
        threshold[pending[covered]] = found[covered]
        pending = pending[~covered]
        if not len(pending):
            break
    if len(pending):
        order = _argsort(distance[pending])
        threshold[pending], _ = farthest_kept(order, mass[pending], distance[pending], probs[pending])
    return scores.masked_fill(distance > threshold, -math.inf)


def _report(processed: torch.Tensor, chosen: torch.Tensor, batch: _BatchParams) -> list[SampledToken]:
    chosen_list = chosen.tolist()
    results = [SampledToken(t, math.nan, []) for t in chosen_list]
    if not batch.logprob_rows:
        return results
    sel = torch.tensor(batch.logprob_rows, device=processed.device)
    # log_softmax(x)[t] = x[t] - logsumexp(x): only the reported entries are
    # computed, not a whole [rows, vocab] log_softmax.
    part = _take_rows(processed, sel)
    log_total = torch.logsumexp(part, dim=-1, keepdim=True)
    chosen_logprob = (part.gather(1, chosen[sel].view(-1, 1)) - log_total).view(-1).tolist()
    n_max = max(batch.top_n[i] for i in batch.logprob_rows)
    if n_max:
        top_values, top_ids = torch.topk(part, n_max, dim=-1)
        top_values, top_ids = (top_values - log_total).tolist(), top_ids.tolist()
    for k, i in enumerate(batch.logprob_rows):
        results[i].logprob = chosen_logprob[k]
        n = batch.top_n[i]
        if n:
            results[i].top_tokens = list(zip(top_ids[k][:n], top_values[k][:n]))
    return results
