"""perf.attention (CPU attention, transfer, device attention costs) and perf.offload (the step under a VRAM
budget, the planner's coefficients), pinned to hand arithmetic."""

from __future__ import annotations

import dataclasses

import pytest

from moetide.core.split_planner import SplitPlanner
from moetide.core.splits import (
    SPLIT_POLICIES,
    SeqResidency,
    SplitCosts,
    optimal_cpu_blocks,
    phase_time_s,
)
from moetide.errors import UserError
from moetide.perf.attention import AttentionCostModel, HostKVLayout, OffloadEfficiency
from moetide.perf.budget import GiB
from moetide.perf.offload import OffloadStepModel, SeqTokens, SplitCoefficients, fill_s, gpu_fixed_s, vram_layout
from moetide.perf.step import StepShape, StepTimeModel
from moetide.specs import get_gpu, get_host, get_model

HOST = get_host("ddr4-3200-8ch")  # 8 x 3200 MT/s x 8 B x 0.80 = 163.84 GB/s sustained; 2.944 TFLOP/s fp32
MiB = 2**20


def cost_model(model: str = "deepseek-v2-lite", gpu: str = "a100-80gb", **kw) -> AttentionCostModel:
    return AttentionCostModel(get_model(model), get_gpu(gpu), HOST, **kw)


def step_model(model: str = "deepseek-v2-lite", gpu: str = "a100-80gb", vram_gib: float = 32,
               **kw) -> OffloadStepModel:
    a = cost_model(model, gpu, **kw)
    layout = vram_layout(a.model, vram_bytes=int(vram_gib * GiB), device_kv_bytes=4 * GiB,
                         ring_bytes=a.layout.ring_bytes)
    return OffloadStepModel(a, StepTimeModel(a.model, a.gpu), layout)


# ---- perf.attention ---------------------------------------------------------------------------------------


def test_flops_per_kv_byte():
    # MLA absorbed, DeepSeek-V2-Lite: 16 heads x (2 (512 + 64) + 2 x 512) per pair / (576 x 2 B) = 30.2
    assert cost_model().flops_per_kv_byte() == pytest.approx(16 * 2176 / 1152)
    assert cost_model().flops_per_kv_byte(4) == pytest.approx(4 * 16 * 2176 / 1152)
    assert cost_model("qwen3-30b-a3b").flops_per_kv_byte() == 8.0  # GQA: 2 x 32/4 / 2 B
    assert cost_model("mixtral-8x7b").flops_per_kv_byte() == 4.0  # 2 x 32/8 / 2 B


def test_cpu_attention_roofline():
    memory_s = 1 / (163.84e9 * 0.9)
    assert cost_model("mixtral-8x7b").cpu_s_per_byte() == pytest.approx(memory_s)  # 4 FLOP/B: memory-bound
    mla = cost_model()
    assert mla.cpu_s_per_byte() == pytest.approx(16 * 2176 / 1152 / (2.944e12 * 0.5))  # compute-bound
    assert mla.cpu_attention_s(1e9) == pytest.approx(1e9 * mla.cpu_s_per_byte())
    half = cost_model(offload=OffloadEfficiency(cpu_available=0.5))
    assert half.cpu_s_per_byte() == pytest.approx(2 * mla.cpu_s_per_byte())


def test_transfer_block_size_and_coalescing():
    a = cost_model()  # one DMA per 64 blocks x 16 tokens x 1152 B per layer
    assert a.transfer_unit_bytes == 64 * 16 * 1152
    assert a.num_transfers(0) == 0 and a.num_transfers(1) == 1 and a.num_transfers(64 * 16 * 1152 + 1) == 2
    assert a.transfer_s(25e9, 1000) == pytest.approx(1.0 + 1000 * 5e-6)
    ring_bound = cost_model(layout=HostKVLayout(blocks_per_transfer=10**6, ring_bytes=64 * MiB, ring_slots=4))
    assert ring_bound.transfer_unit_bytes == 16 * MiB  # never more than one ring slot per DMA
    one_block = cost_model(layout=HostKVLayout(blocks_per_transfer=1))
    layer_bytes = 65536 * 1152
    coalesced = a.transfer_s(layer_bytes, a.num_transfers(layer_bytes))
    scattered = one_block.transfer_s(layer_bytes, one_block.num_transfers(layer_bytes))
    assert scattered > 7 * coalesced  # 18 KB DMAs: 5 us latency against 0.74 us of bytes each


