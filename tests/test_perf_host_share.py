"""perf.host_share: where host experts run and what the MoE phase leaves the link and the CPU; the attention
phase's host keywords. Hand-computed from the presets: Qwen3-30B-A3B (an expert is 3 x 2048 x 768 bf16 weights,
9,437,184 B) on an A100 PCIe in 32 GiB beside a Xeon Gold 5318Y (8 x DDR4-2933 x 8 B x 0.80 = 150.17 GB/s,
1.6128 TFLOP/s fp32) with the default OffloadEfficiency (cpu_memory 0.9, cpu_compute 0.5, cpu_sync 20 us)."""

from __future__ import annotations

import math

import pytest

from moetide.perf.attention import AttentionCostModel
from moetide.perf.budget import GiB
from moetide.perf.host_share import cpu_expert_s, host_phase, prefetch_bytes
from moetide.perf.offload import OffloadStepModel, SeqTokens, vram_layout
from moetide.perf.step import StepShape, StepTimeModel
from moetide.specs import get_gpu, get_host, get_model

EXPERT_BYTES = 3 * 2048 * 768 * 2


@pytest.fixture(scope="module")
def model() -> OffloadStepModel:
    spec, gpu = get_model("qwen3-30b-a3b"), get_gpu("a100-pcie-40gb")
    attention = AttentionCostModel(spec, gpu, get_host("xeon-gold-5318y"))
    layout = vram_layout(spec, vram_bytes=32 * GiB, device_kv_bytes=4 * GiB, ring_bytes=256 * 2**20)
    return OffloadStepModel(attention, StepTimeModel(spec, gpu), layout)


def test_cpu_expert_time_is_the_host_roofline(model):
    assert model.layout.expert_bytes == EXPERT_BYTES
    memory = 10 * EXPERT_BYTES / (187.712e9 * 0.8 * 0.9)  # 698.3 us
    compute = 20 * EXPERT_BYTES / (1.6128e12 * 0.5)  # 234.1 us
    assert cpu_expert_s(model, 10, 20) == pytest.approx(20e-6 + max(memory, compute))
    assert cpu_expert_s(model, 1, 200) == pytest.approx(20e-6 + 200 * EXPERT_BYTES / 8.064e11)  # compute-bound


def test_staged_experts_keep_the_old_extra_and_busy_the_link(model):
    staged = host_phase(model, 128, "stage")
    assert staged.extra_s == pytest.approx(model.expert_offload_s(128))
    assert staged.cpu_busy_s == 0 and staged.link_busy_s > staged.extra_s > 0.5  # ~1.3 s of staging per step
    assert staged.link_idle_s < 0.1 * staged.link_busy_s  # the link is what the MoE phase waits on


def test_cpu_experts_free_the_link_and_busy_the_cpu(model):
    staged, on_cpu = host_phase(model, 128, "stage"), host_phase(model, 128, "cpu")
    assert on_cpu.link_busy_s == 0 and on_cpu.cpu_busy_s > 0
    assert on_cpu.extra_s < staged.extra_s / 3  # DRAM at 135 GB/s beats a 25 GB/s link for the same weights
    assert on_cpu.link_idle_s > staged.link_idle_s and on_cpu.cpu_idle_s < staged.cpu_idle_s
    with pytest.raises(ValueError, match="stage"):
        host_phase(model, 128, "disk")


def test_prefetch_is_bounded_by_half_the_ring_per_layer(model):
    a = model.attention
    on_cpu = host_phase(model, 128, "cpu")
    bound = a.num_layers * a.layout.ring_bytes / 2
    assert prefetch_bytes(model, on_cpu) == pytest.approx(min(on_cpu.link_idle_s * 25e9, bound))


