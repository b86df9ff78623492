"""Driving Shard.step as the router does, for the tests of steps that emit
several tokens per request (test_speculative.py: drafts; test_multistep.py:
several draws per Step)."""

from __future__ import annotations

import pytest

from sluice_server.model_runner import ModelRunner
from sluice_server.pb import shard_pb2
from sluice_server.servicer import Shard

BLOCK = 4

PROMPTS = {1: [5, 9, 14, 3, 3, 7, 21], 2: [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], 3: [7, 7, 7]}

# Sampling settings whose tokens a several-token step must not change.
SAMPLINGS = [
    shard_pb2.SamplingParams(logprobs=True, top_n_tokens=2),
    shard_pb2.SamplingParams(temperature=1.0, seed=11, logprobs=True),
    shard_pb2.SamplingParams(temperature=0.7, top_k=20, top_p=0.9, repetition_penalty=1.3, seed=5),
    shard_pb2.SamplingParams(temperature=1.0, frequency_penalty=0.5, presence_penalty=0.3, min_tokens=6, seed=2),
]
SAMPLING_IDS = ["greedy", "sampled", "warped", "penalties"]


@pytest.fixture(scope="module")
def runner(tiny_model_dir) -> ModelRunner:
    return ModelRunner(tiny_model_dir, block_size=BLOCK, dtype="float32")


@pytest.fixture
def shard(runner) -> Shard:
    runner.allocate_kv_cache(512)
    return Shard(runner, urls=[])


def no_drafts(rid, tokens, step):
    return []


class Requests:
    """Runs requests through Shard.step the way the router does: blocks on
    demand from a free list, for the slots a step writes (its drafts', and
    with `decode_steps` N the L + N - 1 slots of N draws), and after the step
    the block table cut to the blocks that hold computed slots (the blocks
    cut off go back to the free list, so rejected slots get reused). Every
    request stops at n tokens or after one of `stops`."""

    def __init__(self, shard: Shard):
        self.shard = shard
        self.free = list(range(shard.runner.kv_cache.num_blocks))[::-1]
        self.tokens: dict[int, list[int]] = {}
        self.blocks: dict[int, list[int]] = {}
        self.emitted: dict[int, list[shard_pb2.Generation]] = {}
        self.drafted = 0
        self.accepted = 0
        self.steps = 0

    def _grow(self, rid: int, slots: int) -> list[int]:
        need = -(-slots // BLOCK) - len(self.blocks[rid])
        new = [self.free.pop() for _ in range(need)]
        self.blocks[rid].extend(new)
        return new

    def run(self, prompts, params, n: int, propose=no_drafts, decode_steps: int = 1, stops=()) -> dict[int, list[int]]:
        """Generates n tokens for every request; propose(rid, tokens, step) -> draft."""
        new = []
        for rid, prompt in prompts.items():
            self.tokens[rid], self.blocks[rid], self.emitted[rid] = list(prompt), [], []
            self._grow(rid, len(prompt))
            new.append(
                shard_pb2.NewRequest(
                    id=rid, token_ids=prompt, num_prompt_tokens=len(prompt), num_computed_tokens=0,
                    num_new_tokens=len(prompt), block_ids=self.blocks[rid], params=params[rid],
                )
            )
        self._apply(self.shard.step(shard_pb2.StepRequest(new_requests=new)), {}, {})

        def going(rid):
            return len(self.emitted[rid]) < n and self.tokens[rid][-1] not in stops

        while any(going(rid) for rid in prompts):
            scheduled, drafts, asked = [], {}, {}
            for rid in filter(going, prompts):
                left = n - len(self.emitted[rid])
                draft = list(propose(rid, self.tokens[rid], self.steps))[: left - 1]
                draws = min(decode_steps, left) if not draft else 1
                drafts[rid], asked[rid] = draft, draws
                new_blocks = self._grow(rid, len(self.tokens[rid]) + len(draft) + draws - 1)
                scheduled.append(
                    shard_pb2.ScheduledRequest(
                        id=rid, num_new_tokens=1, new_block_ids=new_blocks, draft_token_ids=draft,
                        decode_steps=draws if draws > 1 else 0, stop_token_ids=list(stops),
                    )
                )
            self._apply(self.shard.step(shard_pb2.StepRequest(scheduled=scheduled)), drafts, asked)
            self.steps += 1
        return {rid: [g.token_id for g in self.emitted[rid][:n]] for rid in prompts}

    def _apply(self, response: shard_pb2.StepResponse, drafts: dict[int, list[int]], asked: dict[int, int]) -> None:
        assert not response.errors, response.errors
        by_id: dict[int, list[shard_pb2.Generation]] = {}
        for g in response.generations:
            by_id.setdefault(g.id, []).append(g)
        for rid, gens in by_id.items():
            draft = drafts.get(rid, [])
            if asked.get(rid, 1) > 1:
                assert 1 <= len(gens) <= asked[rid]
            else:
                accepted = len(gens) - 1
                assert 0 <= accepted <= len(draft)
                assert [g.token_id for g in gens[:accepted]] == draft[:accepted]
                self.drafted += len(draft)
                self.accepted += accepted
            self.tokens[rid].extend(g.token_id for g in gens)
            self.emitted[rid].extend(gens)
            if len(gens) > 1 or draft:
                computed = len(self.tokens[rid]) - 1
                keep = -(-computed // BLOCK)
                self.free.extend(self.blocks[rid][keep:])
                del self.blocks[rid][keep:]
                state = self.shard.requests[rid]
                assert state.num_computed_tokens == computed
                assert state.block_ids == self.blocks[rid]
                assert state.token_ids == self.tokens[rid]
