"""Staging cost of offloaded experts, against hand arithmetic."""

from dataclasses import replace

import pytest

from moetide.perf.staging import StagingConfig, StagingModel
from moetide.sim.setup import ReplayConfig, run_replay
from moetide.specs import get_gpu, get_host, get_model
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


def replay_timer():
    """The replay's step timer for Qwen3-Next-80B on 2 x H200 over an expert line with nothing offloaded yet, its
    mix never decaying: (timer, staging model, residency, line)."""
    from moetide.core.blocks import BlockPool
    from moetide.core.expert_line import ByteLayout, ExpertLine
    from moetide.core.experts import ExpertResidency, ExpertResidencyConfig
    from moetide.perf import StepTimeModel
    from moetide.sim.step_time import StepTimeWithStaging

    m, gpu = get_model("qwen3-next-80b-a3b"), get_gpu("h200")
    staging = model(routing_zipf_s=1.0)
    residency = ExpertResidency(ExpertResidencyConfig(num_layers=48, num_experts=512, expert_bytes=3 * MIB))
    line = ExpertLine(residency, ByteLayout(BlockPool([]), block_bytes=6_684_672,
                                            kv_bytes_per_expert=residency.config.expert_bytes, first_block_id=0))
    timer = StepTimeWithStaging(StepTimeModel(m, gpu, tp=2), staging, line, m.num_layers, mix_tau_s=1e9)
    return timer, staging, residency, line


def price_then_charge(timer, residency, line, shapes, num_offloaded):
    """The policy's price of offloading ``num_offloaded`` experts over the timer's mix, then, with them offloaded,
    what the replay charges for one step of each shape: (price, charged staging s / staging-free s, those s)."""
    predicted = timer.staging_share(num_offloaded)
    line.offload(residency.next_offload_region(max_experts=num_offloaded))
    base_s = charged_s = 0.0
    for shape in shapes:
        base = timer.step_model.step_time_s(*shape)
        base_s += base
        charged_s += timer(*shape) - base
    return predicted, charged_s / base_s, base_s


