"""Constrained decoding on the shard: the bitmask layout, and random-weight
models whose sampled output nonetheless follows every grammar (regex, JSON
schema), alone or beside unconstrained requests, across a preemption, and
with a bad grammar failing only its own request."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from sluice_server import constraints
from sluice_server.model_runner import ModelRunner
from sluice_server.pb import shard_pb2
from sluice_server.servicer import Shard

from conftest import make_tiny_model

llguidance = pytest.importorskip("llguidance")

EOS = 2
# 3 special tokens + 256 byte tokens; the model has one more row (a padded
# LM head), which no grammar may ever allow.
TOKENIZER_SIZE = 259
VOCAB = 260
BLOCK = 4


def make_byte_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": EOS}
    for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet())):
        vocab[ch] = 3 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<pad>", "<s>", "</s>"])
    tok.save(str(folder / "tokenizer.json"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    folder = make_tiny_model(tmp_path_factory.mktemp("constrained-model"), "tied", seed=3, vocab_size=VOCAB)
    make_byte_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


@pytest.fixture()
def shard(model_dir) -> Shard:
    runner = ModelRunner(model_dir, block_size=BLOCK)
    shard = Shard(runner, urls=[], kv_cache_bytes=8 * 2**20)
    shard.warmup(shard_pb2.WarmupRequest(max_batch_prefill_tokens=64, max_batch_size=8, max_total_tokens=256))
    return shard


def regex_grammar(pattern: str) -> str:
    return llguidance.LLMatcher.grammar_from_regex(pattern)


def schema_grammar(schema: dict) -> str:
    layout = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    return llguidance.LLMatcher.grammar_from_json_schema(dict(schema, **{"x-guidance": layout}))


SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    },
    "required": ["color", "n", "tags"],
    "additionalProperties": False,
}


class Run:
    """Drives requests through Shard.step until each ends (EOS or a limit)."""

    def __init__(self, shard: Shard):
        self.shard = shard
        self.blocks = iter(range(shard.runner.kv_cache.num_blocks))
        self.tokens: dict[int, list[int]] = {}
        self.limits: dict[int, int] = {}
        self.errors: dict[int, str] = {}

    def new(self, rid, prompt, grammar="", seed=0, generated=(), max_tokens=64):
        tokens = list(prompt) + list(generated)
        blocks = [next(self.blocks) for _ in range(-(-(len(tokens) + max_tokens) // BLOCK))]
        self.tokens[rid] = list(generated)
        self.limits[rid] = max_tokens
        return shard_pb2.NewRequest(
            id=rid, token_ids=tokens, num_prompt_tokens=len(prompt), num_computed_tokens=0,
            num_new_tokens=len(tokens), block_ids=blocks, grammar=grammar,
            params=shard_pb2.SamplingParams(temperature=1.0, seed=seed),
        )

    def until_done(self, new_requests, stop_after=None) -> None:
        response = self.shard.step(shard_pb2.StepRequest(new_requests=new_requests))
        live = self._read(response)
        steps = 1
        while live and (stop_after is None or steps < stop_after):
            step = shard_pb2.StepRequest(scheduled=[shard_pb2.ScheduledRequest(id=r, num_new_tokens=1) for r in live])
            live = self._read(self.shard.step(step))
            steps += 1
        self.live = live

    def _read(self, response) -> list[int]:
        for error in response.errors:
            self.errors[error.id] = error.message
        live = []
        for gen in response.generations:
            self.tokens[gen.id].append(gen.token_id)
            if gen.token_id != EOS and len(self.tokens[gen.id]) < self.limits[gen.id]:
                live.append(gen.id)
        return live


def text(tokenizer, tokens: list[int]) -> str:
    assert tokens[-1] == EOS, f"did not finish: {tokens}"
    assert max(tokens) < TOKENIZER_SIZE, "a padding row of the LM head was sampled"
    return tokenizer.decode(tokens[:-1])


def test_bitmask_unpacks_token_by_token():
    rng = np.random.default_rng(0)
    bitmask = torch.from_numpy(rng.integers(-(2**31), 2**31, size=(3, 5), dtype=np.int64).astype(np.int32))
    expected = torch.tensor([[(int(bitmask[r, t // 32]) >> (t % 32)) & 1 for t in range(160)] for r in range(3)]).bool()
    for width in (150, 160, 170):
        numpy_path = constraints._unpack(bitmask, width, torch.device("cpu"))
        torch_path = constraints._unpack_torch(bitmask, width, torch.device("cpu"))
        assert numpy_path.shape == torch_path.shape == (3, width)
        assert torch.equal(numpy_path, torch_path)
        assert torch.equal(numpy_path[:, : min(width, 160)], expected[:, :width])
        assert not numpy_path[:, 160:].any()


def test_masked_rows_keep_only_allowed_tokens():
    class Fixed:
        words = 2

        def __init__(self, allowed):
            self.allowed = allowed

        def fill(self, row):
            row.zero_()
            for t in self.allowed:
                row[t // 32] |= torch.tensor(1 << (t % 32)).to(torch.int32)

    logits = torch.randn(3, 70)
    before = logits.clone()
    constraints.mask_logits(logits, [0, 2], [Fixed([1, 33]), Fixed([63])])
    assert torch.equal(logits[1], before[1])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [1, 33]
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [63]


def test_constrained_rows_follow_their_grammar_beside_free_ones(shard, tokenizer):
    run = Run(shard)
    prompt = tokenizer.encode("Answer: ").ids
    run.until_done([
        run.new(1, prompt, regex_grammar(r"[0-9]{3}-[a-z]{2}"), seed=1),
        run.new(2, prompt, schema_grammar(SCHEMA), seed=2),
        run.new(3, prompt, seed=3, max_tokens=10),
        run.new(4, prompt, regex_grammar(r"(yes|no)"), seed=4),
    ])
    assert not run.errors
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text(tokenizer, run.tokens[1]))
    value = json.loads(text(tokenizer, run.tokens[2]))
    assert value["color"] in ("red", "green", "blue") and 0 <= value["n"] <= 99 and len(value["tags"]) <= 2
    assert text(tokenizer, run.tokens[4]) in ("yes", "no")
    assert len(run.tokens[3]) == 10  # the free row was left alone
    shard.step(shard_pb2.StepRequest(finished_ids=[1, 2, 3, 4]))
    assert not shard.constrained and not shard.requests, "finished requests leave no matcher behind"


def test_a_resumed_request_continues_where_it_stopped(shard, tokenizer):
    prompt = tokenizer.encode("JSON: ").ids
    whole = Run(shard)
    whole.until_done([whole.new(1, prompt, schema_grammar(SCHEMA), seed=11)])
    shard.clear()

    # Preempted after 6 tokens: the router drops it, then sends it again
    # whole, with what it generated so far after the prompt.
    parted = Run(shard)
    parted.until_done([parted.new(1, prompt, schema_grammar(SCHEMA), seed=11)], stop_after=6)
    generated = parted.tokens[1]
    assert len(generated) == 6
    shard.step(shard_pb2.StepRequest(finished_ids=[1]))
    resumed = Run(shard)
    resumed.blocks = parted.blocks
    resumed.until_done([resumed.new(1, prompt, schema_grammar(SCHEMA), seed=11, generated=generated)])
    assert resumed.tokens[1] == whole.tokens[1]
    json.loads(text(tokenizer, whole.tokens[1]))


def test_a_bad_grammar_fails_only_its_request(shard, tokenizer):
    run = Run(shard)
    prompt = tokenizer.encode("x").ids
    run.until_done([run.new(1, prompt, "start: undefined_rule"), run.new(2, prompt, regex_grammar("ab"))])
    assert "undefined_rule" in run.errors[1]
    assert text(tokenizer, run.tokens[2]) == "ab"


def test_unconstrained_steps_do_no_constraint_work(shard, tokenizer, monkeypatch):
    def fail(*args):
        raise AssertionError("mask_logits ran for an unconstrained batch")

    monkeypatch.setattr(constraints, "mask_logits", fail)
    run = Run(shard)
    run.until_done([run.new(1, tokenizer.encode("hi").ids, max_tokens=5)])
    assert len(run.tokens[1]) == 5


def test_without_tokenizer_json_a_constraint_is_a_request_error(tmp_path):
    folder = make_tiny_model(tmp_path, "tied", vocab_size=VOCAB)
    shard = Shard(ModelRunner(folder, block_size=BLOCK), urls=[], kv_cache_bytes=2**20)
    shard.warmup(shard_pb2.WarmupRequest(max_batch_prefill_tokens=16, max_batch_size=2, max_total_tokens=32))
    response = shard.step(shard_pb2.StepRequest(new_requests=[
        shard_pb2.NewRequest(id=1, token_ids=[5, 6], num_prompt_tokens=2, num_new_tokens=2, block_ids=[0],
                             grammar=regex_grammar("a"), params=shard_pb2.SamplingParams()),
    ]))
    assert [e.id for e in response.errors] == [1]
    assert "tokenizer.json" in response.errors[0].message
