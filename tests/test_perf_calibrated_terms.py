"""The step model's terms fitted on published GPU measurements, each against a case computed by hand: the grouped
GEMM's padding, the per-layer floors, the all-reduce algorithm by message size, and the engine profiles."""

from __future__ import annotations

import math

import pytest

from moetide.errors import UserError
from moetide.perf import Efficiency, StepShape, StepTimeModel
from moetide.perf.engines import DEFAULT_ENGINE_PROFILE, engine_efficiency, engine_profiles
from moetide.perf.step import allreduce_s
from moetide.perf.step_calibrate import step_efficiency_for_gpu
from moetide.specs import get_gpu, get_model

IDEAL = Efficiency(matmul=1.0, hbm=1.0, attention=1.0, allreduce=1.0, allreduce_latency_s=0.0, step_overhead_s=0.0)
H100_BW, H100_FLOPS, NVLINK = 3.35e12, 989.4e12, 450e9
Q30_EXPERT_PARAMS = 3 * 2048 * 768  # gate, up, down of one Qwen3-30B-A3B expert: 4,718,592


def test_the_grouped_gemm_pays_half_tokens_of_padding_per_active_expert():
    # 4,096 tokens of Qwen3-30B-A3B (E = 128, k = 8) touch D = 128 (1 - (120/128)^4096) = 128 experts to 1e-100;
    # pairs = 4,096 x 8 = 32,768; with h = 64: 32,768 + 64 x 128 = 40,960 padded pairs x 2 x 4,718,592 FLOPs
    # = 386.5 GFLOP at 0.5 x 989.4 TFLOP/s = 781.4 us, above the 128 x 9.4 MB / 3.35 TB/s = 360.6 us it reads
    step = StepTimeModel(get_model("qwen3-30b-a3b"), get_gpu("h100"),
                         efficiency=Efficiency(hbm=1.0, moe_matmul=0.5, moe_half_tokens=64))
    terms = step.moe_layer_terms(4096)
    assert terms["experts_s"] == pytest.approx(40_960 * 2 * Q30_EXPERT_PARAMS / (0.5 * H100_FLOPS), rel=1e-9)
    assert terms["experts_s"] == pytest.approx(781.4e-6, rel=1e-3)
    # the same tokens without padding: 32,768 pairs, 625.1 us
    bare = StepTimeModel(get_model("qwen3-30b-a3b"), get_gpu("h100"), efficiency=Efficiency(hbm=1.0, moe_matmul=0.5))
    assert bare.moe_layer_terms(4096)["experts_s"] == pytest.approx(625.1e-6, rel=1e-3)
    # the efficiency this is: 0.5 m / (m + 64) at m = 32,768 / 128 = 256 tokens per expert -> 0.4
    assert bare.moe_layer_terms(4096)["experts_s"] / terms["experts_s"] == pytest.approx(256 / (256 + 64))


def test_padding_leaves_a_memory_bound_decode_alone_and_the_step_sums_it_per_layer():
    model, gpu = get_model("qwen3-30b-a3b"), get_gpu("h100")
    padded = StepTimeModel(model, gpu, efficiency=Efficiency(moe_half_tokens=64, moe_layer_s=20e-6))
    plain = StepTimeModel(model, gpu)
    # one token: 8 experts x 9,437,184 B / (0.8 x 3.35 TB/s) = 28.17 us; compute with padding: (8 + 64 x 8)
    # x 2 x 4,718,592 / (0.7 x 989.4e12) = 7.09 us: still memory-bound, so the layer is 28.17 + the 20 us floor
    assert padded.moe_layer_terms(1)["experts_s"] == pytest.approx(8 * 9_437_184 / (0.8 * H100_BW), rel=1e-9)
    decode = StepShape.decode(1, 1024)
    assert padded.step_time_s(*decode.as_args()) - plain.step_time_s(*decode.as_args()) == pytest.approx(
        48 * 20e-6, rel=1e-9)
    assert padded.breakdown(decode)["total_s"] == pytest.approx(padded.step_time_s(*decode.as_args()), rel=1e-12)


def test_layer_floors_count_each_kind_of_layer():
    # Qwen3-Next: 48 MoE layers, 12 full-attention, 36 Gated DeltaNet: 48 x 3 + 12 x 5 + 36 x 7 = 456 us
    e = Efficiency(moe_layer_s=3e-6, attention_layer_s=5e-6, linear_layer_s=7e-6)
    step = StepTimeModel(get_model("qwen3-next-80b-a3b"), get_gpu("h200"), tp=2, efficiency=e)
    assert step.layer_floors_s() == pytest.approx(456e-6)
    bd = step.breakdown(StepShape.decode(4, 100))
    assert bd["floors_s"] == pytest.approx(456e-6)
    # DeepSeek-V2-Lite: 27 MLA layers, 26 of them MoE (layer 0 is dense): 26 x 3 + 27 x 5 = 213 us
    assert StepTimeModel(get_model("deepseek-v2-lite"), get_gpu("h100"), efficiency=e).layer_floors_s() == (
        pytest.approx(213e-6))


