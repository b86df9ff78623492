"""Batched sampling: each parameter changes the distribution the way it
should, and a seeded request's tokens depend on (seed, position) alone.

Distributions are checked empirically: one row per draw, seeds 0..N-1, all
in one batched call. The seeds are fixed, so the checks are deterministic.
"""

from __future__ import annotations

import math

import pytest
import torch

from sluice_server import sampling
from sluice_server.pb import shard_pb2
from sluice_server.sampling import SamplingRow, check_params, sample

EOS = 2


def params(**kw) -> shard_pb2.SamplingParams:
    bias = kw.pop("logit_bias", {})
    p = shard_pb2.SamplingParams(**kw)
    for token, value in bias.items():
        p.logit_bias.add(token_id=token, bias=value)
    return p


def row(p: shard_pb2.SamplingParams, token_ids=(5, 6, 7), num_prompt_tokens: int | None = None) -> SamplingRow:
    token_ids = list(token_ids)
    return SamplingRow(p, token_ids, len(token_ids) if num_prompt_tokens is None else num_prompt_tokens)


def draws(logits: torch.Tensor, n: int, **kw) -> torch.Tensor:
    """n tokens from one distribution (1-D logits), seeds 0..n-1."""
    rows = [row(params(seed=s, **kw)) for s in range(n)]
    tokens = sample(logits.expand(n, -1).contiguous(), rows, [EOS])
    return torch.tensor([t.token_id for t in tokens])


