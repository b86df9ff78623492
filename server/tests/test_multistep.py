"""Multi-step decode on the shard: several draws per Step.

- Requests batched together draw the same tokens, logprobs and top tokens
  with decode_steps N as with one token per Step (greedy, seeded sampling,
  penalties, min_tokens), each stopping after its own count; the shard
  keeps the KV of every draw's input and cuts its block table as the proto
  says.
- A stop token ends a request's draws; the others go on.
- Malformed multi-step requests fail the step.
"""

from __future__ import annotations

import pytest

from sluice_server.batch import MAX_DECODE_STEPS, InvalidStep
from sluice_server.pb import shard_pb2
from sluice_server.servicer import Shard

from _router_steps import PROMPTS, SAMPLING_IDS, SAMPLINGS, Requests, runner, shard  # noqa: F401 (fixtures)


@pytest.mark.parametrize("params", SAMPLINGS, ids=SAMPLING_IDS)
def test_several_draws_per_step_never_change_the_tokens(runner, params):
    """Three requests, 21 tokens each (the prefill draws the first, then 4
    Steps of 5 draws): the tokens, logprobs and top tokens of one token per
    Step."""
    n = 21
    all_params = {rid: params for rid in PROMPTS}
    runner.allocate_kv_cache(512)
    plain = Requests(Shard(runner, urls=[]))
    reference = plain.run(PROMPTS, all_params, n, decode_steps=1)
    runner.allocate_kv_cache(512)
    multi = Requests(Shard(runner, urls=[]))
    assert multi.run(PROMPTS, all_params, n, decode_steps=5) == reference
    assert (plain.steps, multi.steps) == (n - 1, 4)
    for rid in PROMPTS:
        for a, b in zip(plain.emitted[rid], multi.emitted[rid]):
            if params.logprobs:
                assert abs(a.logprob - b.logprob) < 1e-4
            assert [t.token_id for t in a.top_tokens] == [t.token_id for t in b.top_tokens]


def test_a_stop_token_ends_only_its_requests_draws(shard):
    """The stop token is request 1's 3rd generated token: request 1 emits 3
    tokens, the others draw on (unless they meet it too)."""
    params = {rid: shard_pb2.SamplingParams() for rid in PROMPTS}
    reference = Requests(shard).run(PROMPTS, params, 12, decode_steps=1)
    stop = reference[1][2]
    shard.clear()
    got = Requests(shard).run(PROMPTS, params, 12, decode_steps=8, stops=(stop,))
    for rid in PROMPTS:
        expected = reference[rid][: reference[rid].index(stop) + 1] if stop in reference[rid] else reference[rid]
        assert got[rid] == expected
    assert len(got[1]) == 3


def _decoding(shard: Shard) -> None:
    """Request 1 prefilled 5 tokens of 9 (blocks 0, 1); request 2 decoding."""
    shard.step(
        shard_pb2.StepRequest(
            new_requests=[
                shard_pb2.NewRequest(id=1, token_ids=list(range(1, 10)), num_prompt_tokens=9, num_new_tokens=5,
                                     block_ids=[0, 1], params=shard_pb2.SamplingParams()),
                shard_pb2.NewRequest(id=2, token_ids=[3, 4, 5], num_prompt_tokens=3, num_new_tokens=3,
                                     block_ids=[2], params=shard_pb2.SamplingParams()),
            ]
        )
    )


@pytest.mark.parametrize(
    "scheduled,message",
    [
        (shard_pb2.ScheduledRequest(id=1, num_new_tokens=4, new_block_ids=[3], decode_steps=2), "not a decode"),
        (shard_pb2.ScheduledRequest(id=2, num_new_tokens=1, new_block_ids=[3], decode_steps=3, draft_token_ids=[1]),
         "with draft tokens"),
        (shard_pb2.ScheduledRequest(id=2, num_new_tokens=1, new_block_ids=[], decode_steps=3), "cannot hold 6"),
        (shard_pb2.ScheduledRequest(id=2, num_new_tokens=1, new_block_ids=list(range(3, 20)),
                                    decode_steps=MAX_DECODE_STEPS + 1), f"> {MAX_DECODE_STEPS}"),
    ],
    ids=["prefill-chunk", "draft", "too-few-blocks", "too-many-steps"],
)
def test_malformed_multi_steps_fail_the_step(shard, scheduled, message):
    _decoding(shard)
    with pytest.raises(InvalidStep, match=message):
        shard.step(shard_pb2.StepRequest(scheduled=[scheduled]))
