"""Staging cost of offloaded experts, against hand arithmetic."""

import pytest

from moetide.perf.staging import StagingConfig, StagingModel
from moetide.sim.setup import ReplayConfig, run_replay
from moetide.specs import get_gpu, get_model
from moetide.workloads import generate_agent_sessions

MIB = 1 << 20


def model(**config):
    return StagingModel(get_model("qwen3-next-80b-a3b"), get_gpu("h200"), tp=2, config=StagingConfig(**config))


def test_touched_mode_by_hand():
    staging = model(mode="touched", transfer_latency_s=0.0)
    assert staging.expert_bytes == 3 * MIB  # one 6 MiB expert, half on each GPU
    # T = 1, one offloaded expert in each of 48 layers: touched with probability k/E = 10/512
    staged, exposed = staging.step(1, [1] * 48, compute_s_per_layer=1.0)
    assert staged == pytest.approx(48 * 10 / 512 * 3 * MIB)
    assert exposed == pytest.approx(staged / (55e9 * 0.9))  # touched mode overlaps nothing


def test_segment_mode_overlaps_the_previous_layer():
    staging = model(mode="segment", transfer_latency_s=0.0)
    per_layer_s = 4 * 3 * MIB / (55e9 * 0.9)
    staged, exposed = staging.step(64, [4, 0], compute_s_per_layer=per_layer_s / 2)
    assert staged == 4 * 3 * MIB and exposed == pytest.approx(per_layer_s / 2)
    assert staging.step(64, [4, 0], compute_s_per_layer=per_layer_s)[1] == 0.0


def test_skewed_routing_touches_cold_experts_less():
    uniform, skewed = model(mode="touched"), model(mode="touched", routing_zipf_s=1.0)
    for tokens in (1, 64, 1024):
        assert skewed.experts_moved(tokens, 77) < uniform.experts_moved(tokens, 77)
    assert uniform.experts_moved(1, 77) == pytest.approx(77 * 10 / 512)
    assert skewed.experts_moved(10**6, 77) == pytest.approx(77)  # a huge step touches everything anyway


def test_auto_mode_prefetches_what_the_window_carries_and_fetches_the_rest_on_demand():
    staging = model(transfer_latency_s=0.0)  # auto is the default
    t = 3 * MIB / (55e9 * 0.9)  # one expert's transfer
    # a window of 2.5 transfers: the 2 likeliest of 10 offloaded experts ride free, the other 8 come on demand
    moved, exposed = staging.layer(1, 10, overlap_s=2.5 * t)
    assert moved == pytest.approx(2 + 8 * 10 / 512)
    assert exposed == pytest.approx(8 * 10 / 512 * t)
    # a prefill chunk touches all of them: the whole segment is prefetched and only the overrun is exposed
    moved, exposed = staging.layer(8192, 10, overlap_s=2.5 * t)
    assert moved == pytest.approx(10) and exposed == pytest.approx(7.5 * t)
    assert staging.layer(8192, 10, overlap_s=10 * t) == (10, 0.0)


@pytest.mark.parametrize("zipf_s", [0.0, 1.0])
def test_auto_mode_is_never_worse_than_touched_or_segment(zipf_s):
    auto, touched, segment = (model(mode=m, routing_zipf_s=zipf_s) for m in ("auto", "touched", "segment"))
    for tokens in (1, 8, 64, 512, 8192):
        for n in (1, 5, 26, 77):
            for window in (0.0, 1e-4, 1e-3, 1e-2):
                best = min(touched.layer(tokens, n, 0.0)[1], segment.layer(tokens, n, window)[1])
                assert auto.layer(tokens, n, window)[1] <= best + 1e-12


def test_the_policy_prices_offload_with_the_staging_the_replay_charges():
    from moetide.core.blocks import BlockPool
    from moetide.core.expert_line import ExpertLine
    from moetide.core.experts import ExpertResidency, ExpertResidencyConfig
    from moetide.perf import StepTimeModel
    from moetide.sim.setup import StepTimeWithStaging

    m, gpu = get_model("qwen3-next-80b-a3b"), get_gpu("h200")
    staging = model(routing_zipf_s=1.0)
    residency = ExpertResidency(ExpertResidencyConfig(num_layers=48, num_experts=512, expert_bytes=3 * MIB))
    line = ExpertLine(residency, BlockPool([]), block_bytes=6_684_672, first_block_id=0)
    timer = StepTimeWithStaging(StepTimeModel(m, gpu, tp=2), staging, line, m.num_layers, mix_tau_s=1e9)
    decode, prefill = (16, 16, 16, 16 * 65537, 16 * 65537), (8192, 1, 0, 65536 + 8192, 8192 * 65536 + 8192 * 8193 // 2)
    for _ in range(50):  # a mix of decode batches and prefill chunks at 64K context
        timer(*decode)
        timer(*prefill)
    predicted = timer.staging_share(960)
    line.offload(residency.next_offload_region(max_experts=960))  # 20 per layer
    base_s = charged_s = 0.0
    for shape in (decode, prefill):
        base = timer.step_model.step_time_s(*shape)
        base_s += base
        charged_s += timer(*shape) - base
    assert predicted > 0 and predicted == pytest.approx(charged_s / base_s, rel=1e-6)


def test_bad_staging_settings():
    with pytest.raises(ValueError, match="staging mode"):
        StagingConfig(mode="eager")
    with pytest.raises(ValueError, match="routing_zipf_s"):
        StagingConfig(routing_zipf_s=-1)


@pytest.mark.parametrize("policy", ["vamp", "vamp-reclaim", "static-offload"])
def test_offloading_policies_respect_the_cap_and_lose_no_request(policy):
    workload = generate_agent_sessions(4, num_sessions=6)
    result, _ = run_replay(workload, ReplayConfig(policy=policy, kv_budget_gib=4.0, max_offload_ratio=0.05))
    metrics = result["metrics"]
    assert metrics["completed"] + metrics["failed"] == workload.num_requests
    assert 0 < metrics["offloaded_ratio_max"] <= 0.05
    assert metrics["staged_bytes"] > 0
