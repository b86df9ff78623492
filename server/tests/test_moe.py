"""The expert layer's routing (layers/moe.py) against transformers' own
routers, gpt-oss's MXFP4 checkpoints against transformers (dense, and on
their blocks on CPU), and the rope scaling types against transformers' rope
functions. The grouped expert MLP itself is tested in kernels/tests/test_moe.py."""

from __future__ import annotations

import pytest
import torch

from sluice_server.layers import moe
from sluice_server.layers.rotary import attention_scaling, context_length, inverse_frequencies, rope_parameters
from sluice_server.model_runner import ModelRunner
from sluice_kernels import cpu_kernels
from sluice_kernels.moe import dequantize_mxfp4
from sluice_server.testing import quantize_mxfp4, to_mxfp4_checkpoint

from conftest import Driver, make_tiny_model, prefill_then_decodes, reference_logits


def spec(**kw) -> moe.MoESpec:
    return moe.MoESpec(**dict(dict(num_experts=8, top_k=3, hidden_size=64, intermediate_size=48), **kw))


def transformers_router(kind: str, logits: torch.Tensor):
    """(weights, ids) of transformers' router of `kind` for these logits, fed
    through an identity router weight (logits = x I^T)."""
    import transformers
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    e = logits.shape[1]
    if kind == "qwen3_moe":
        router = Qwen3MoeTopKRouter(transformers.Qwen3MoeConfig(num_experts=e, num_experts_per_tok=3,
                                                                 hidden_size=e, norm_topk_prob=True))
    elif kind == "qwen2_moe":  # Qwen1.5-MoE and Qwen2-57B-A14B: not renormalised
        router = Qwen2MoeTopKRouter(transformers.Qwen2MoeConfig(num_experts=e, num_experts_per_tok=3,
                                                                 hidden_size=e, norm_topk_prob=False))
    elif kind == "mixtral":
        router = MixtralTopKRouter(transformers.MixtralConfig(num_local_experts=e, num_experts_per_tok=3, hidden_size=e))
    else:
        router = GptOssTopKRouter(transformers.GptOssConfig(num_local_experts=e, num_experts_per_tok=3, hidden_size=e))
        router.bias.data.zero_()
    router.weight.data.copy_(torch.eye(e))
    _, weights, ids = router(logits)
    return weights, ids


@pytest.mark.parametrize("kind,scoring,renormalize", [
    ("qwen3_moe", moe.SOFTMAX_TOPK, True), ("mixtral", moe.SOFTMAX_TOPK, True), ("gpt_oss", moe.TOPK_SOFTMAX, True),
    ("qwen2_moe", moe.SOFTMAX_TOPK, False),
])
def test_routing_matches_transformers(kind, scoring, renormalize):
    logits = torch.randn(37, 8, generator=torch.Generator().manual_seed(0)) * 3
    weights, ids = moe.route(logits, spec(scoring=scoring, renormalize=renormalize))
    want_w, want_ids = transformers_router(kind, logits)
    # Ours lists each token's experts in ascending order (the summation order).
    order = want_ids.argsort(dim=-1)
    assert torch.equal(ids, want_ids.gather(-1, order))
    torch.testing.assert_close(weights, want_w.gather(-1, order).to(weights.dtype), atol=1e-6, rtol=0)
    assert torch.all(ids[:, :-1] < ids[:, 1:])


def test_softmax_topk_without_renormalisation_keeps_probabilities():
    """Qwen3-MoE with norm_topk_prob false: the kept probabilities sum to less than one."""
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    weights, ids = moe.route(logits, spec(renormalize=False))
    torch.testing.assert_close(weights, torch.softmax(logits, -1).gather(-1, ids))
    assert torch.all(weights.sum(-1) < 1)


