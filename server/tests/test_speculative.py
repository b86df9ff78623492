"""Speculative decoding on the shard: draft tokens verified in the step.

- Greedy and seeded-sampled requests emit exactly the tokens they emit
  without drafts, whatever the drafts were (right, partly right, wrong), alone
  or batched with others, logprobs included; the shard keeps KV for accepted
  drafts only and cuts its block table as the proto says.
- The emitted token's distribution is the model's (chi-square against the
  exact probabilities): rejection sampling against a point-mass proposal.
- Malformed drafts fail the step.
"""

from __future__ import annotations

import math

import pytest
import torch

from sluice_server.batch import InvalidStep, RequestState, Work
from sluice_server.model_runner import ModelRunner
from sluice_server.pb import shard_pb2
from sluice_server.servicer import Shard

from conftest import Driver
from _router_steps import BLOCK, PROMPTS, SAMPLING_IDS, SAMPLINGS, Requests, no_drafts, runner, shard  # noqa: F401 (fixtures)


def oracle(reference: dict[int, list[int]], prompts: dict[int, list[int]], k: int):
    """Drafts from the known output, with one token made wrong at a varying
    place (or none): every acceptance length from 0 to k occurs."""

    def propose(rid, tokens, step):
        done = len(tokens) - len(prompts[rid])
        draft = list(reference[rid][done : done + k])
        wrong = step % (k + 2)
        if wrong < len(draft):
            draft[wrong] = (draft[wrong] + 1) % 128
        return draft

    return propose


@pytest.mark.parametrize("params", SAMPLINGS, ids=SAMPLING_IDS)
def test_drafts_never_change_the_tokens(runner, params):
    """Three requests batched together emit the same tokens, logprobs and
    top tokens with drafts (every acceptance length) as without."""
    n = 20
    all_params = {rid: params for rid in PROMPTS}
    runner.allocate_kv_cache(512)
    plain = Requests(Shard(runner, urls=[]))
    reference = plain.run(PROMPTS, all_params, n, no_drafts)
    runner.allocate_kv_cache(512)
    speculating = Requests(Shard(runner, urls=[]))
    got = speculating.run(PROMPTS, all_params, n, oracle(reference, PROMPTS, k=3))
    assert got == reference
    assert 0 < speculating.accepted < speculating.drafted
    for rid in PROMPTS:
        for a, b in zip(plain.emitted[rid][:n], speculating.emitted[rid][:n]):
            if params.logprobs:
                assert abs(a.logprob - b.logprob) < 1e-4
            assert [t.token_id for t in a.top_tokens] == [t.token_id for t in b.top_tokens]


def test_useless_drafts_cost_nothing_but_the_step(shard):
    """Drafts that are always wrong: one token per step, the same tokens."""
    params = {rid: shard_pb2.SamplingParams() for rid in PROMPTS}
    reference = Requests(shard).run(PROMPTS, params, 8, no_drafts)
    shard.clear()
    run = Requests(shard)
    got = run.run(PROMPTS, params, 8, lambda rid, tokens, step: [(reference[rid][len(tokens) - len(PROMPTS[rid])] + 1) % 128] * 3)
    assert got == reference and run.accepted == 0


# --- the distribution ------------------------------------------------------

# Chi-square upper quantile for a false-failure rate of 1e-4 per check
# (Wilson-Hilferty approximation, within 1% for df >= 3; z = 3.719).
ALPHA_Z = 3.719


def chi_square_limit(df: int) -> float:
    return df * (1 - 2 / (9 * df) + ALPHA_Z * math.sqrt(2 / (9 * df))) ** 3


