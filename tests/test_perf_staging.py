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
    staging = model(transfer_latency_s=0.0)
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
    uniform, skewed = model(), model(routing_zipf_s=1.0)
    for tokens in (1, 64, 1024):
        assert skewed.experts_moved(tokens, 77) < uniform.experts_moved(tokens, 77)
    assert uniform.experts_moved(1, 77) == pytest.approx(77 * 10 / 512)
    assert skewed.experts_moved(10**6, 77) == pytest.approx(77)  # a huge step touches everything anyway


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
