"""sluice-bench workloads: exact prompt lengths with real (small, trained here)
tokenizers, the shared-prefix layout, and seeded determinism."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest
from _bench_fakes import FakeServer, byte_level_bpe, metaspace_bpe_with_bos

from sluice_bench.workloads import (
    LocalTokenizer,
    RemoteTokenizer,
    WorkloadSpec,
    build_plan_sync,
    exact_text,
    parse_tokenize_response,
)

TOKENIZERS = {"byte-level": byte_level_bpe(), "metaspace+bos": metaspace_bpe_with_bos()}


@pytest.fixture(params=list(TOKENIZERS))
def tok(request):
    return TOKENIZERS[request.param]


def n_tokens(tok, text: str) -> int:
    return len(tok.encode(text).ids)


def test_exact_text_hits_every_length(tok):
    counter = LocalTokenizer(tok, "test")
    floor = n_tokens(tok, "")  # 1 with a BOS, 0 without
    for target in [floor, floor + 1, floor + 2, 7, 31, 256, 1024]:
        text = asyncio.run(exact_text(counter, target, random.Random(target)))
        assert n_tokens(tok, text) == target


def test_too_short_a_target_is_a_clear_error():
    counter = LocalTokenizer(TOKENIZERS["metaspace+bos"], "test")  # BOS alone is 1 token
    with pytest.raises(ValueError, match="cannot build a prompt of 0 tokens"):
        asyncio.run(exact_text(counter, 0, random.Random(0)))


def test_random_workload_prompts_have_the_exact_length(tok):
    spec = WorkloadSpec(kind="random", num_prompts=6, input_len=256, output_len=16)
    plan = build_plan_sync(spec, LocalTokenizer(tok, "test"), seed=3)
    assert len(plan.sessions) == 6 and plan.num_requests() == 6
    for s in plan.sessions:
        (turn,) = s.turns
        assert n_tokens(tok, turn.prompt) == 256 == turn.expected_prompt_tokens
        assert turn.max_tokens == 16
    assert len({s.turns[0].prompt for s in plan.sessions}) == 6


def test_shared_prefix_layout_and_lengths(tok):
    spec = WorkloadSpec(kind="shared-prefix", num_groups=2, prompts_per_group=4, system_prompt_len=128,
                        question_len=32, output_len=8)
    plan = build_plan_sync(spec, LocalTokenizer(tok, "test"), seed=0)
    assert [s.group for s in plan.sessions] == [0, 0, 0, 0, 1, 1, 1, 1]
    systems = [s.turns[0].system for s in plan.sessions]
    assert len(set(systems[:4])) == 1 and len(set(systems[4:])) == 1 and systems[0] != systems[4]
    for s in plan.sessions:
        t = s.turns[0]
        assert t.prompt == t.system + t.user
        assert n_tokens(tok, t.system) == 128
        assert n_tokens(tok, t.prompt) == 160 == t.expected_prompt_tokens
        # the system prompt's tokens are a token-level prefix of the full prompt,
        # so a prefix cache can serve them
        assert tok.encode(t.prompt).ids[:128] == tok.encode(t.system).ids
    assert len({s.turns[0].user for s in plan.sessions}) == 8


def test_multi_turn_plan_and_chat_expectations():
    tok = TOKENIZERS["byte-level"]
    spec = WorkloadSpec(kind="multi-turn", num_conversations=3, num_turns=4, input_len=20, output_len=8)
    plan = build_plan_sync(spec, LocalTokenizer(tok, "test"), seed=0, chat=True)
    assert [len(s.turns) for s in plan.sessions] == [4, 4, 4]
    for s in plan.sessions:
        for t in s.turns:
            assert n_tokens(tok, t.user) == 20
            assert t.expected_prompt_tokens is None  # a chat template makes it unknowable


def test_same_seed_same_plan_other_seed_other_plan():
    counter = LocalTokenizer(TOKENIZERS["byte-level"], "test")
    spec = WorkloadSpec(kind="random", num_prompts=5, input_len=64, output_len=4)
    a, b = build_plan_sync(spec, counter, 7), build_plan_sync(spec, counter, 7)
    c = build_plan_sync(spec, counter, 8)
    prompts = lambda p: [s.turns[0].prompt for s in p.sessions]  # noqa: E731
    assert prompts(a) == prompts(b)
    assert prompts(a) != prompts(c)


@pytest.mark.parametrize("bad, message", [
    (dict(kind="nope"), "unknown workload"),
    (dict(kind="random", input_len=0), "input-len must be at least 1"),
    (dict(kind="shared-prefix", question_len=0), "question-len"),
    (dict(kind="multi-turn", num_turns=0), "num-turns"),
    (dict(kind="random", output_len=0), "output-len"),
])
def test_bad_workload_sizes_are_rejected(bad, message):
    with pytest.raises(ValueError, match=message):
        WorkloadSpec(**bad).validate()


def test_tokenize_dialects():
    assert parse_tokenize_response([{"id": 1}, {"id": 2}]) == 2            # TGI / Sluice
    assert parse_tokenize_response({"count": 3, "tokens": [1, 2, 3]}) == 3  # vLLM
    assert parse_tokenize_response({"tokens": [5, 6]}) == 2                 # llama.cpp
    with pytest.raises(ValueError, match="unrecognised"):
        parse_tokenize_response({"what": 1})


@pytest.mark.parametrize("dialect", ["tgi", "vllm", "llama.cpp"])
def test_remote_tokenizer_builds_the_same_prompts_as_the_local_one(dialect):
    tok = TOKENIZERS["metaspace+bos"]
    spec = WorkloadSpec(kind="random", num_prompts=3, input_len=50, output_len=4)

    async def remote_plan(url):
        async with httpx.AsyncClient() as client:
            from sluice_bench.workloads import build_plan

            return await build_plan(spec, RemoteTokenizer(client, url, "fake-model", {}), seed=1)

    with FakeServer(tok, tokenize_dialect=dialect) as server:
        remote = asyncio.run(remote_plan(server.url))
    local = build_plan_sync(spec, LocalTokenizer(tok, "test"), seed=1)
    assert [s.turns[0].prompt for s in remote.sessions] == [s.turns[0].prompt for s in local.sessions]


def test_local_tokenizer_loads_a_file_and_a_folder(tmp_path):
    TOKENIZERS["byte-level"].save(str(tmp_path / "tokenizer.json"))
    for path in (tmp_path / "tokenizer.json", tmp_path):
        counter = LocalTokenizer.load(path)
        assert asyncio.run(counter.count(" the river")) == n_tokens(TOKENIZERS["byte-level"], " the river")
    with pytest.raises(ValueError, match="does not exist"):
        LocalTokenizer.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read tokenizer file"):
        LocalTokenizer.load(tmp_path / "bad.json")