def test_device_attention_and_query_traffic():
    a = cost_model()
    # 30.2 FLOP/B at 312 TFLOP/s x 0.5 vs 2.039 TB/s x 0.8: memory-bound on the A100
    assert a.device_s_per_byte() == pytest.approx(1 / (2.039e12 * 0.8))
    assert a.query_bytes() == 16 * 576 * 2 and a.partial_output_bytes() == 16 * 513 * 4
    g = cost_model("mixtral-8x7b")
    assert g.query_bytes(3) == 3 * 32 * 128 * 2 and g.partial_output_bytes() == 32 * 129 * 4
    assert a.cpu_seq_overhead_s() == pytest.approx(27 * (18432 + 32832) / 25e9)
    assert a.cpu_step_overhead_s() == pytest.approx(27 * (20e-6 + 2 * 5e-6))


def test_validation():
    with pytest.raises(ValueError, match="cpu_compute"):
        OffloadEfficiency(cpu_compute=1.5)
    with pytest.raises(ValueError, match="ring_slots"):
        HostKVLayout(ring_slots=0)


# ---- perf.offload: memory and non-attention --------------------------------------------------------------


def test_vram_layout_adds_up_and_refuses_what_does_not_fit():
    a = cost_model("mixtral-8x7b")
    lay = vram_layout(a.model, vram_bytes=32 * GiB, device_kv_bytes=4 * GiB, ring_bytes=256 * MiB)
    used = (lay.non_expert_bytes + lay.activation_reserve_bytes + lay.ring_bytes + lay.device_kv_bytes
            + lay.num_experts_resident * lay.expert_bytes)
    assert used <= 32 * GiB < used + lay.expert_bytes  # as many whole experts as fit
    assert lay.num_experts_total == 32 * 8 and 0.7 < lay.offloaded_expert_fraction < 0.8
    with pytest.raises(UserError, match="raise --gpu-memory"):
        vram_layout(a.model, vram_bytes=32 * GiB, device_kv_bytes=40 * GiB, ring_bytes=256 * MiB)


def test_non_attention_is_the_roofline_without_attention_plus_expert_staging():
    resident = step_model(vram_gib=80)  # every DeepSeek-V2-Lite expert fits in 80 GiB
    assert resident.layout.offloaded_expert_fraction == 0.0
    shape = StepShape.decode(16, 65536)
    bd = resident.step.breakdown(shape)
    assert resident.non_attention_s(shape) == pytest.approx(bd["total_s"] - bd["attention_s"])
    spilled = step_model("mixtral-8x7b")
    assert spilled.expert_offload_s(1) > 0.5  # ~74% of 2 experts x 352 MB x 32 layers over 25 GB/s
    assert spilled.expert_offload_s(128) > spilled.expert_offload_s(1)


def test_coefficients_are_the_planner_contract():
    assert [f.name for f in dataclasses.fields(SplitCoefficients)] == [f.name for f in dataclasses.fields(SplitCosts)]


# ---- perf.offload: the attention phase --------------------------------------------------------------------


