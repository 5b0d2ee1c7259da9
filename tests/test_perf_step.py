"""The roofline step-time model against rooflines computed by hand, with the arithmetic written out.

Spec figures the hand computations use are pinned first, so a change in specs shows up here as what it is.
IDEAL removes every derating (efficiency 1, no latency, no overhead): the model must then equal the bare roofline.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moetide.perf import (
    Efficiency,
    StepShape,
    StepTimeModel,
    expected_distinct_experts,
    expected_distinct_experts_from_probs,
)
from moetide.specs import all_models, get_gpu, get_model

IDEAL = Efficiency(matmul=1.0, hbm=1.0, attention=1.0, allreduce=1.0, allreduce_latency_s=0.0, step_overhead_s=0.0)
H100_BW, H100_FLOPS, NVLINK = 3.35e12, 989.4e12, 450e9
# Qwen3-30B-A3B, bf16: embedding = lm_head = 151,936 x 2048; per layer: attention 18,874,624 (q 8,388,608 +
# k,v 2,097,152 + o 8,388,608 + qk-norm 256) + two norms 4,096 + router 128 x 2048 = 262,144 -> 19,140,864;
# 48 layers + final norm 2,048 = 918,763,520 params outside embedding, lm head and routed experts.
Q30_LAYER_PARAMS = 48 * (18_874_624 + 4_096 + 262_144) + 2_048
Q30_LM_HEAD_BYTES = 151_936 * 2048 * 2  # 622,329,856
Q30_EXPERT_BYTES = 3 * 2048 * 768 * 2  # gate, up, down: 9,437,184
Q30_KV_PER_TOKEN = 48 * 2 * 4 * 128 * 2  # layers x (K, V) x kv heads x head_dim x 2 B = 98,304


@pytest.fixture(scope="module")
def q30():
    return get_model("qwen3-30b-a3b")


@pytest.fixture(scope="module")
def h100():
    return get_gpu("h100")


def test_pinned_spec_figures(q30, h100):
    assert Q30_LAYER_PARAMS == 918_763_520 == q30.params_non_expert - 2 * 311_164_928
    assert (q30.expert_bytes(), q30.kv_bytes_per_token()) == (Q30_EXPERT_BYTES, Q30_KV_PER_TOKEN)
    assert (h100.hbm_bandwidth_bytes_per_s, h100.matmul_flops_per_s) == (H100_BW, H100_FLOPS)


# ---- distinct experts ---------------------------------------------------------------------------------------


def test_distinct_experts_is_k_at_one_token_and_tends_to_e():
    assert expected_distinct_experts(1, 128, 8) == 8.0  # 128 x (1 - 120/128) = 128 x 0.0625
    assert expected_distinct_experts(0, 128, 8) == 0.0
    values = [expected_distinct_experts(t, 128, 8) for t in (1, 2, 8, 64, 512, 4096)]
    assert values == sorted(values) and values[1] == pytest.approx(128 * (1 - (120 / 128) ** 2))  # 15.5
    assert 127.999 < values[-1] <= 128.0
    assert expected_distinct_experts(7, 8, 8) == 8.0  # k = E: every expert, every step


def test_distinct_experts_from_probs():
    uniform = [8 / 128] * 128
    for t in (1, 3, 100):
        assert expected_distinct_experts_from_probs(t, uniform) == pytest.approx(expected_distinct_experts(t, 128, 8))
    skewed = [1.0] * 8 + [0.0] * 120  # the same 8 experts take every token
    assert expected_distinct_experts_from_probs(5000, skewed) == 8.0


# ---- hand-computed rooflines --------------------------------------------------------------------------------


def test_batch1_decode_qwen3_30b_is_no_faster_than_its_bytes_over_hbm_bandwidth(q30, h100):
    shape = StepShape.decode(1, 4096)  # reads 4,097 KV tokens (4,096 cached + the new one)
    bytes_read = (Q30_LAYER_PARAMS * 2  # non-expert weights but the embedding (a gather): 1,837,527,040
                  + Q30_LM_HEAD_BYTES  # 622,329,856
                  + 8 * 48 * Q30_EXPERT_BYTES  # 8 distinct experts x 48 layers: 3,623,878,656
                  + 4097 * Q30_KV_PER_TOKEN)  # 402,751,488
    assert bytes_read == 6_486_487_040
    floor_s = bytes_read / H100_BW  # 1.936 ms
    assert StepTimeModel(q30, h100).step_time_s(*shape.as_args()) >= floor_s
    # with no derating every term is memory-bound at T = 1, so the model is exactly the floor
    assert StepTimeModel(q30, h100, efficiency=IDEAL).step_time_s(*shape.as_args()) == pytest.approx(floor_s, 1e-12)


def test_default_efficiency_decode_by_hand(q30, h100):
    bd = StepTimeModel(q30, h100).breakdown(StepShape.decode(1, 4096))
    hbm = H100_BW * 0.8
    assert bd["experts_s"] == pytest.approx(8 * 48 * Q30_EXPERT_BYTES / hbm)  # 1.352 ms
    assert bd["total_s"] == pytest.approx(6_486_487_040 / hbm + 1e-3)  # all memory-bound, + 1 ms overhead


def test_large_prefill_is_compute_bound(q30, h100):
    shape = StepShape.prefill(8192)
    assert shape.attention_pairs == 8192 * 8193 // 2  # causal: token j attends to j tokens
    dense_flops = 2 * Q30_LAYER_PARAMS * 8192  # 15.05 TFLOP
    expert_flops = 2 * 8 * 48 * (3 * 2048 * 768) * 8192  # top-8 of 4,718,592-param experts: 29.69 TFLOP
    attention_flops = shape.attention_pairs * 48 * 32 * (2 * 128 + 2 * 128)  # QK^T + PV per head: 26.39 TFLOP
    lm_head_s = Q30_LM_HEAD_BYTES / H100_BW  # one sampled row: reading the head dominates
    expected = (dense_flops + expert_flops + attention_flops) / H100_FLOPS + lm_head_s  # 72.0 ms
    model = StepTimeModel(q30, h100, efficiency=IDEAL)
    assert model.step_time_s(*shape.as_args()) == pytest.approx(expected, 1e-12)
    bd = model.breakdown(shape)
    for term in ("dense", "experts", "attention"):
        assert bd[f"{term}_compute_s"] > bd[f"{term}_memory_s"]
    # every expert is touched: 128 x 48 experts read = 58 GB, still below the 29.69 TFLOP at peak
    assert bd["distinct_experts_per_layer"] == pytest.approx(128.0)


def test_tp2_halves_the_weight_reads_and_adds_two_allreduces_per_layer(q30, h100):
    shape = StepShape.decode(1, 4096)
    one, two = (StepTimeModel(q30, h100, tp=tp, efficiency=IDEAL).breakdown(shape) for tp in (1, 2))
    # replicated on both GPUs: two norms 4,096 + router 262,144 + qk-norm 256 per layer, and the final norm
    replicated = 48 * (4_096 + 262_144 + 256) + 2_048  # 12,793,856
    assert two["dense_bytes"] == ((Q30_LAYER_PARAMS - replicated) // 2 + replicated) * 2 == 931_557_376
    assert two["dense_memory_s"] == pytest.approx(931_557_376 / H100_BW)
    assert two["experts_memory_s"] == pytest.approx(one["experts_memory_s"] / 2)
    assert two["lm_head_bytes"] == Q30_LM_HEAD_BYTES // 2
    assert two["attention_bytes"] == one["attention_bytes"] / 2  # 4 KV heads split 2 ways
    # ring all-reduce: 2 x 48 collectives of 1 token x 2048 x 2 B, 2 (tp-1)/tp = 1 x bytes over NVLink
    assert one["allreduce_s"] == 0.0
    assert two["allreduce_s"] == pytest.approx(2 * 48 * 2048 * 2 / NVLINK)
    with_latency = StepTimeModel(q30, h100, tp=2).breakdown(shape)
    assert with_latency["allreduce_s"] == pytest.approx(2 * 48 * (2048 * 2 / (NVLINK * 0.8) + 10e-6))


def test_hybrid_qwen3_next_reads_kv_of_12_full_layers_and_a_fixed_state(h100):
    model = get_model("qwen3-next-80b-a3b")
    shape = StepShape.decode(4, 1000)  # kv_tokens_read = 4 x 1001
    bd = StepTimeModel(model, get_gpu("h200")).breakdown(shape)
    kv_per_token = 12 * 2 * 2 * 256 * 2  # 12 full layers (not 48) x (K, V) x 2 KV heads x 256 x 2 B = 24,576
    assert bd["attention_bytes"] == 4 * 1001 * kv_per_token
    # per linear layer and sequence: conv (2 x 2048 + 4096) x 4 + recurrent 32 x 128 x 128 = 557,056 elements
    state_bytes = 36 * 557_056 * 2  # 40,108,032 B per sequence; read and written once per step
    assert bd["linear_attention_bytes"] == 4 * 2 * state_bytes
    assert bd["linear_attention_flops"] == 4 * 36 * (6 * 32 * 128 * 128 + 2 * 8192 * 4)


def test_mla_uses_the_absorbed_form_and_the_whole_latent():
    model = get_model("deepseek-v2-lite")
    shape = StepShape.decode(2, 99)  # 2 x 100 pairs and KV tokens
    for tp in (1, 2):
        bd = StepTimeModel(model, get_gpu("h100"), tp=tp).breakdown(shape)
        # per head and pair: scores over latent 512 + rope 64, values over the latent 512
        assert bd["attention_flops"] == 200 * 27 * (16 // tp) * (2 * (512 + 64) + 2 * 512)
        assert bd["attention_bytes"] == 200 * 27 * (512 + 64) * 2  # 31,104 B per token on every GPU


def test_matmul_flops_match_the_spec_when_every_token_is_sampled(h100):
    for model in all_models():
        bd = StepTimeModel(model, h100).breakdown(StepShape.decode(64, 10))
        flops = bd["dense_flops"] + bd["experts_flops"] + bd["lm_head_flops"]
        assert flops == pytest.approx(64 * model.matmul_flops_per_token, rel=1e-12), model.name


# ---- API edges ----------------------------------------------------------------------------------------------


def test_step_shapes():
    assert StepShape.decode(64, 32768).as_args() == (64, 64, 64, 64 * 32769, 64 * 32769)
    assert StepShape.prefill(4, context_tokens=10).as_args() == (4, 1, 0, 14, 4 * (10 + 2.5))


def test_empty_step_takes_no_time(q30, h100):
    assert StepTimeModel(q30, h100).step_time_s(0, 0, 0, 0, 0) == 0.0


def test_routing_probs(q30, h100):
    shape = StepShape.decode(32, 100)
    uniform = StepTimeModel(q30, h100, routing_probs=[[8 / 128] * 128] * 48)
    plain = StepTimeModel(q30, h100)
    assert uniform.step_time_s(*shape.as_args()) == pytest.approx(plain.step_time_s(*shape.as_args()), 1e-12)
    hot = StepTimeModel(q30, h100, routing_probs=[[1.0] * 8 + [0.0] * 120] * 48)
    assert hot.breakdown(shape)["experts_bytes"] == 48 * 8 * Q30_EXPERT_BYTES  # always the same 8 experts
    with pytest.raises(ValueError, match="one vector per MoE layer"):
        StepTimeModel(q30, h100, routing_probs=[[8 / 128] * 128])
    with pytest.raises(ValueError, match="sum to top_k"):
        StepTimeModel(q30, h100, routing_probs=[[1 / 128] * 128] * 48)


@pytest.mark.parametrize("kwargs", [{"matmul": 0.0}, {"hbm": 1.5}, {"attention": -0.1}, {"step_overhead_s": -1.0},
                                    {"allreduce_latency_s": math.inf}])
def test_efficiency_rejects_out_of_range(kwargs):
    with pytest.raises(ValueError, match="Efficiency."):
        Efficiency(**kwargs)


def test_tp_must_shard_evenly(q30, h100):
    with pytest.raises(ValueError, match="num_attention_heads"):
        StepTimeModel(q30, h100, tp=3)


@settings(max_examples=200, deadline=None)
@given(model_name=st.sampled_from(["qwen3-30b-a3b", "qwen3-next-80b-a3b", "deepseek-v2-lite", "mixtral-8x7b"]),
       tp=st.sampled_from([1, 2, 4]), num_seqs=st.integers(1, 256), extra_tokens=st.integers(0, 8192),
       context=st.integers(0, 200_000), probs=st.booleans())
def test_breakdown_total_equals_hot_path(model_name, tp, num_seqs, extra_tokens, context, probs):
    model = get_model(model_name)
    routing = None
    if probs:  # a skewed but valid vector: half the mass on the first 2k experts
        k, e = model.num_experts_per_tok, model.num_experts
        hot = min(2 * k, e)
        vec = [k / 2 / hot] * hot + [k / 2 / (e - hot)] * (e - hot) if hot < e else [k / e] * e
        routing = [vec] * model.num_moe_layers
    step = StepTimeModel(model, get_gpu("h200"), tp=tp, routing_probs=routing)
    tokens = num_seqs + extra_tokens
    shape = StepShape(tokens, num_seqs, num_seqs, num_seqs * context + tokens,
                      num_seqs * context + tokens * (tokens + 1) // 2)
    total = step.step_time_s(*shape.as_args())
    assert total == pytest.approx(step.breakdown(shape)["total_s"], rel=1e-9)
    more_kv = step.step_time_s(tokens, num_seqs, num_seqs, shape.kv_tokens_read * 2, shape.attention_pairs)
    assert more_kv >= total
