"""The expert layer's pieces (layers/moe.py) against transformers' own routers
and a token-by-token loop, gpt-oss's MXFP4 checkpoints against transformers,
and the rope scaling types against transformers' rope functions."""

from __future__ import annotations

import pytest
import torch

from sluice_server.layers import moe
from sluice_server.layers.rotary import attention_scaling, context_length, inverse_frequencies, rope_parameters
from sluice_server.model_runner import ModelRunner
from sluice_server.models.gpt_oss import dequantize_mxfp4
from sluice_server.testing import quantize_mxfp4, to_mxfp4_checkpoint

from conftest import Driver, make_tiny_model, reference_logits


def spec(**kw) -> moe.MoESpec:
    return moe.MoESpec(**dict(dict(num_experts=8, top_k=3, hidden_size=64, intermediate_size=48), **kw))


def transformers_router(kind: str, logits: torch.Tensor):
    """(weights, ids) of transformers' router of `kind` for these logits, fed
    through an identity router weight (logits = x I^T)."""
    import transformers
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    e = logits.shape[1]
    if kind == "qwen3_moe":
        router = Qwen3MoeTopKRouter(transformers.Qwen3MoeConfig(num_experts=e, num_experts_per_tok=3,
                                                                 hidden_size=e, norm_topk_prob=True))
    elif kind == "mixtral":
        router = MixtralTopKRouter(transformers.MixtralConfig(num_local_experts=e, num_experts_per_tok=3, hidden_size=e))
    else:
        router = GptOssTopKRouter(transformers.GptOssConfig(num_local_experts=e, num_experts_per_tok=3, hidden_size=e))
        router.bias.data.zero_()
    router.weight.data.copy_(torch.eye(e))
    _, weights, ids = router(logits)
    return weights, ids


@pytest.mark.parametrize("kind,scoring", [
    ("qwen3_moe", moe.SOFTMAX_TOPK), ("mixtral", moe.SOFTMAX_TOPK), ("gpt_oss", moe.TOPK_SOFTMAX),
])
def test_routing_matches_transformers(kind, scoring):
    logits = torch.randn(37, 8, generator=torch.Generator().manual_seed(0)) * 3
    weights, ids = moe.route(logits, spec(scoring=scoring))
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


def naive_moe(x, ids, weights, w13, w2, b13, b2, s: moe.MoESpec) -> torch.Tensor:
    """Token by token, slot by slot: the definition."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            h = w13[e] @ x[t] + (0 if b13 is None else b13[e])
            y = w2[e] @ moe.activate(h.unsqueeze(0), s)[0] + (0 if b2 is None else b2[e])
            out[t] += weights[t, j] * y
    return out


@pytest.mark.parametrize("activation,bias", [("silu", False), ("swiglu_oai", True)])
@pytest.mark.parametrize("tokens", [1, 3, 29])
def test_grouped_experts_equal_the_token_loop(activation, bias, tokens):
    """Irregular shapes: some experts get several tokens, most get none at 1 token."""
    g = torch.Generator().manual_seed(tokens)
    s = spec(activation=activation, swiglu_limit=0.5)
    e, h, i = s.num_experts, s.hidden_size, s.intermediate_size
    x = torch.randn(tokens, h, generator=g)
    w13, w2 = torch.randn(e, 2 * i, h, generator=g) * 0.3, torch.randn(e, h, i, generator=g) * 0.3
    b13 = torch.randn(e, 2 * i, generator=g) if bias else None
    b2 = torch.randn(e, h, generator=g) if bias else None
    weights, ids = moe.route(torch.randn(tokens, e, generator=g), s)
    groups = moe.group_by_expert(ids, e)
    assert groups.offsets[-1] == tokens * s.top_k
    assert sum(end - start for _, start, end in groups.active()) == tokens * s.top_k
    rows = moe.grouped_experts_reference(x, groups, w13, w2, b13, b2, s)
    got = moe.combine(rows, groups, weights)
    torch.testing.assert_close(got, naive_moe(x, ids, weights, w13, w2, b13, b2, s), atol=1e-4, rtol=1e-5)


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


def test_mxfp4_checkpoint_matches_transformers(tmp_path):
    folder = to_mxfp4_checkpoint(make_tiny_model(tmp_path, "gpt_oss", seed=4))
    runner = ModelRunner(folder, dtype="float32", block_size=4)
    tokens = torch.randint(3, 128, (33,), generator=torch.Generator().manual_seed(3)).tolist()
    d = Driver(runner)
    r = d.request(1, tokens)
    d.step([(r, 28)])
    for _ in range(5):
        d.step([(r, 1)])
    torch.testing.assert_close(d.computed(1, 0, 33), reference_logits(folder, tokens), atol=1e-4, rtol=0)


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