def test_active_parameters_count_the_chosen_experts(tmp_path):
    """Qwen3-MoE tiny: 8 experts of 3 x 64 x 32, 2 chosen per token, in each of 2 layers."""
    folder = make_tiny_model(tmp_path, "qwen3_moe")
    runner = ModelRunner(folder, dtype="float32", pack_weights=False)
    assert runner.total_parameters == sum(p.numel() for p in runner.model.parameters())
    experts = 2 * 8 * 3 * 64 * 32
    assert runner.active_parameters == runner.total_parameters - experts + experts * 2 // 8


def test_active_parameters_count_the_shared_expert_whole(tmp_path):
    """Qwen2-MoE tiny: in each of its 2 expert layers 8 routed experts of
    3 x 64 x 32 (2 chosen per token) and a shared expert of 3 x 64 x 48 with
    its gate [1, 64], which every token runs; its dense middle layer counts whole."""
    folder = make_tiny_model(tmp_path, "qwen2_moe")
    runner = ModelRunner(folder, dtype="float32", pack_weights=False)
    assert runner.total_parameters == sum(p.numel() for p in runner.model.parameters())
    routed = 2 * 8 * 3 * 64 * 32
    assert runner.active_parameters == runner.total_parameters - routed + routed * 2 // 8
    shared = 2 * (3 * 64 * 48 + 64)
    assert sum(p.numel() for n, p in runner.model.named_parameters() if "shared_expert" in n) == shared


@pytest.mark.parametrize("change,message", [
    (dict(num_experts=0), r"qwen2_moe with num_experts 0 \(no expert layers\) is not supported"),
    (dict(shared_expert_intermediate_size=0),
     r"qwen2_moe with shared_expert_intermediate_size 0 \(no shared expert\) is not supported"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
])
def test_unsupported_qwen2_moe_variants_are_refused_by_name(tmp_path, change, message):
    import json

    folder = make_tiny_model(tmp_path, "qwen2_moe")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, **change)))
    with pytest.raises(ValueError, match=message):
        ModelRunner(folder, dtype="float32")


def test_an_indivisible_shared_expert_is_named():
    from sluice_server.models.llama import check_tensor_parallel
    from sluice_server.models.qwen2_moe import Qwen2MoeConfig
    from sluice_server.testing import TINY

    config = dict(TINY, model_type="qwen2_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                  shared_expert_intermediate_size=50)
    with pytest.raises(ValueError, match="the shared expert's intermediate size 50 is not divisible by 4"):
        check_tensor_parallel(Qwen2MoeConfig.from_dict(config), 4)


def test_a_bad_top_k_is_refused():
    with pytest.raises(ValueError, match=r"num_experts_per_tok=9 must be in \[1, num_experts=8\]"):
        spec(top_k=9)


# --- gpt-oss MXFP4 checkpoints ------------------------------------------------

def test_mxfp4_dequantizes_as_transformers_does():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    w = torch.randn(3, 40, 96, generator=torch.Generator().manual_seed(2)) * 4
    blocks, scales = quantize_mxfp4(w)
    ours = dequantize_mxfp4(blocks, scales, torch.float32)
    # transformers returns the experts transposed ([E, in, out]), as its layer multiplies.
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)
    assert torch.equal(ours, want)
    # The quantizer keeps each value within half an FP4 step of its block's scale.
    assert (ours - w).abs().max() <= (2.0 ** (scales.float() - 127)).max()


@pytest.fixture(scope="module")
def mxfp4_folder(tmp_path_factory):
    return to_mxfp4_checkpoint(make_tiny_model(tmp_path_factory.mktemp("mxfp4"), "gpt_oss", seed=4))


def test_mxfp4_checkpoint_matches_transformers(mxfp4_folder):
    """Dense: the blocks expanded at load, as transformers does on CPU."""
    runner = ModelRunner(mxfp4_folder, dtype="float32", block_size=4, pack_weights=False)
    tokens = torch.randint(3, 128, (33,), generator=torch.Generator().manual_seed(3)).tolist()
    torch.testing.assert_close(prefill_then_decodes(runner, tokens, 5), reference_logits(mxfp4_folder, tokens), atol=1e-4, rtol=0)


