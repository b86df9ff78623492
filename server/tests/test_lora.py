"""LoRA adapters in the shard: PEFT folders checked and loaded into slots,
and a step mixing the base model and several adapters giving each sequence
the logits of transformers + peft (float32); with bfloat16 stacks
(--lora-dtype) within the bound their rounding allows."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from sluice_server.adapters import AdapterError, AdapterSlots
from sluice_server.batch import ShardLimits, check_step
from sluice_server.layers.lora import build_segments
from sluice_server.model_runner import ModelRunner
from sluice_server.pb import shard_pb2
from sluice_server.testing import make_lora_adapter

from conftest import Driver, make_tiny_model

ATOL = 1e-4
# The logit error bfloat16 stacks may add (each A and B weight rounded to 8
# significant bits; 0.021 at most measured on these cases, where the
# adapters move the tiny model's logits by up to 0.6 and 0.9).
BF16_ATOL = 5e-2
# (seed, rank, alpha, targets, rslora): one adapter of attention only, one of
# every module, with rslora scaling.
ADAPTERS = {
    "attn": (11, 4, 8.0, ("q_proj", "v_proj"), False),
    "all": (12, 8, 16.0, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), True),
}


def prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (length,), generator=g).tolist()


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("lora-base"), "llama", seed=3)


@pytest.fixture(scope="module")
def root(tmp_path_factory, base):
    """The allowed adapter folder, holding one adapter per ADAPTERS entry."""
    folder = tmp_path_factory.mktemp("lora-root")
    for name, (seed, r, alpha, targets, rslora) in ADAPTERS.items():
        make_lora_adapter(base, folder / name, seed, r=r, alpha=alpha, target_modules=targets, use_rslora=rslora)
    return folder


@pytest.fixture(scope="module", params=["torch", "cpu", "cpu-bfloat16"])
def runner(request, base, root):
    """The grouped matmul in plain torch, and the C++ kernel (which the CPU
    path of the shard uses) on float32 and on bfloat16 stacks. `atol`: the
    logit error allowed against peft."""
    runner = ModelRunner(base, dtype="float32", block_size=4, max_loras=3, max_lora_rank=8, lora_roots=[root])
    kernel, _, stacks = request.param.partition("-")
    if kernel == "cpu" and runner.lora_kernel() != "cpu":
        pytest.skip("the CPU kernels are not loaded")
    runner.adapters.allocate(kernel, getattr(torch, stacks or "float32"))
    runner.atol = BF16_ATOL if stacks else ATOL
    runner.adapters.load(1, str(root / "attn"))
    runner.adapters.load(3, str(root / "all"))
    return runner


def peft_logits(base, adapter, tokens: list[int]) -> torch.Tensor:
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def test_segments_group_rows_by_slot():
    # Sequences (rows, slot) in batch order: decodes, then two chunks.
    segments = build_segments([1, 1, 1, 1, 1, 3, 2, 4], [0, 2, 2, 1, 0, 0, 2, 2], torch.device("cpu"))
    assert list(zip(segments.starts, segments.ends, segments.slots)) == [(1, 3, 1), (3, 4, 0), (8, 14, 1)]
    assert segments.slots_t.tolist() == [1, 0, 1] and segments.rows == 9 and segments.step_rows == 14
    assert build_segments([1, 5], [0, 0], torch.device("cpu")) is None


def test_a_steps_segments_are_checked_once_for_every_layer(runner):
    """The layers call the kernel without checking the segments' values
    (120 calls a step on the bundled model): the step checks them when it
    starts, and a segment past the step's rows or on a slot that does not
    exist stops it before any layer reads it."""
    for lens, slots, rows in (([2, 3], [1, 2], 4), ([2, 3], [1, 4], 5)):
        segments = build_segments(lens, slots, torch.device("cpu"))
        segments.step_rows = rows
        with pytest.raises(ValueError, match="not inside the 4 rows|not below 3"):
            with runner.adapters.applied(segments):
                pytest.fail("the step ran on bad segments")
    assert runner.adapters.context.segments is None


def test_mixed_step_matches_peft(base, root, runner):
    """Base, `attn` (slot 1) and `all` (slot 3) sequences in the same steps
    (prefill chunks, then decodes), each equal to transformers + peft."""
    d = Driver(runner)
    cases = {1: (None, 0), 2: ("attn", 1), 3: ("all", 3), 4: ("attn", 1), 5: ("all", 3)}
    tokens = {rid: prompt(13 + 3 * rid, rid) for rid in cases}
    states = {}
    for rid, (_, slot) in cases.items():
        states[rid] = d.request(rid, tokens[rid])
        states[rid].adapter_slot = slot
    d.step([(states[rid], len(tokens[rid]) - 3) for rid in cases])
    for _ in range(3):
        d.step([(states[rid], 1) for rid in cases])
    logits = {}
    for rid, (name, _) in cases.items():
        want = peft_logits(base, None if name is None else root / name, tokens[rid])
        torch.testing.assert_close(d.computed(rid, 0, len(tokens[rid])), want, atol=runner.atol, rtol=0)
        logits[name] = want
    # The test could fail: every adapter changes the model's output.
    assert not torch.allclose(logits[None][:5], logits["attn"][:5], atol=1e-2)


def test_an_adapter_runs_alone_and_unloads(base, root, runner):
    d = Driver(runner)
    tokens = prompt(20, 9)
    state = d.request(1, tokens)
    state.adapter_slot = 3
    d.step([(state, 20)])
    want = peft_logits(base, root / "all", tokens)
    torch.testing.assert_close(d.computed(1, 0, 20), want, atol=runner.atol, rtol=0)
    runner.adapters.load(2, str(root / "all"))
    runner.adapters.unload(2)
    assert runner.adapters.held_slots() == {1, 3}
    assert all(m.lora.a[1].abs().sum() == 0 for m in runner.adapters.layers.values())


def test_step_naming_an_empty_slot_fails_that_request(runner):
    limits = ShardLimits(num_blocks=16, block_size=4, vocab_size=128, adapter_slots=runner.adapters.held_slots())
    step = shard_pb2.StepRequest(new_requests=[
        shard_pb2.NewRequest(id=rid, token_ids=[5, 6], num_prompt_tokens=2, num_new_tokens=2, block_ids=[rid],
                             params=shard_pb2.SamplingParams(), adapter_slot=slot)
        for rid, slot in ((1, 1), (2, 2), (3, 0))
    ])
    checked = check_step({}, step, limits)
    assert [w.state.id for w in checked.work] == [1, 3]
    assert checked.errors == [(2, "adapter slot 2 holds no adapter")]


@pytest.fixture
def bad(root):
    """bad(edit): a copy of the `attn` adapter in the root, changed by
    edit(copy); the path to load. Removed after the test."""
    copy = root / "bad"

    def make(edit) -> str:
        shutil.copytree(root / "attn", copy)
        edit(copy)
        return str(copy)

    yield make
    shutil.rmtree(copy, ignore_errors=True)


def set_config(**changes):
    def edit(folder):
        path = folder / "adapter_config.json"
        config = json.loads(path.read_text())
        config.update(changes)
        path.write_text(json.dumps(config))
    return edit


@pytest.mark.parametrize("case, edit, message", [
    ("rank", set_config(r=16), "rank r=16 is above this server's --max-lora-rank 8"),
    ("dora", set_config(use_dora=True), "DoRA adapters are not supported"),
    ("bias", set_config(bias="all"), "bias must be \"none\""),
    ("not lora", set_config(peft_type="IA3"), "only LORA adapters are served"),
    ("no config", lambda f: (f / "adapter_config.json").unlink(), "not a PEFT adapter folder"),
    ("pickled", lambda f: (f / "adapter_model.safetensors").rename(f / "adapter_model.bin"), "pickled weights"),
    ("damaged", lambda f: (f / "adapter_model.safetensors").write_bytes(b"\x10\x00garbage"), "cannot be read"),
])
def test_bad_adapters_are_refused_with_the_reason(runner, bad, case, edit, message):
    path = bad(edit)
    with pytest.raises(AdapterError, match=message.replace("(", r"\(").replace("+", r"\+")):
        runner.adapters.read(path)


def test_wrong_base_shape_and_targets_are_refused(runner, root, tmp_path):
    other = make_tiny_model(tmp_path / "other-base", "llama", hidden_size=32, intermediate_size=48)
    make_lora_adapter(other, root / "other", 1)
    make_lora_adapter(runner.model_dir, root / "embed", 2, target_modules=("q_proj", "lm_head"))
    try:
        with pytest.raises(AdapterError, match=r"trained for another base model"):
            runner.adapters.read(str(root / "other"))
        with pytest.raises(AdapterError, match=r"q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"):
            runner.adapters.read(str(root / "embed"))
        # A failed load leaves its slot empty, the others as they were.
        with pytest.raises(AdapterError):
            runner.adapters.load(2, str(root / "other"))
        assert runner.adapters.held_slots() == {1, 3}
    finally:
        shutil.rmtree(root / "embed")
        shutil.rmtree(root / "other")


def test_paths_outside_the_roots_are_refused(base, root, tmp_path):
    slots = AdapterSlots(ModelRunner(base, dtype="float32", block_size=4).model, 2, 8, [root / "attn"])
    slots.read(str(root / "attn"))
    with pytest.raises(AdapterError, match="outside the allowed adapter folders"):
        slots.read(str(root / "all"))
    with pytest.raises(AdapterError, match="outside the allowed"):
        slots.read(str(root / "attn" / ".." / "all"))
    link = root / "attn" / "escape"
    link.symlink_to(root / "all")
    try:
        with pytest.raises(AdapterError, match="outside the allowed"):
            slots.read(str(link))
    finally:
        link.unlink()
    with pytest.raises(AdapterError, match="does not exist"):
        slots.read(str(root / "attn" / "missing"))
    with pytest.raises(AdapterError, match="--lora-root"):
        AdapterSlots(slots.model, 2, 8, []).read(str(root / "attn"))