def histogram(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / len(tokens)


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    observed = torch.bincount(tokens, minlength=len(probs)).double()
    expected = probs.double() * len(tokens)
    keep = expected > 0
    assert observed[~keep].sum() == 0, "a zero-probability token was drawn"
    return float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.fixture
def logits() -> torch.Tensor:
    return torch.randn(6, 1000, generator=torch.Generator().manual_seed(0)) * 3


# --- greedy ---------------------------------------------------------------


def test_greedy_is_argmax_and_never_varies(logits):
    expected = logits.argmax(dim=-1).tolist()
    for seed in range(5):
        rows = [row(params(seed=seed * 7 + i)) for i in range(len(logits))]
        assert [t.token_id for t in sample(logits, rows, [EOS])] == expected
    # The general path (asked for logprobs) agrees with the fast path.
    rows = [row(params(logprobs=True, top_n_tokens=2)) for _ in range(len(logits))]
    assert [t.token_id for t in sample(logits, rows, [EOS])] == expected


def test_top_k_1_is_greedy(logits):
    for seed in range(20):
        rows = [row(params(temperature=1.5, top_k=1, seed=seed)) for _ in range(len(logits))]
        assert [t.token_id for t in sample(logits, rows, [EOS])] == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("p", [
    params(temperature=0.7, top_p=0.5, repetition_penalty=1.3, logit_bias={3: 5.0}, seed=1),
    params(temperature=0.7, top_k=3, min_p=0.1, typical_p=0.9, seed=1),
    params(temperature=1.0, seed=1, logprobs=True),
])
def test_sampling_does_not_modify_the_callers_logits(logits, p):
    before = logits.clone()
    sample(logits, [row(p)] * len(logits), [EOS])
    assert torch.equal(logits, before)


# --- seeds ----------------------------------------------------------------


TARGETS = [
    params(temperature=1.0, seed=1234),
    params(temperature=0.8, top_k=50, top_p=0.9, min_p=0.01, typical_p=0.95,
           repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2,
           logit_bias={11: 2.0}, logprobs=True, top_n_tokens=3, seed=99),
]

OTHERS = [
    params(),
    params(temperature=0.3, seed=5),
    params(temperature=1.2, top_k=5, seed=6),
    params(temperature=1.0, top_p=0.5, seed=7),
    params(temperature=0.9, min_p=0.2, seed=8),
    params(temperature=1.0, typical_p=0.7, seed=9, logprobs=True),
    params(repetition_penalty=1.5, frequency_penalty=1.0, seed=10, min_tokens=50),
    params(temperature=2.0, logit_bias={0: 100.0}, top_n_tokens=5, seed=11),
    params(temperature=0.5, top_k=50, top_p=0.8, seed=12),  # shares the target's top_k group
]


@pytest.mark.parametrize("target", TARGETS, ids=["plain", "every-feature"])
def test_same_seed_same_tokens_alone_and_in_a_batch(target):
    gen = torch.Generator().manual_seed(1)
    vocab = 1000
    history = torch.randint(0, vocab, (40,), generator=gen).tolist()
    for step in range(15):
        target_logits = torch.randn(vocab, generator=gen)
        token_ids = history[: 20 + step]
        alone = sample(target_logits.view(1, -1), [row(target, token_ids, 20)], [EOS])[0]

        # Nine other requests at other stages, the target at a varying slot.
        where = step % (len(OTHERS) + 1)
        rows = [row(p, torch.randint(0, vocab, (3 + i,), generator=gen).tolist(), 2) for i, p in enumerate(OTHERS)]
        rows.insert(where, row(target, token_ids, 20))
        batch_logits = torch.randn(len(OTHERS) + 1, vocab, generator=gen)
        batch_logits[where] = target_logits
        in_batch = sample(batch_logits, rows, [EOS])[where]

        assert in_batch.token_id == alone.token_id
        if target.logprobs:
            assert in_batch.logprob == pytest.approx(alone.logprob, abs=1e-6)
            assert [t for t, _ in in_batch.top_tokens] == [t for t, _ in alone.top_tokens]


def test_randomness_derives_from_seed_and_position_only():
    logits = torch.zeros(1, 1000)
    p = params(temperature=1.0, seed=42)
    # Same position, different history and prompt boundary: same draw (a
    # resumed request reproduces its tokens).
    a = sample(logits, [row(p, [1, 2, 3, 4], 4)], [EOS])[0].token_id
    b = sample(logits, [row(p, [9, 8, 7, 6], 2)], [EOS])[0].token_id
    assert a == b
    # Another position: another draw (over a flat distribution of 1000 tokens,
    # 10 positions give at least 8 distinct tokens).
    tokens = {sample(logits, [row(p, [1] * n)], [EOS])[0].token_id for n in range(1, 11)}
    assert len(tokens) >= 8


def test_different_seeds_give_different_tokens():
    tokens = draws(torch.zeros(1000), 200, temperature=1.0)
    # Uniform over 1000 tokens: 200 draws have ~181 distinct values on average.
    assert len(set(tokens.tolist())) > 150


def test_uniform_is_in_unit_interval_and_spread():
    values = [sampling.uniform_for(seed, pos) for seed in range(50) for pos in range(40)]
    assert all(0.0 <= v < 1.0 for v in values)
    assert abs(sum(values) / len(values) - 0.5) < 0.02
    assert sampling.uniform_for(2**64 - 1, 2**40) != sampling.uniform_for(0, 2**40)


# --- distributions ----------------------------------------------------------


SMALL = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def test_temperature_1_matches_softmax():
    tokens = draws(SMALL, 6000, temperature=1.0)
    # chi-square with 5 degrees of freedom: 20.5 is its 0.999 quantile.
    assert chi_square(tokens, torch.softmax(SMALL, -1)) < 20.5


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_scales_logits(temperature):
    tokens = draws(SMALL, 6000, temperature=temperature)
    assert chi_square(tokens, torch.softmax(SMALL / temperature, -1)) < 20.5


def test_higher_temperature_is_flatter():
    def entropy(t: float) -> float:
        h = histogram(draws(SMALL, 3000, temperature=t), len(SMALL))
        return float(-(h[h > 0] * h[h > 0].log()).sum())

    assert entropy(0.3) < entropy(1.0) < entropy(3.0)


def test_top_k_restricts_to_k_best():
    tokens = draws(SMALL, 4000, temperature=1.0, top_k=3)
    kept = torch.softmax(SMALL[:3], -1)
    assert chi_square(tokens, torch.cat([kept, torch.zeros(3)])) < 13.8  # df 2, 0.999


def test_top_p_small_keeps_only_the_top_token():
    assert set(draws(SMALL, 500, temperature=1.0, top_p=0.01).tolist()) == {0}


def test_top_p_keeps_the_nucleus():
    logits = torch.tensor([0.5, 0.3, 0.1, 0.1]).log()
    # Mass above token 1 is 0.5 < 0.6: kept; above token 2 is 0.8: dropped.
    tokens = draws(logits, 3000, temperature=1.0, top_p=0.6)
    assert chi_square(tokens, torch.tensor([0.5, 0.3, 0, 0]) / 0.8) < 10.9  # df 1


def test_min_p_drops_unlikely_tokens():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    # Threshold 0.2 * 0.5 = 0.1: token 3 goes.
    tokens = draws(logits, 3000, temperature=1.0, min_p=0.2)
    assert chi_square(tokens, torch.tensor([0.5, 0.3, 0.15, 0]) / 0.95) < 13.8


def test_typical_p_keeps_tokens_near_the_entropy():
    # Entropy of [0.7, 0.1 x3] is 0.94 nats; -log p: 0.36 (distance 0.58),
    # 2.30 (distance 1.36). With mass 0.5 the most likely token is the
    # closest to typical and covers it alone.
    logits = torch.tensor([0.7, 0.1, 0.1, 0.1]).log()
    assert set(draws(logits, 300, temperature=1.0, typical_p=0.5).tolist()) == {0}
    # A distribution where the most likely token is atypical: [0.4, 0.15 x4]
    # has entropy 1.50; -log p: 0.92 (distance 0.58) and 1.90 (distance 0.40),
    # so the four 0.15 tokens are kept first, and mass 0.5 needs all four.
    logits = torch.tensor([0.4, 0.15, 0.15, 0.15, 0.15]).log()
    assert set(draws(logits, 400, temperature=1.0, typical_p=0.5).tolist()) == {1, 2, 3, 4}


# Each warper against its transformers counterpart, on a real-size vocabulary
# and on flat rows where the candidates do not cover the mass (full sort).
# Cumulative sums taken in another order may round differently, so a token
# whose cumulative mass sits on the boundary (within float32 error) may land
# on either side: at most one such token per row.
def _warp_inputs() -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    scales = torch.tensor([0.05, 0.5, 2.0, 5.0, 10.0]).view(-1, 1)
    return torch.randn(5, 49152, generator=gen) * scales


@pytest.mark.parametrize("value", [0.1, 0.5, 0.9, 0.99])
def test_top_p_matches_transformers(value):
    from transformers.generation.logits_process import TopPLogitsWarper

    scores = _warp_inputs()
    expected = TopPLogitsWarper(value)(None, scores.clone()).isinf()
    got = sampling._top_p(scores.clone(), torch.full((len(scores),), value)).isinf()
    assert (got != expected).sum(dim=-1).max() <= 1


@pytest.mark.parametrize("value", [0.2, 0.5, 0.9, 0.99])
def test_typical_p_matches_transformers(value):
    from transformers.generation.logits_process import TypicalLogitsWarper

    scores = _warp_inputs()
    expected = TypicalLogitsWarper(value)(None, scores.clone()).isinf()
    got = sampling._typical(scores.clone(), torch.full((len(scores),), value)).isinf()
    assert (got != expected).sum(dim=-1).max() <= 1


def test_min_p_matches_transformers():
    from transformers.generation.logits_process import MinPLogitsWarper

    scores = _warp_inputs()
    expected = MinPLogitsWarper(0.05)(None, scores.clone()).isinf()
    assert torch.equal(sampling._min_p(scores.clone(), torch.full((5,), 0.05)).isinf(), expected)


def test_top_k_on_a_real_size_vocabulary():
    scores = _warp_inputs()
    for k in (1, 7, 50, 1000):
        best = set(scores[3].topk(k).indices.tolist())
        tokens = draws(scores[3], 200, temperature=1.0, top_k=k)
        assert set(tokens.tolist()) <= best


# --- penalties, bias, min_tokens --------------------------------------------


def processed_logits(p: shard_pb2.SamplingParams, logits: torch.Tensor, token_ids, num_prompt: int) -> torch.Tensor:
    """The processed logits, up to a constant, read back from the full top-n list."""
    p = shard_pb2.SamplingParams.FromString(p.SerializeToString())
    p.top_n_tokens = len(logits)
    out = sample(logits.view(1, -1), [row(p, token_ids, num_prompt)], [EOS])[0]
    values = torch.full((len(logits),), -math.inf)
    for token, logprob in out.top_tokens:
        values[token] = logprob
    return values - values[0]  # token 0 is never penalized below


BASE = torch.tensor([0.0, 1.0, 2.0, -1.0, 0.5, -0.5, 1.5, 0.25])


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    # Tokens 2 (logit 2) and 3 (logit -1) were seen, 2 in the prompt only.
    got = processed_logits(params(repetition_penalty=2.0), BASE, [2, 3, 3], 1)
    expected = BASE.clone()
    expected[2], expected[3] = 1.0, -2.0
    torch.testing.assert_close(got, expected - expected[0])


def test_frequency_and_presence_count_generated_tokens_only():
    # Prompt [6, 4], generated [4, 4, 1]: 4 twice, 1 once; 6 only in the prompt.
    got = processed_logits(params(frequency_penalty=0.5, presence_penalty=0.25), BASE, [6, 4, 4, 4, 1], 2)
    expected = BASE.clone()
    expected[4] -= 2 * 0.5 + 0.25
    expected[1] -= 1 * 0.5 + 0.25
    torch.testing.assert_close(got, expected - expected[0])


def test_penalties_lower_the_repeated_tokens_probability():
    logits = torch.tensor([3.0, 2.9, 0.0, 0.0]).view(1, -1)
    history = [0, 0, 0]  # token 0 generated three times

    def token_0(p: shard_pb2.SamplingParams) -> tuple[float, int]:
        out = sample(logits, [row(_with(p, top_n_tokens=4), history, 0)], [EOS])[0]
        return dict(out.top_tokens)[0], out.token_id

    plain_logprob, plain_token = token_0(params())
    assert plain_token == 0
    for p in (params(repetition_penalty=1.5), params(frequency_penalty=0.5), params(presence_penalty=0.5)):
        logprob, token = token_0(p)
        assert logprob < plain_logprob
        assert token == 1


def _with(p: shard_pb2.SamplingParams, **kw) -> shard_pb2.SamplingParams:
    q = shard_pb2.SamplingParams.FromString(p.SerializeToString())
    for k, v in kw.items():
        setattr(q, k, v)
    return q


def test_logit_bias_forces_and_bans(logits):
    n = len(logits)
    forced = sample(logits, [row(params(temperature=1.0, seed=s, logit_bias={17: 100.0})) for s in range(n)], [EOS])
    assert {t.token_id for t in forced} == {17}
    best = logits.argmax(dim=-1)
    banned = sample(
        logits,
        [row(params(logit_bias={int(best[i]): -100.0})) for i in range(n)],
        [EOS],
    )
    second = logits.topk(2, dim=-1).indices[:, 1]
    assert [t.token_id for t in banned] == second.tolist()
    # Sampling never picks a banned token either.
    tokens = draws(SMALL, 1000, temperature=1.0, logit_bias={0: -100.0})
    assert 0 not in tokens.tolist()


def test_min_tokens_masks_eos_until_enough_were_generated():
    logits = torch.zeros(1, 10)
    logits[0, EOS] = 10.0
    logits[0, 9] = 9.0
    p = params(min_tokens=3)
    prompt = [4, 5]
    assert sample(logits, [row(p, prompt + [1, 1], 2)], [EOS])[0].token_id == 9  # 2 generated
    assert sample(logits, [row(p, prompt + [1, 1, 1], 2)], [EOS])[0].token_id == EOS  # 3 generated
    # Every EOS id is masked, in sampling too.
    p = params(min_tokens=3, temperature=1.0, logit_bias={EOS: 100.0, 7: 100.0})
    tokens = {sample(logits, [row(_with(p, seed=s), prompt, 2)], [EOS, 7])[0].token_id for s in range(50)}
    assert tokens.isdisjoint({EOS, 7})


# --- logprobs ---------------------------------------------------------------


def test_logprob_and_top_tokens_match_log_softmax(logits):
    n = len(logits)
    rows = [row(params(temperature=0.7, top_k=20, seed=s, logprobs=True, top_n_tokens=s + 1)) for s in range(n)]
    out = sample(logits, rows, [EOS])
    # Before temperature and truncation: the model's own distribution.
    reference = torch.log_softmax(logits, dim=-1)
    for i, token in enumerate(out):
        assert token.logprob == pytest.approx(float(reference[i, token.token_id]), abs=1e-5)
        values, ids = reference[i].topk(i + 1)
        assert [t for t, _ in token.top_tokens] == ids.tolist()
        assert [v for _, v in token.top_tokens] == pytest.approx(values.tolist(), abs=1e-5)


def test_no_logprob_unless_asked(logits):
    out = sample(logits, [row(params(temperature=1.0, seed=1))] * len(logits), [EOS])
    assert all(math.isnan(t.logprob) and t.top_tokens == [] for t in out)
    out = sample(logits, [row(params(top_n_tokens=2))] * len(logits), [EOS])
    assert all(not math.isnan(t.logprob) and len(t.top_tokens) == 2 for t in out)


def test_token_logprobs_for_prompt_tokens(logits):
    targets = torch.tensor([0, 5, 999, 3, 3, 1])
    expected = torch.log_softmax(logits, -1)[torch.arange(6), targets]
    torch.testing.assert_close(sampling.token_logprobs(logits, targets), expected)


# --- bad input ----------------------------------------------------------------


def test_a_broken_row_fails_alone(logits):
    bad = logits.clone()
    bad[1, 10] = math.nan
    for p in (params(), params(temperature=1.0, top_p=0.9, seed=3, logprobs=True)):
        out = sample(bad, [row(p)] * len(bad), [EOS])
        assert out[1].error is not None and "NaN" in out[1].error
        assert all(t.error is None for i, t in enumerate(out) if i != 1)
        if p.temperature == 0:
            assert [t.token_id for i, t in enumerate(out) if i != 1] == [
                int(x) for i, x in enumerate(logits.argmax(-1)) if i != 1
            ]
    bad = logits.clone()
    bad[2, 10] = math.inf
    out = sample(bad, [row(params(temperature=1.0, seed=1))] * len(bad), [EOS])
    assert "infinite" in out[2].error and all(t.error is None for i, t in enumerate(out) if i != 2)
    # Every token masked (all are EOS and min_tokens is not reached).
    out = sample(torch.zeros(1, 2), [row(params(min_tokens=5))], [0, 1])
    assert "masked" in out[0].error


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(top_n_tokens=5000), "top_n_tokens"),
        (dict(logit_bias={1000: 1.0}), "logit_bias"),
    ],
)
def test_check_params_names_what_reaches_past_the_vocabulary(kw, field):
    with pytest.raises(ValueError, match=field):
        check_params(params(**kw), vocab_size=1000)