@pytest.mark.skipif(not cpu_kernels.load(), reason="the CPU kernels did not build")
def test_mxfp4_experts_run_on_their_blocks(mxfp4_folder):
    """On CPU the experts keep their MXFP4 blocks as records and run on them
    (the dense copy freed): exactly expanded with --dtype float32, int8
    activations with auto."""
    tokens = torch.randint(3, 128, (21,), generator=torch.Generator().manual_seed(4)).tolist()
    want = reference_logits(mxfp4_folder, tokens)
    logits = {}
    for dtype in ("float32", "auto"):
        runner = ModelRunner(mxfp4_folder, dtype=dtype, block_size=4)
        for layer in runner.model.model.layers:
            assert layer.mlp.quantized is not None and layer.mlp.w13_weight.numel() == 0, dtype
        logits[dtype] = prefill_then_decodes(runner, tokens, 5)
    torch.testing.assert_close(logits["float32"], want, atol=1e-4, rtol=0)
    assert (logits["auto"] - want).norm() / want.norm() < 0.05


# --- rope scaling -------------------------------------------------------------

ROPE_CASES = {
    "yarn": dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
    "yarn_no_truncate": dict(rope_scaling={"rope_type": "yarn", "factor": 8.0, "beta_fast": 16, "truncate": False,
                                           "original_max_position_embeddings": 16}),
    "yarn_attention_factor": dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "attention_factor": 0.8,
                                                "original_max_position_embeddings": 32}),
    "yarn_deepseek_mscale": dict(rope_scaling={"rope_type": "yarn", "factor": 40.0, "mscale": 1.0,
                                               "mscale_all_dim": 0.707, "original_max_position_embeddings": 4}),
    "dynamic": dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
}


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_rope_scaling_matches_transformers(case):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(hidden_size=128, num_attention_heads=2, max_position_embeddings=128,
                                      **ROPE_CASES[case])
    params = rope_parameters(config.to_dict())
    served = context_length(params, 128)
    kwargs = {"seq_len": served} if params["rope_type"] == "dynamic" else {}
    want, scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, None, **kwargs)
    assert torch.equal(inverse_frequencies(64, params), want)
    assert attention_scaling(params) == pytest.approx(scaling, rel=1e-12)
    factor = params["factor"]
    original = params.get("original_max_position_embeddings", 128)
    assert served == (int(original * factor) if params["rope_type"] == "yarn" else int(128 * factor))


def test_dynamic_rope_over_the_whole_served_context_matches_transformers(tmp_path):
    """transformers picks the base from each call's length; one call over the
    longest served context (factor x max_position_embeddings) is where it
    and the base Sluice fixes agree."""
    folder = make_tiny_model(tmp_path, "llama", max_position_embeddings=24,
                             rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    runner = ModelRunner(folder, dtype="float32", block_size=4)
    assert runner.max_position_embeddings == 48
    tokens = torch.randint(3, 128, (48,), generator=torch.Generator().manual_seed(5)).tolist()
    d = Driver(runner)
    d.step([(d.request(1, tokens), 48)])
    torch.testing.assert_close(d.computed(1, 0, 48), reference_logits(folder, tokens), atol=1e-4, rtol=0)


def test_unknown_rope_type_is_refused_by_name(tmp_path):
    folder = make_tiny_model(tmp_path, "llama")
    config = (folder / "config.json").read_text().replace('"rope_type": "default"', '"rope_type": "mrope"')
    (folder / "config.json").write_text(config)
    with pytest.raises(ValueError, match=r"rope_type 'mrope' is not supported \(supported: default, linear, llama3, "
                                         r"longrope, yarn, dynamic\)"):
        ModelRunner(folder, dtype="float32")