def test_the_policy_prices_offload_with_the_staging_the_replay_charges():
    timer, _, residency, line = replay_timer()
    decode, prefill = (16, 16, 16, 16 * 65537, 16 * 65537), (8192, 1, 0, 65536 + 8192, 8192 * 65536 + 8192 * 8193 // 2)
    for _ in range(50):  # a mix of decode batches and prefill chunks at 64K context
        timer(*decode)
        timer(*prefill)
    predicted, charged, _ = price_then_charge(timer, residency, line, (decode, prefill), 960)  # 20 per layer
    assert predicted > 0 and predicted == pytest.approx(charged, rel=1e-6)


def host_model(**config):
    return model(cold_experts="cpu", host=get_host("ddr5-4800-8ch"), **config)


def test_cold_experts_on_the_cpu_by_hand():
    staging = host_model(transfer_latency_s=0.0, cpu_dispatch_s=0.0)
    host = get_host("ddr5-4800-8ch")
    bytes_per_s = host.dram_bandwidth_bytes_per_s * 0.8
    flops_per_s = host.fp32_flops_per_s * 0.5
    # one token, one offloaded expert (uniform routing): q = p = 10/512; nothing prefetched (no window)
    p = 10 / 512
    read_s = p * 3 * MIB / bytes_per_s
    flop_s = p * 2 * (3 * MIB / 2) / flops_per_s  # one pair through a 1.5M-parameter shard
    rows_s = p * 2 * 2048 * 2 / (55e9 * 0.9)  # the row to the host and its result back, bf16
    assert staging.cpu_layer_s(1, 1) == pytest.approx(max(read_s, flop_s) + rows_s)
    moved, exposed = staging.layer(1, 1, overlap_s=0.0)
    assert moved == 0.0 and exposed == pytest.approx(max(read_s, flop_s) + rows_s)  # cheaper than the fetch
    # a big prefill chunk is compute-bound on the host: the whole segment is fetched instead
    fetch = model(transfer_latency_s=0.0).layer(8192, 77, overlap_s=0.0)
    assert staging.layer(8192, 77, overlap_s=0.0) == pytest.approx(fetch)


@pytest.mark.parametrize("zipf_s", [0.0, 0.88])
def test_cold_experts_on_the_cpu_are_never_worse_than_fetching_them(zipf_s):
    fetch, cpu = model(routing_zipf_s=zipf_s), host_model(routing_zipf_s=zipf_s)
    shared = host_model(routing_zipf_s=zipf_s, gpus_per_socket=4)
    cheaper = 0
    for tokens in (1, 8, 64, 512, 8192):
        for n in (1, 5, 26, 77):
            for window in (0.0, 1e-4, 1e-3):
                f, c, s = (x.layer(tokens, n, window)[1] for x in (fetch, cpu, shared))
                assert c <= f + 1e-12 and c <= s + 1e-12  # a quarter of the socket is never better
                cheaper += c < 0.5 * f
    assert cheaper  # and at decode sizes it is much cheaper


def test_bad_staging_settings():
    with pytest.raises(ValueError, match="staging mode"):
        StagingConfig(mode="eager")
    with pytest.raises(ValueError, match="routing_zipf_s"):
        StagingConfig(routing_zipf_s=-1)
    with pytest.raises(ValueError, match="cold_experts"):
        StagingConfig(cold_experts="gpu")
    with pytest.raises(ValueError, match="host CPU spec"):
        StagingConfig(cold_experts="cpu")
    with pytest.raises(ValueError, match="host CPU spec"):
        StagingConfig(cold_experts="cpu", host=get_host("ddr5-4800-8ch"), mode="segment")
    with pytest.raises(ValueError, match="gpus_per_socket"):
        StagingConfig(gpus_per_socket=0)


def test_replay_with_cold_experts_on_the_cpu_stages_less(tmp_path):
    from moetide.cli import main

    workload = generate_agent_sessions(4, num_sessions=6)
    config = ReplayConfig(policy="static-offload", kv_cache_memory=4 * 2**30, max_offload_ratio=0.05)
    fetched, _ = run_replay(workload, config)
    computed, _ = run_replay(workload, replace(config, cold_experts="cpu"))
    assert computed["config"]["cold_experts"] == "cpu" and computed["config"]["cpu"] == "ddr5-4800-8ch"
    assert computed["metrics"]["staged_bytes"] < fetched["metrics"]["staged_bytes"]
    assert computed["metrics"]["tpot_s"]["mean"] < fetched["metrics"]["tpot_s"]["mean"]
    with pytest.raises(ValueError, match="ReplayConfig.staging_mode auto"):
        ReplayConfig(cold_experts="cpu", staging_mode="touched")
    assert main(["replay", "--cold-experts", "cpu", "--cpu", "no-such-host", "--policy", "static-offload"]) == 2


@pytest.mark.parametrize("policy", ["vamp", "vamp-reclaim", "static-offload"])
def test_offloading_policies_respect_the_cap_and_lose_no_request(policy):
    workload = generate_agent_sessions(4, num_sessions=6)
    result, _ = run_replay(workload, ReplayConfig(policy=policy, kv_cache_memory=4 * 2**30, max_offload_ratio=0.05))
    metrics = result["metrics"]
    assert metrics["completed"] + metrics["failed"] == workload.num_requests
    assert 0 < metrics["offloaded_ratio_max"] <= 0.05
    assert metrics["staged_bytes"] > 0


def test_the_policys_price_keeps_chunks_of_one_size_at_different_contexts_apart():
    """Two 8K prefill chunks, one at 1K context and one at 100K: the long one's attention gives prefetch far more
    compute to hide behind. Priced together as one averaged step, the short one's exposed staging would be hidden
    behind the long one's cover; the mix keeps them apart, so the price is what the replay charges."""
    timer, staging, residency, line = replay_timer()

    def chunk(context):
        return 8192, 1, 0, context + 8192, 8192 * context + 8192 * 8193 // 2

    short, long = chunk(1024), chunk(100_000)
    for _ in range(20):
        timer(*short)
        timer(*long)
    predicted, charged, base_s = price_then_charge(timer, residency, line, (short, long), 48 * 40)
    assert charged > 0 and predicted == pytest.approx(charged, rel=1e-6)
    # what one averaged step would have priced: well below the charge
    mean_base = base_s / 2
    window = staging.config.effective_overlap_layers * mean_base / timer.num_layers
    averaged = 48 * staging.layer(8192, 40, window)[1] / mean_base
    assert averaged < 0.5 * predicted  # (here nothing: the long chunk's cover hides all of it)


def test_the_serving_config_and_the_staging_model_name_the_same_cold_expert_modes():
    """perf may not import core (docs/layers.md), so each layer spells the modes; they must agree."""
    from moetide.core.config import COLD_EXPERT_MODES as SERVING
    from moetide.perf.staging import COLD_EXPERT_MODES as MODELED

    assert SERVING == MODELED


def test_the_step_fill_weighs_each_step_by_its_time():
    """Decode batches of 16 tokens and 8K prefill chunks, one each in turn: the chunks take most of the time, so
    the time-weighted tokens per step sit near the chunk's, in the replay's timer and in the plugin's record
    alike (both what ``VampParams.step_fill`` reads)."""
    from moetide.core.experts import ExpertResidency, ExpertResidencyConfig
    from moetide.core.pressure.step_costs import EngineCosts, RecordSteps

    timer, _, _, _ = replay_timer()
    decode, prefill = (16, 16, 16, 16 * 4097, 16 * 4097), (8192, 1, 0, 8192, 8192 * 8193 // 2)
    record = RecordSteps(EngineCosts(prefill_s_per_token=1e-5, copy_s_per_expert=1e-4),
                         ExpertResidency(ExpertResidencyConfig(num_layers=2, num_experts=8, expert_bytes=1)), 2)
    for _ in range(20):
        for shape in (decode, prefill):
            timer(*shape)
            record.record(shape[0])
    d, p = (timer.step_model.step_time_s(*shape) for shape in (decode, prefill))
    assert timer.time_weighted_tokens() == pytest.approx((16 * d + 8192 * p) / (d + p), rel=1e-9)
    assert timer.time_weighted_tokens() > 0.5 * 8192
    # the record prices a step by its tokens: (16^2 + 8192^2) / (16 + 8192), within the last steps' decay
    assert record.time_weighted_tokens() == pytest.approx((16 ** 2 + 8192 ** 2) / (16 + 8192), rel=0.01)


def test_the_cost_record_from_a_device_is_the_replays_price_of_the_same_work():
    """``vamp_costs_from_device``: a prefill token at a full chunk's modeled seconds per token, a staged expert at
    its bytes over the host link, on the device and efficiency given."""
    from moetide.perf import StepTimeModel
    from moetide.perf.step import Efficiency, StepShape
    from moetide.perf.step_calibrate import vamp_costs_from_device

    m, gpu, eff = get_model("qwen3-30b-a3b"), get_gpu("h100"), Efficiency(matmul=0.5, step_overhead_s=1e-3)
    costs = vamp_costs_from_device(gpu, eff, m, chunk_tokens=4096, dtype_bytes=2)
    chunk_s = StepTimeModel(m, gpu, dtype_bytes=2, kv_dtype_bytes=2, efficiency=eff).step_time_s(
        *StepShape.prefill(4096).as_args())
    assert costs == {"prefill_s_per_token": pytest.approx(chunk_s / 4096),
                     "copy_s_per_expert": pytest.approx(m.expert_bytes(2) / gpu.host_link_bandwidth_bytes_per_s)}
    assert costs["prefill_s_per_token"] > 1e-3 / 4096  # the step overhead is in it