def chi_square(observed: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic with bins of expected count < 5 pooled into one."""
    total = observed.sum()
    expected = probs.double() * total
    assert observed[probs == 0].sum() == 0, "a token of probability 0 was emitted"
    big = expected >= 5
    obs = torch.cat([observed[big].double(), observed[~big].sum().view(1).double()])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return stat, int(keep.sum()) - 1


def emitted_tokens(runner: ModelRunner, prompt: list[int], draft: list[int], params, seeds: range) -> list[list[int]]:
    """For each seed, the tokens a fresh request emits in one step that
    prefills `prompt` and verifies `draft` (one batch of len(seeds) requests)."""
    per = -(-(len(prompt) + len(draft)) // BLOCK)
    runner.allocate_kv_cache(per * len(seeds))
    work = []
    for i, seed in enumerate(seeds):
        p = shard_pb2.SamplingParams()
        p.CopyFrom(params)
        p.seed = seed
        blocks = list(range(i * per, (i + 1) * per))
        state = RequestState(id=i, token_ids=list(prompt), num_prompt_tokens=len(prompt), num_computed_tokens=0,
                             block_ids=blocks, params=p)
        work.append(Work(state, 0, len(prompt), blocks, list(draft)))
    out = runner.run_step(work)
    assert not out.sampled
    by_id = {w.state.id: [t.token_id for t in emitted] for w, emitted in out.verified}
    return [by_id[i] for i in range(len(seeds))]


def model_probs(runner: ModelRunner, tokens: list[int], temperature: float, top_k: int = 0) -> torch.Tensor:
    """The distribution of the token after `tokens`: softmax(logits / T) over the top k."""
    driver = Driver(runner, num_blocks=16)
    state = driver.request(0, tokens)
    driver.step([(state, len(tokens))])
    logits = driver.computed(0, len(tokens) - 1, len(tokens))[0] / temperature
    if top_k:
        cut = logits.topk(top_k).values[-1]
        logits = logits.masked_fill(logits < cut, -math.inf)
    return torch.softmax(logits.double(), dim=-1)


@pytest.mark.parametrize("which", ["likely", "unlikely"])
# A random tiny model is nearly uniform over its 128 tokens: low temperatures
# make drafts likely enough to be accepted often (p(likely) ~ 0.3).
@pytest.mark.parametrize("temperature,top_k", [(0.05, 0), (0.04, 12)])
def test_emitted_tokens_follow_the_model_distribution(runner, which, temperature, top_k):
    """4,000 seeded requests verify a one- or two-token draft. The first
    emitted token follows p(. | prompt), and the second one (when the first
    draft was accepted) p(. | prompt + draft[0]): Pearson's chi-square below
    its 1e-4 quantile. Each check fails by chance with probability 1e-4; the
    seeds are fixed, so the test gives the same answer every run. An
    always-accepted draft, a residual that keeps the draft, or a draw at the
    wrong position makes the statistic explode."""
    prompt = [3, 17, 29, 4, 4, 60, 2, 9]
    p0 = model_probs(runner, prompt, temperature, top_k)
    ranked = p0.argsort(descending=True).tolist()
    d0 = ranked[0] if which == "likely" else ranked[3]
    p1 = model_probs(runner, prompt + [d0], temperature, top_k)
    d1 = int(p1.argmax())
    params = shard_pb2.SamplingParams(temperature=temperature, top_k=top_k)
    emitted = emitted_tokens(runner, prompt, [d0, d1], params, range(4000))

    first = torch.bincount(torch.tensor([e[0] for e in emitted]), minlength=len(p0))
    stat, df = chi_square(first, p0)
    assert stat < chi_square_limit(df), (stat, df)
    accepted = [e for e in emitted if e[0] == d0]
    assert abs(len(accepted) / len(emitted) - float(p0[d0])) < 4 * math.sqrt(float(p0[d0]) / len(emitted)) + 1e-3
    if len(accepted) >= 100:
        second = torch.bincount(torch.tensor([e[1] for e in accepted]), minlength=len(p1))
        stat, df = chi_square(second, p1)
        assert stat < chi_square_limit(df), (stat, df)
    assert all(len(e) == 1 or e[0] == d0 for e in emitted)


# --- malformed drafts ------------------------------------------------------


def test_drafts_only_on_a_sampling_step(shard):
    r = shard.step(
        shard_pb2.StepRequest(
            new_requests=[
                shard_pb2.NewRequest(
                    id=1, token_ids=[1, 2, 3, 4, 5, 6], num_prompt_tokens=6, num_computed_tokens=0,
                    num_new_tokens=3, block_ids=[0, 1, 2], params=shard_pb2.SamplingParams(),
                )
            ]
        )
    )
    assert not r.generations
    chunk = shard_pb2.ScheduledRequest(id=1, num_new_tokens=2, draft_token_ids=[7])
    with pytest.raises(InvalidStep, match="does not sample"):
        shard.step(shard_pb2.StepRequest(scheduled=[chunk]))
    too_long = shard_pb2.ScheduledRequest(id=1, num_new_tokens=3, draft_token_ids=[7] * 7)
    with pytest.raises(InvalidStep, match="cannot hold"):
        shard.step(shard_pb2.StepRequest(scheduled=[too_long]))
    bad_id = shard_pb2.ScheduledRequest(id=1, num_new_tokens=3, draft_token_ids=[500])
    with pytest.raises(InvalidStep, match="vocab_size"):
        shard.step(shard_pb2.StepRequest(scheduled=[bad_id]))
    # Nothing changed: the request still runs.
    r = shard.step(shard_pb2.StepRequest(scheduled=[shard_pb2.ScheduledRequest(id=1, num_new_tokens=3, draft_token_ids=[7])]))
    assert 1 <= len(r.generations) <= 2
