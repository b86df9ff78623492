"""Shard-side request state, Step validation, and the flattened batch.

A Step is checked whole before anything changes (`check_step`): a malformed
step raises `InvalidStep` and leaves every request as it was. A checked step
lists the work of the step, one `Work` per request, which `build_batch` turns
into the tensors the model runs on.

Each request computes tokens [start, end) of its token_ids this step,
start = num_computed_tokens, end = start + num_new_tokens:

    token_ids:  t0 t1 t2 t3 t4 t5 t6 t7 t8
                |-- cached --|-- new --|
                0          start      end = len(token_ids) -> a token is sampled

Only a request whose `end` reaches len(token_ids) gets logits for sampling;
one with prompt_logprobs also gets logits for each new prompt position.

Speculative decoding: a sampling request may carry K draft tokens, computed
after its own tokens as extra query tokens, with logits at each of the K + 1
last positions (verification, in model_runner):

    token_ids:  t0 ... t(L-2) t(L-1) | d0 d1 d2        L = len(token_ids), K = 3
                       start   end=L |
    query:                    t(L-1)  d0 d1 d2         query_len = 1 + K
    logits rows:              L-1     L  L+1 L+2       draws for positions L .. L+K

LoRA: a request on an adapter slot has its rows in that slot's segment
(layers.lora): decodes and prefill chunks are each ordered by slot, so the
rows of one adapter are consecutive.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sluice_server import sampling
from sluice_server.layers.attention import AttentionMetadata
from sluice_server.layers.lora import LoraSegments, build_segments
from sluice_server.pb import shard_pb2


class InvalidStep(ValueError):
    """The Step as a whole is malformed (maps to gRPC INVALID_ARGUMENT)."""


@dataclass
class RequestState:
    id: int
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    block_ids: list[int]
    params: shard_pb2.SamplingParams
    # Logprobs of prompt tokens computed so far (prompt_logprobs only); sent
    # with the request's first generation, then None.
    prompt_logprobs: list[tuple[int, float]] | None = None
    # The request's output constraint (constraints.Grammar), when it has one.
    grammar: object | None = None
    # params.logit_bias as tensors (sampling.logit_bias_tensors), built once.
    logit_bias: object | None = None
    # The adapter slot whose LoRA applies to the request (0: the base model).
    adapter_slot: int = 0


@dataclass
class Work:
    """One request's share of a step. `block_ids` is its block table for this
    step (existing blocks plus the ones appended by this step)."""

    state: RequestState
    start: int
    num_new_tokens: int
    block_ids: list[int]
    # Proposed tokens after token_ids (speculative decoding; empty: none).
    draft: list[int] = field(default_factory=list)
    # Multi-step decode: draw up to this many tokens in the Step, stopping
    # after any of `stop_token_ids` (the proto's ScheduledRequest).
    decode_steps: int = 1
    stop_token_ids: frozenset[int] = frozenset()

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def query_len(self) -> int:
        """Tokens this step computes: the request's own, then its drafts."""
        return self.num_new_tokens + len(self.draft)

    @property
    def samples(self) -> bool:
        return self.end == len(self.state.token_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.state.prompt_logprobs is not None and self.start + 1 < self.state.num_prompt_tokens


@dataclass
class ShardLimits:
    """What this shard can hold; every id in a Step must be below these."""

    num_blocks: int
    block_size: int
    vocab_size: int
    # Adapter slots that hold an adapter (a request may name only these).
    adapter_slots: frozenset[int] = frozenset()


@dataclass
class CheckedStep:
    """A Step that passed `check_step`, as work for the model runner."""

    work: list[Work]
    # Requests admitted by this step (added to the shard's table once the step ran).
    new_states: list[RequestState]
    # Per-request errors found before running (bad parameters); not in `work`.
    errors: list[tuple[int, str]] = field(default_factory=list)


def _check_blocks(rid: int, block_ids: list[int], needed_tokens: int, limits: ShardLimits) -> None:
    for b in block_ids:
        if b >= limits.num_blocks:
            raise InvalidStep(f"request {rid}: block id {b} >= num_blocks {limits.num_blocks}")
    if len(block_ids) * limits.block_size < needed_tokens:
        raise InvalidStep(
            f"request {rid}: {len(block_ids)} blocks of {limits.block_size} slots cannot hold {needed_tokens} tokens"
        )


def _check_params(params: shard_pb2.SamplingParams, limits: ShardLimits) -> str | None:
    """A per-request parameter problem, or None (sampling's own guard)."""
    try:
        sampling.check_params(params, limits.vocab_size)
    except ValueError as e:
        return str(e)
    return None


def _check_adapter(req: shard_pb2.NewRequest, limits: ShardLimits) -> str | None:
    """A request on an adapter slot that holds nothing, or None."""
    if req.adapter_slot == 0 or req.adapter_slot in limits.adapter_slots:
        return None
    return f"adapter slot {req.adapter_slot} holds no adapter"


def _new_state(req: shard_pb2.NewRequest, limits: ShardLimits) -> RequestState:
    rid, tokens = req.id, list(req.token_ids)
    n = len(tokens)
    if n == 0:
        raise InvalidStep(f"request {rid}: token_ids is empty")
    if max(tokens) >= limits.vocab_size:
        raise InvalidStep(f"request {rid}: token id {max(tokens)} >= vocab_size {limits.vocab_size}")
    if not 0 < req.num_prompt_tokens <= n:
        raise InvalidStep(f"request {rid}: num_prompt_tokens {req.num_prompt_tokens} not in [1, {n}]")
    if req.num_computed_tokens >= n:
        raise InvalidStep(f"request {rid}: num_computed_tokens {req.num_computed_tokens} must be < {n} tokens")
    if req.num_new_tokens == 0 or req.num_computed_tokens + req.num_new_tokens > n:
        raise InvalidStep(
            f"request {rid}: num_new_tokens {req.num_new_tokens} must be in [1, {n - req.num_computed_tokens}]"
        )
    block_ids = list(req.block_ids)
    _check_blocks(rid, block_ids, req.num_computed_tokens + req.num_new_tokens, limits)
    return RequestState(
        id=rid,
        token_ids=tokens,
        num_prompt_tokens=req.num_prompt_tokens,
        num_computed_tokens=req.num_computed_tokens,
        block_ids=block_ids,
        params=req.params,
        prompt_logprobs=[] if req.params.prompt_logprobs else None,
        adapter_slot=req.adapter_slot,
    )


def check_step(requests: dict[int, RequestState], step: shard_pb2.StepRequest, limits: ShardLimits) -> CheckedStep:
    """Validates `step` against the held `requests` (after its finished_ids
    are dropped) without changing anything. Raises InvalidStep."""
    finished = set(step.finished_ids)
    seen: set[int] = set()
    checked = CheckedStep(work=[], new_states=[])
    for req in step.new_requests:
        if req.id in seen or (req.id in requests and req.id not in finished):
            raise InvalidStep(f"request {req.id} is already known to the shard (duplicate id)")
        seen.add(req.id)
        state = _new_state(req, limits)
        problem = _check_params(req.params, limits) or _check_adapter(req, limits)
        if problem is not None:
            checked.errors.append((req.id, problem))
            continue
        state.logit_bias = sampling.logit_bias_tensors(req.params)
        checked.new_states.append(state)
        checked.work.append(Work(state, state.num_computed_tokens, req.num_new_tokens, state.block_ids))
    for sched in step.scheduled:
        state = requests.get(sched.id)
        if state is None or sched.id in finished:
            raise InvalidStep(f"scheduled request {sched.id} is unknown to the shard")
        if sched.id in seen:
            raise InvalidStep(f"request {sched.id} appears twice in the step")
        seen.add(sched.id)
        remaining = len(state.token_ids) - state.num_computed_tokens
        if not 0 < sched.num_new_tokens <= remaining:
            raise InvalidStep(
                f"request {sched.id}: num_new_tokens {sched.num_new_tokens} must be in [1, {remaining}]"
            )
        block_ids = state.block_ids + list(sched.new_block_ids)
        draft = list(sched.draft_token_ids)
        if draft:
            _check_draft(state, sched.num_new_tokens == remaining, draft, limits)
        steps = max(sched.decode_steps, 1)
        if steps > 1:
            _check_decode_steps(state, sched, remaining, draft)
        needed = state.num_computed_tokens + sched.num_new_tokens + len(draft) + steps - 1
        _check_blocks(sched.id, block_ids, needed, limits)
        checked.work.append(
            Work(
                state,
                state.num_computed_tokens,
                sched.num_new_tokens,
                block_ids,
                draft,
                decode_steps=steps,
                stop_token_ids=frozenset(sched.stop_token_ids),
            )
        )
    return checked


# Most draws one Step may ask of a request (multi-step decode): bounds the
# time a Step takes whatever a router sends.
MAX_DECODE_STEPS = 64


def _check_decode_steps(
    state: RequestState, sched: shard_pb2.ScheduledRequest, remaining: int, draft: list[int]
) -> None:
    """Several draws in one Step: only for a plain decode, whose every draw
    needs nothing but the token drawn before it."""
    rid = state.id
    if sched.decode_steps > MAX_DECODE_STEPS:
        raise InvalidStep(f"request {rid}: decode_steps {sched.decode_steps} > {MAX_DECODE_STEPS}")
    if sched.num_new_tokens != 1 or remaining != 1:
        raise InvalidStep(f"request {rid}: decode_steps on a step that is not a decode")
    if draft:
        raise InvalidStep(f"request {rid}: decode_steps with draft tokens")
    if state.grammar is not None:
        raise InvalidStep(f"request {rid}: decode_steps for a constrained request")
    if state.prompt_logprobs is not None:
        raise InvalidStep(f"request {rid}: decode_steps before its prompt logprobs were sent")


def _check_draft(state: RequestState, samples: bool, draft: list[int], limits: ShardLimits) -> None:
    """Drafts are verified by sampling after them: only a step that samples,
    and neither a constrained request nor one still scoring its prompt."""
    rid = state.id
    if not samples:
        raise InvalidStep(f"request {rid}: draft tokens on a step that does not sample")
    if state.grammar is not None:
        raise InvalidStep(f"request {rid}: draft tokens for a constrained request")
    if state.prompt_logprobs is not None:
        raise InvalidStep(f"request {rid}: draft tokens before its prompt logprobs were sent")
    if max(draft) >= limits.vocab_size:
        raise InvalidStep(f"request {rid}: draft token id {max(draft)} >= vocab_size {limits.vocab_size}")


@dataclass
class Batch:
    """A step's flattened batch. T tokens, B = len(work) sequences (decodes first)."""

    work: list[Work]
    # [T] int64 token ids and their positions in their sequences.
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionMetadata
    # [N] int64: rows of the hidden states whose logits are computed.
    logits_indices: torch.Tensor
    # Per work item: [first, first + count) of its rows in the logits; count is
    # 1 (sampling only), 1 + len(draft) (verifying drafts), the chunk length
    # (prompt logprobs) or 0.
    logits_rows: list[tuple[int, int]]
    # The rows of each adapter (layers.lora); None when every row is the base model's.
    lora: LoraSegments | None = None


def build_batch(work: list[Work], block_size: int, device: torch.device) -> Batch:
    """Orders `work` decodes-first (each part by adapter slot) and builds the
    step's tensors.

    Positions and slots come from a few vectorised ops over T tokens:

        seq_of_token  = [0, 1, 2, 3, 3, 3, 3, 3, 4, 4, 4]          (repeat_interleave)
        positions     = start[seq] + (t - query_start_loc[seq])
        slot_mapping  = block_tables[seq, pos // bs] * bs + pos % bs
    """
    work = sorted(work, key=lambda w: (w.query_len != 1, w.state.adapter_slot))
    num_decodes = sum(1 for w in work if w.query_len == 1)
    q_lens = [w.query_len for w in work]
    seq_lens = [w.end + len(w.draft) for w in work]
    starts = [w.start for w in work]
    tokens: list[int] = []
    for w in work:
        tokens.extend(w.state.token_ids[w.start : w.end])
        tokens.extend(w.draft)
    max_blocks = max(-(-e // block_size) for e in seq_lens)
    tables = [w.block_ids[:max_blocks] + [0] * (max_blocks - len(w.block_ids[:max_blocks])) for w in work]

    block_tables = torch.tensor(tables, dtype=torch.int64)
    if num_decodes == len(work):
        # Decodes only, the commonest step: a token's position is its
        # sequence's start, taken from the lists (the ops below cost ~0.1 ms,
        # 2% of a SmolLM2-135M decode step on 2 cores).
        query_start_loc = torch.arange(len(work) + 1, dtype=torch.int64)
        positions = torch.tensor(starts, dtype=torch.int64)
        slots = torch.tensor([w.block_ids[p // block_size] * block_size + p % block_size for w, p in zip(work, starts)],
                             dtype=torch.int64)
    else:
        q_lens_t = torch.tensor(q_lens, dtype=torch.int64)
        query_start_loc = torch.zeros(len(work) + 1, dtype=torch.int64)
        torch.cumsum(q_lens_t, 0, out=query_start_loc[1:])
        seq_of_token = torch.repeat_interleave(torch.arange(len(work)), q_lens_t)
        offset = torch.tensor(starts, dtype=torch.int64) - query_start_loc[:-1]
        positions = torch.arange(len(tokens), dtype=torch.int64) + offset[seq_of_token]
        slots = block_tables[seq_of_token, positions // block_size] * block_size + positions % block_size

    logits_rows: list[tuple[int, int]] = []
    indices: list[int] = []
    for w, first in zip(work, query_start_loc[:-1].tolist()):
        if w.wants_prompt_logprobs:
            logits_rows.append((len(indices), w.num_new_tokens))
            indices.extend(range(first, first + w.num_new_tokens))
        elif w.samples:
            # The last own token, then each draft: 1 + len(draft) rows.
            logits_rows.append((len(indices), 1 + len(w.draft)))
            indices.extend(range(first + w.num_new_tokens - 1, first + w.query_len))
        else:
            logits_rows.append((len(indices), 0))

    attn = AttentionMetadata(
        slot_mapping=slots.to(device),
        query_start_loc=query_start_loc.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64).to(device),
        block_tables=block_tables.to(device),
        num_decodes=num_decodes,
        block_size=block_size,
        query_lens_list=q_lens,
        seq_lens_list=seq_lens,
    )
    return Batch(
        work=work,
        input_ids=torch.tensor(tokens, dtype=torch.int64).to(device),
        positions=positions.to(device),
        attn=attn,
        logits_indices=torch.tensor(indices, dtype=torch.int64).to(device),
        logits_rows=logits_rows,
        lora=build_segments(q_lens, [w.state.adapter_slot for w in work], device),
    )