def test_attention_phase_cpu_all_and_transfer_all_by_hand():
    m = step_model("mixtral-8x7b")
    a, tokens = m.attention, 1 << 20
    kv = tokens * 131072  # 32 layers x 2 x 8 heads x 128 x 2 B per token
    cpu_all = m.attention_phase([SeqTokens(1, tokens, 0)])
    assert cpu_all.cpu_s == pytest.approx(kv / (163.84e9 * 0.9) + a.cpu_step_overhead_s() + a.cpu_seq_overhead_s())
    assert cpu_all.gpu_s == pytest.approx(gpu_fixed_s(a, 1, 1) + 32 * 16512 / 25e9)
    streamed = m.attention_phase([SeqTokens(1, 0, tokens)])
    dmas = 32 * -(-(tokens * 4096) // (64 * 16 * 4096))
    assert streamed.cpu_s == 0.0
    assert streamed.gpu_s == pytest.approx(gpu_fixed_s(a, 1, 1) + kv / 25e9 + dmas * 5e-6 + fill_s(a, tokens * 4096, 1))


def _decode_case(m: OffloadStepModel, batch: int, context: int):
    per_seq = -(-(context + 1) // 16)
    device = min(per_seq, (m.layout.device_kv_bytes // m.attention.block_bytes) // batch)
    seqs = [SeqResidency(i, device, per_seq - device) for i in range(batch)]
    costs = SplitCosts(**dataclasses.asdict(m.coefficients(batch * (device * 16 + 1))))
    return seqs, costs


def _tokens(splits, context: int) -> list[SeqTokens]:
    out = []
    for s in splits:
        dev = min(context, s.num_device_blocks * 16)
        cpu = min(context - dev, s.num_cpu_blocks * 16)
        out.append(SeqTokens(dev + 1, cpu, context - dev - cpu))
    return out


@pytest.mark.parametrize("model", ["deepseek-v2-lite", "qwen3-30b-a3b", "mixtral-8x7b"])
def test_planner_model_tracks_the_charged_time(model):
    """The linear coefficients the planner optimises agree with the charged attention phase within 2%
    (the planner counts a whole DMA latency per sequence and layer where ceil() charges what is used)."""
    m = step_model(model)
    for batch, context in ((64, 16384), (1, 1 << 20)):
        seqs, costs = _decode_case(m, batch, context)
        for policy in SPLIT_POLICIES.values():
            splits = policy().split(costs, seqs, m.attention.block_bytes)
            charged = m.attention_phase(_tokens(splits, context)).total_s
            assert phase_time_s(costs, splits, m.attention.block_bytes) == pytest.approx(charged, rel=0.02)


def test_chunked_prefill_moves_the_cpu_share_to_zero():
    """One sequence, 64K host tokens, a prefill chunk of Q queries: CPU FLOPs and query/partial traffic grow with
    Q, streamed bytes do not; from some Q on the CPU gets nothing."""
    m = step_model()
    host_blocks = 65536 // 16
    shares = []
    for q in (1, 4, 16, 64, 256, 2048):
        costs = SplitCosts(**dataclasses.asdict(m.coefficients(q, num_queries=q)))
        shares.append(optimal_cpu_blocks(costs, [host_blocks], m.attention.block_bytes) / host_blocks)
    assert shares[0] > 0.5 and shares[-1] == 0.0
    assert all(later <= earlier for earlier, later in zip(shares, shares[1:]))


def test_online_feedback_against_the_charged_cpu_time():
    """The charged CPU side is 2x the model (a busy CPU); fed back each step, the split reaches within 5% of the
    optimum for the slower CPU after 6 measured steps, and the step time improves on the uncorrected split."""
    m, context = step_model(), 1 << 20
    seqs, costs = _decode_case(m, 1, context)
    bb = m.attention.block_bytes
    target = optimal_cpu_blocks(costs, [s.num_host_blocks for s in seqs], bb, factor=2.0)
    planner = SplitPlanner()
    first = planner.plan(costs, seqs, bb)
    plan = first
    for _ in range(6):
        planner.observe(plan, m.attention_phase(_tokens(plan.splits, context), cpu_slowdown=2.0).cpu_s)
        plan = planner.plan(costs, seqs, bb)
    assert abs(plan.cpu_bytes / bb - target) <= 0.05 * target
    slow = [m.attention_phase(_tokens(p.splits, context), cpu_slowdown=2.0).total_s for p in (first, plan)]
    assert slow[1] < 0.85 * slow[0]