def test_attention_phase_host_keywords(model):
    a = model.attention
    toks = [SeqTokens(1, 4096, 8192)]
    base = model.attention_phase(toks)
    head = model.attention_phase(toks, cpu_head_start_s=base.cpu_s / 4)
    assert head.cpu_s == pytest.approx(0.75 * base.cpu_s) and head.gpu_s == base.gpu_s
    assert model.attention_phase(toks, cpu_head_start_s=1.0).cpu_s == 0
    streamed = 8192 * a.kv_bytes_per_token
    fetched = model.attention_phase(toks, prefetch_bytes=streamed / 2, reuse_bytes=streamed / 2)
    assert fetched.gpu_s < base.gpu_s  # nothing crosses the link: the device's attention is what is left
    relaid = model.attention_phase(toks, relayout_bytes=1e9)
    assert relaid.serial_s == pytest.approx(2e9 / (187.712e9 * 0.8))  # a read and a write of 1 GB
    assert relaid.total_s == pytest.approx(base.total_s + relaid.serial_s)


def test_a_faulting_append_rewrites_at_its_share_of_dram():
    """``host_append`` (a DynamicCache's fresh tensor faulted in page by page: ~0.14 of triad, measured by
    benchmarks/host_append.py) divides the rewrite's rate and nothing else."""
    from moetide.perf.attention import OffloadEfficiency
    from moetide.perf.offload import attention_phase

    spec, gpu, host = get_model("qwen3-30b-a3b"), get_gpu("a100-pcie-40gb"), get_host("xeon-gold-5318y")
    mapped = AttentionCostModel(spec, gpu, host)
    faulting = AttentionCostModel(spec, gpu, host, offload=OffloadEfficiency(host_append=0.25))
    toks = [SeqTokens(1, 4096, 8192)]
    a, b = (attention_phase(m, toks, relayout_bytes=1e9) for m in (mapped, faulting))
    assert b.serial_s == pytest.approx(4 * a.serial_s) == pytest.approx(4 * 2e9 / (187.712e9 * 0.8))
    assert (b.cpu_s, b.gpu_s) == (a.cpu_s, a.gpu_s)
    assert attention_phase(faulting, toks) == attention_phase(mapped, toks)  # nothing rewritten: no charge
    with pytest.raises(ValueError, match="host_append"):
        OffloadEfficiency(host_append=0)


def test_split_experts_balance_the_link_and_the_cpu(model):
    """``split`` puts a share c of each layer's routed host experts on the CPU and stages the rest, the GPU
    computing the resident and the staged ones meanwhile: no slower than either place alone, and c is the best
    share on its grid, by hand: a layer's phase is max(staging, CPU, GPU compute) over its all-resident compute."""
    from moetide.perf.host_share import SPLIT_GRID

    staged, on_cpu, split = (host_phase(model, 128, place) for place in ("stage", "cpu", "split"))
    assert staged.cpu_expert_share == 0 and on_cpu.cpu_expert_share == 1
    assert 0 < split.cpu_expert_share < 1 and split.extra_s < min(staged.extra_s, on_cpu.extra_s)
    per_layer = model.step.distinct_experts_per_layer(128)
    assert len(set(per_layer)) == 1  # uniform routing: every MoE layer routes as many experts, so one share
    f_off, host = model.layout.offloaded_expert_fraction, model.layout.offloaded_expert_fraction * per_layer[0]
    compute = model.step.breakdown(StepShape(128, 1, 0, 0, 0))["experts_s"] / len(per_layer)
    latency = model.attention.offload.transfer_latency_s

    def phase(c: float) -> tuple[float, float, float]:
        link = (1 - c) * host * EXPERT_BYTES / 25e9 + math.ceil((1 - c) * host) * latency
        cpu = cpu_expert_s(model, c * host, c * 128 * 8 * f_off)
        return max(link, cpu, (1 - c * f_off) * compute) - compute, link, cpu

    c, step = split.cpu_expert_share, 1 / SPLIT_GRID
    extra, link, cpu = phase(c)
    assert split.extra_s == pytest.approx(len(per_layer) * extra)
    assert split.link_busy_s == pytest.approx(len(per_layer) * link)
    assert split.cpu_busy_s == pytest.approx(len(per_layer) * cpu)
    assert extra <= phase(c - step)[0] and extra <= phase(c + step)[0]