@pytest.mark.parametrize(("tp", "message", "moved", "latency"), [
    (2, 4 * 2**20, 1 * 4 * 2**20, 7e-6),  # tp 2: one-shot at any custom size, (tp-1) S
    (4, 256 * 1024, 3 * 256 * 1024, 7e-6),  # tp 4 below 512 KiB: one-shot, 3 S
    (4, 1 * 2**20, 1.5 * 2**20, 7e-6),  # tp 4 at 1 MiB: two-shot, 2 x 3/4 S
    (8, 256 * 1024, 1.75 * 256 * 1024, 7e-6),  # tp 8 at 256 KiB: two-shot (one-shot only below it)
    (8, 200 * 1024, 7 * 200 * 1024, 7e-6),  # tp 8 below 256 KiB: one-shot, 7 S
    (8, 16 * 2**20, 1.75 * 16 * 2**20, 30e-6),  # above the custom maximum: NCCL's ring, its own latency
])
def test_the_all_reduce_follows_the_algorithm_vllm_picks_for_the_message(tp, message, moved, latency):
    e = Efficiency(allreduce=1.0, allreduce_latency_s=7e-6, nccl_latency_s=30e-6, custom_allreduce_max_bytes=8 * 2**20)
    assert allreduce_s(get_gpu("h100"), tp, e, message) == pytest.approx(latency + moved / NVLINK, rel=1e-12)


def test_without_a_custom_maximum_every_all_reduce_is_the_ring_as_before():
    # the roofline's 2 (tp-1)/tp S / link + latency, 2 per layer: Qwen3-30B-A3B at tp 2, T = 64 tokens:
    # 2 x 48 x (10 us + 64 x 2048 x 2 B / 360 GB/s) = 2 x 48 x 10.728 us = 1.030 ms
    step = StepTimeModel(get_model("qwen3-30b-a3b"), get_gpu("h100"), tp=2)
    assert step.breakdown(StepShape.decode(64, 512))["allreduce_s"] == pytest.approx(
        96 * (10e-6 + 64 * 2048 * 2 / (0.8 * NVLINK)), rel=1e-12)
    assert allreduce_s(get_gpu("h100"), 1, Efficiency(), 1e9) == 0.0


def test_the_new_fields_are_checked():
    for kwargs in ({"moe_matmul": 0.0}, {"moe_matmul": 1.5}, {"moe_half_tokens": -1}, {"moe_layer_s": math.nan},
                   {"nccl_latency_s": -1e-6}, {"custom_allreduce_max_bytes": math.inf}):
        with pytest.raises(ValueError):
            Efficiency(**kwargs)


def test_profiles_load_by_name_and_presets_get_the_default_one():
    assert "roofline" in engine_profiles() and DEFAULT_ENGINE_PROFILE in engine_profiles()
    assert engine_efficiency("roofline") == Efficiency()
    fitted = engine_efficiency()
    assert fitted != Efficiency() and fitted.custom_allreduce_max_bytes == 8 * 2**20
    assert step_efficiency_for_gpu("h200") == fitted
    assert step_efficiency_for_gpu("h200", "roofline") == Efficiency()
    with pytest.raises(UserError, match="unknown engine profile 'vllm-9'.*roofline"):
        engine_efficiency("vllm-9")



def test_fp8_weights_halve_the_bytes_and_take_their_own_grouped_gemm_efficiency():
    # 4,096 tokens, FP8: 32,768 pairs x 2 x 4,718,592 FLOPs = 309.2 GFLOP at 0.2 x 989.4 TFLOP/s (the BF16 peak)
    # = 1.5627 ms, above the 128 x 4,718,592 B = 604 MB read at 3.35 TB/s (180 us); BF16 weights keep moe_matmul
    e = Efficiency(hbm=1.0, moe_matmul=0.5, moe_matmul_fp8=0.2)
    fp8 = StepTimeModel(get_model("qwen3-30b-a3b"), get_gpu("h100"), dtype_bytes=1, efficiency=e)
    bf16 = StepTimeModel(get_model("qwen3-30b-a3b"), get_gpu("h100"), dtype_bytes=2, efficiency=e)
    assert fp8.moe_layer_terms(4096)["experts_s"] == pytest.approx(32_768 * 2 * Q30_EXPERT_PARAMS / (0.2 * H100_FLOPS))
    assert fp8.moe_layer_terms(4096)["experts_s"] == pytest.approx(1.5627e-3, rel=1e-4)
    assert bf16.moe_layer_terms(4096)["experts_s"] == pytest.approx(32_768 * 2 * Q30_EXPERT_PARAMS / (0.5 * H100_FLOPS))
    # one token, memory-bound: FP8 reads half of BF16's bytes, 8 x 4,718,592 B / 3.35 TB/s = 11.27 us
    assert fp8.moe_layer_terms(1)["experts_s"] == pytest.approx(8 * Q30_EXPERT_PARAMS / H100_BW)