def test_check_params_accepts_neutral_and_typical_values():
    check_params(params(), vocab_size=1000)
    check_params(params(temperature=0.7, top_k=40, top_p=0.95, min_p=0.05, typical_p=1.0,
                        repetition_penalty=1.1, frequency_penalty=-2.0, presence_penalty=2.0,
                        logit_bias={999: -100.0}, top_n_tokens=5, seed=2**64 - 1), vocab_size=1000)


def test_the_shard_checks_no_sampling_range_of_its_own():
    # The router is the one place sampling ranges are checked
    # (router/src/validation/sampling.rs): values it would refuse are not
    # refused a second time, differently, here.
    for kw in (dict(temperature=-0.5), dict(top_p=1.5), dict(min_p=-0.1), dict(typical_p=2.0),
               dict(repetition_penalty=-1.0), dict(frequency_penalty=math.inf)):
        check_params(params(**kw), vocab_size=1000)


def test_shape_mismatch_is_an_error(logits):
    with pytest.raises(ValueError, match="rows"):
        sample(logits, [row(params())], [EOS])


def test_logit_bias_built_once_per_request_matches_the_params(logits):
    """The shard builds a request's bias tensors when it arrives
    (batch.check_step); a step then scatters every row's biases at once."""
    from sluice_server.sampling import logit_bias_tensors

    p = params(logit_bias={3: 5.0, 17: -2.5, 40: 100.0}, logprobs=True, top_n_tokens=4)
    assert logit_bias_tensors(params()) is None
    ids, values = logit_bias_tensors(p)
    assert ids.tolist() == [3, 17, 40] and values.tolist() == [5.0, -2.5, 100.0]
    n = logits.shape[0]
    plain = sample(logits, [row(p) for _ in range(n)], [EOS])
    prebuilt = [SamplingRow(p, [1, 2], 2, logit_bias_tensors(p)) for _ in range(n)]
    assert sample(logits, prebuilt, [EOS]) == plain
    assert all(r.token_id == 40 for r in plain)


@pytest.mark.parametrize("kernels", [True, False])
def test_greedy_sampling_with_and_without_the_kernel(monkeypatch, kernels):
    """Plain greedy rows go through the C++ argmax_rows once the kernels are
    loaded, and through torch.max otherwise: the same tokens, ties to the first."""
    if kernels and not sampling.cpu_kernels.load():
        pytest.skip(f"CPU kernels not built: {sampling.cpu_kernels.unavailable_reason()}")
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(10))
    logits[2, 10] = logits[2, 900] = 99.0
    rows = [SamplingRow(shard_pb2.SamplingParams(), [1, 2], 2, None) for _ in range(6)]
    asked = []
    monkeypatch.setattr(sampling.cpu_kernels, "loaded", lambda: asked.append(kernels) or kernels)
    got = [t.token_id for t in sample(logits, rows, [0])]
    assert asked == [kernels]
    assert got == logits.argmax(dim=-1).tolist() and got[2] == 10
