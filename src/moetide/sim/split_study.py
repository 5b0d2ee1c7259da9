"""The modeled WriteScope split study behind ``moetide plan-split``: for each context, ``batch`` sequences decode
one token each, their blocks placed as the engine's pool places them (``core.blocks``, two tiers: device blocks
first, host after; written in lockstep, so each sequence gets an equal share of the device, give or take one);
WriteScope and each policy of ``core.split_baselines.MODELED_POLICIES`` choose the split from coefficients that
``perf.offload`` derives, ``perf.host_share`` says what the MoE phase leaves the link and the CPU, and
``perf.offload`` charges the step with the policy's ``Mechanism``. Same model, GPU, host, VRAM layout and weights
for every policy. All figures are MODELED (docs/writescope.md says what and how).
"""

from __future__ import annotations

import dataclasses
import math

from moetide.core.blocks import BlockPool, HostTier
from moetide.core.split_planner import CorrectionConfig, SplitPlanner
from moetide.core.split_baselines import (
    NAMED_BASELINES,
    FastDecode,
    HybridGen,
    Monolithic,
    ScoutAttention,
    SolidAttention,
)
from moetide.core.splits import (
    BASELINES,
    CpuAll,
    FixedRatio,
    Mechanism,
    RequestSplit,
    SeqResidency,
    SplitCosts,
    SplitPolicy,
    TransferAll,
)
from moetide.errors import UserError
from moetide.perf.attention import AttentionCostModel, HostKVLayout
from moetide.perf.calibrate import offload_efficiency_for_host
from moetide.perf.host_share import HostPhase, host_phase, prefetch_bytes
from moetide.perf.offload import OffloadStepModel, SeqTokens, vram_layout
from moetide.perf.step import StepShape, StepTimeModel
from moetide.perf.step_calibrate import step_efficiency_for_gpu
from moetide.specs import get_gpu, get_host, get_model
from moetide.units import GiB, bytes_text, cdiv

COMPARED = (*BASELINES, *NAMED_BASELINES, "monolithic")
POLICIES = ("writescope", *COMPARED)
GEOMEAN_MIN_CONTEXT = 8 * 1024  # the WriteScope paper states its geometric-mean speedups over contexts >= 8K
MODELED_NOTE = ("MODELED step times (roofline of bytes and FLOPs against derated datasheet rates, a modeled "
                "CPU), not measurements; see docs/writescope.md")


@dataclasses.dataclass(frozen=True)
class SplitStudyConfig:
    """What one study is run with (``moetide plan-split``'s flags, sizes in bytes, the host resolved)."""

    model: str
    gpu: str
    cpu: str
    plan: tuple[tuple[int, int], ...]  # (context, batch) per row
    engine_profile: str
    gpu_memory: int = 32 * GiB
    kv_cache_memory: int = 4 * GiB
    ring_memory: int = 256 * 2**20
    ring_slots: int = 4
    block_size: int = 16
    blocks_per_transfer: int = 64
    split_fixed_ratio: float | None = 0.5  # None: the best single share over the contexts >= 8K ("tuned")
    cpu_slowdown: float = 1.0
    feedback_steps: int = 20
    host_experts: str = "stage"
    kv_prefetch: bool = True
    sparse_density: float = 0.125
    solid_locality: float = 0.8
    hybridgen_streams: bool = False


@dataclasses.dataclass(frozen=True)
class Setup:
    offload: OffloadStepModel
    config: SplitStudyConfig
    host_kv_capacity_bytes: int

    @property
    def attention(self) -> AttentionCostModel:
        return self.offload.attention


def build_setup(config: SplitStudyConfig) -> Setup:
    model, gpu, host = get_model(config.model), get_gpu(config.gpu), get_host(config.cpu)
    vram = config.gpu_memory
    if vram > gpu.hbm_bytes:
        raise UserError(f"--gpu-memory {bytes_text(vram)} exceeds {gpu.name}'s {gpu.hbm_bytes / GiB:.0f} GiB of HBM")
    kv_layout = HostKVLayout(block_size=config.block_size, blocks_per_transfer=config.blocks_per_transfer,
                             ring_bytes=int(config.ring_memory), ring_slots=config.ring_slots)
    try:
        efficiency = step_efficiency_for_gpu(config.gpu, config.engine_profile)
        attention = AttentionCostModel(model, gpu, host, layout=kv_layout, efficiency=efficiency,
                                       offload=offload_efficiency_for_host(config.cpu))
    except ValueError as exc:
        raise UserError(f"--model: {exc}") from None
    layout = vram_layout(model, vram_bytes=vram, device_kv_bytes=int(config.kv_cache_memory),
                         ring_bytes=kv_layout.ring_bytes)
    offloaded = (layout.num_experts_total - layout.num_experts_resident) * layout.expert_bytes
    step = StepTimeModel(model, gpu, efficiency=efficiency)
    return Setup(OffloadStepModel(attention, step, layout), config, host.dram_bytes - offloaded)


# ---- one context ------------------------------------------------------------------------------------------


def _place(setup: Setup, batch: int, context: int) -> list:
    """Blocks of ``batch`` sequences written in lockstep (all sequences' block i before any block i + 1)."""
    a = setup.attention
    num_blocks = cdiv(context + 1, a.layout.block_size)
    host_blocks_needed = batch * num_blocks * a.block_bytes
    if host_blocks_needed - setup.offload.layout.device_kv_bytes > setup.host_kv_capacity_bytes:
        raise UserError(f"context {context:,} x batch {batch:,} needs {host_blocks_needed / GiB:,.0f} GiB of KV; "
                        f"the host has {setup.host_kv_capacity_bytes / GiB:,.0f} GiB beside the offloaded experts; "
                        f"lower --batch or --aggregate-tokens")
    device_blocks = setup.offload.layout.device_kv_bytes // a.block_bytes
    tier = HostTier(device_blocks, batch * num_blocks)
    pool = BlockPool(range(device_blocks), enable_caching=False, host_tier=tier)
    held: list[list[int]] = [[] for _ in range(batch)]
    for _ in range(num_blocks):
        for blocks in held:
            blocks.extend(pool.allocate(1))  # type: ignore[arg-type]  (the tier holds every block asked for)
    return [SeqResidency(seq_id, len(blocks) - tier.count(blocks), tier.count(blocks))
            for seq_id, blocks in enumerate(held)]


def _tokens(split, context: int, block_size: int) -> SeqTokens:
    """Block counts to tokens: the last block holds the remainder; the new token is attended on the device;
    skipped blocks (a sparse policy's) are not attended."""
    device = min(context, split.num_device_blocks * block_size)
    cpu = min(context - device, split.num_cpu_blocks * block_size)
    streamed = min(context - device - cpu, split.num_streamed_blocks * block_size)
    return SeqTokens(device + 1, cpu, streamed)


@dataclasses.dataclass(frozen=True)
class Step:
    """One context's step as every policy sees it: the placed sequences, the MoE phase, the prefetch room."""

    context: int
    seqs: list
    phase: HostPhase
    prefetch_bytes: float
    costs: SplitCosts


def _step(setup: Setup, batch: int, context: int) -> Step:
    a = setup.attention
    seqs = _place(setup, batch, context)
    phase = host_phase(setup.offload, batch, setup.config.host_experts)
    prefetch = 0.0 if not setup.config.kv_prefetch else prefetch_bytes(setup.offload, phase)
    device_tokens = sum(min(context, s.num_device_blocks * a.layout.block_size) + 1 for s in seqs)
    costs = SplitCosts(**dataclasses.asdict(setup.offload.coefficients(device_tokens, 1, prefetch)))
    return Step(context, seqs, phase, prefetch, costs)


def _charge(setup: Setup, step: Step, splits, mechanism: Mechanism = Mechanism(), slowdown: float | None = None):
    """The attention phase of ``splits`` with the policy's mechanism and the host's idle link and CPU."""
    a = setup.attention
    toks = [_tokens(s, step.context, a.layout.block_size) for s in splits]
    streamed = sum(t.streamed_tokens for t in toks) * a.kv_bytes_per_token
    room = setup.offload.layout.device_kv_bytes  # a flattened (sparse) cache keeps its selection in the device pool
    return setup.offload.attention_phase(
        toks, 1, setup.config.cpu_slowdown if slowdown is None else slowdown, prefetch_bytes=step.prefetch_bytes,
        reuse_bytes=mechanism.reuse_fraction * min(streamed, room),
        cpu_head_start_s=step.phase.cpu_idle_s if mechanism.layer_ahead_cpu else 0.0,
        relayout_bytes=len(splits) * step.context * a.kv_bytes_per_token if mechanism.relayout else 0.0)


def _writescope(setup: Setup, step: Step) -> tuple:
    """Run the online loop: plan, charge with the true CPU slowdown, feed the measured CPU time back."""
    planner, slowdown = SplitPlanner(probe_every=0), setup.config.cpu_slowdown  # report the optimum, not a probe
    plan = planner.plan(step.costs, step.seqs, setup.attention.block_bytes)
    for _ in range(setup.config.feedback_steps if slowdown != 1.0 else 0):
        planner.observe(plan, _charge(setup, step, plan.splits).cpu_s)
        plan = planner.plan(step.costs, step.seqs, setup.attention.block_bytes)
    return plan.splits, plan.cpu_share


def _flatten(seqs: list) -> list:
    """A cache with no device-resident blocks: the device pool holds a sparse policy's selection instead."""
    return [SeqResidency(s.seq_id, 0, s.num_device_blocks + s.num_host_blocks) for s in seqs]


def compared_policies(config: SplitStudyConfig, fixed_ratio: float) -> dict[str, SplitPolicy]:
    return {"transfer-all": TransferAll(), "cpu-all": CpuAll(), "request-split": RequestSplit(),
            "fixed-ratio": FixedRatio(fixed_ratio), "solidattention": SolidAttention(config.sparse_density,
                                                                                     config.solid_locality),
            "scoutattention": ScoutAttention(config.sparse_density), "hybridgen": HybridGen(config.hybridgen_streams),
            "fastdecode": FastDecode(), "monolithic": Monolithic()}


def evaluate_context(setup: Setup, context: int, batch: int, fixed_ratio: float) -> dict:
    a = setup.attention
    step = _step(setup, batch, context)
    shape = StepShape.decode(batch, context)
    non_attention = setup.offload.non_attention_s(shape) - setup.offload.expert_offload_s(batch) + step.phase.extra_s
    ws_splits, share = _writescope(setup, step)
    attention = {"writescope": _charge(setup, step, ws_splits).total_s}
    shares = {"writescope": share}
    for name, policy in compared_policies(setup.config, fixed_ratio).items():
        seqs = _flatten(step.seqs) if name == "solidattention" else step.seqs
        factor = _converged_factor(setup) if name in ("hybridgen", "monolithic") else 1.0
        splits = policy.split(step.costs, seqs, a.block_bytes, factor)
        attention[name] = _charge(setup, step, splits, policy.mechanism).total_s
        attended = sum(x.num_cpu_blocks + x.num_streamed_blocks for x in splits)
        shares[name] = sum(x.num_cpu_blocks for x in splits) / attended if attended else 0.0
    return {"context": context, "batch": batch, "cpu_share": share, "cpu_shares": shares,
            "host_kv_bytes": sum(s.num_host_blocks for s in step.seqs) * a.block_bytes,
            "prefetch_bytes": step.prefetch_bytes, "host_phase": dataclasses.asdict(step.phase),
            "step_time_s": {p: non_attention + attention[p] for p in POLICIES},
            "attention_s": {p: attention[p] for p in POLICIES}, "non_attention_s": non_attention}


def _converged_factor(setup: Setup) -> float:
    """The CPU factor a feedback loop settles at, within the online correction's bounds (HybridGen's streaming
    reading and the monolithic ablation's planner get it, as writescope does); the static baselines use 1."""
    bounds = CorrectionConfig()
    slowdown = setup.config.cpu_slowdown if setup.config.feedback_steps else 1.0
    return min(bounds.max_factor, max(bounds.min_factor, slowdown))


# ---- all contexts -----------------------------------------------------------------------------------------


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def geomean_speedups(rows: list[dict], key: str = "step_time_s") -> dict | None:
    """Over rows with context >= 8K: the geometric mean of policy time / writescope time per compared policy, of
    the best of our four baselines' per row, of the best named baseline's per row, and of the per-policy figures
    over each group of four; None when no row qualifies."""
    kept = [r for r in rows if r["context"] >= GEOMEAN_MIN_CONTEXT]
    if not kept:
        return None
    per = {b: _geomean([r[key][b] / r[key]["writescope"] for r in kept]) for b in COMPARED}

    def best(group: tuple) -> float:
        return _geomean([min(r[key][b] for b in group) / r[key]["writescope"] for r in kept])

    return {"geomean_speedup": per, "over_best_baseline": best(BASELINES),
            "over_all_baselines": _geomean([per[b] for b in BASELINES]),
            "over_best_named_baseline": best(NAMED_BASELINES),
            "over_all_named_baselines": _geomean([per[b] for b in NAMED_BASELINES])}


def _tune_fixed_ratio(setup: Setup, plan: list[tuple[int, int]]) -> float:
    """The single CPU share (0.00 .. 1.00) with the smallest geometric-mean step time over the contexts >= 8K."""
    kept = [p for p in plan if p[0] >= GEOMEAN_MIN_CONTEXT] or plan
    steps = [_step(setup, batch, context) for context, batch in kept]

    def score(ratio: float) -> float:
        return sum(math.log(_charge(setup, st, FixedRatio(ratio).split(st.costs, st.seqs, setup.attention.block_bytes)
                                    ).total_s) for st in steps)

    return min((i / 100 for i in range(101)), key=score)


def evaluate(setup: Setup) -> dict:
    """Every context of the plan under every policy, and the geometric-mean speedups: the document
    ``report.split_plan`` renders."""
    config = setup.config
    plan = list(config.plan)
    ratio = _tune_fixed_ratio(setup, plan) if config.split_fixed_ratio is None else config.split_fixed_ratio
    rows = [evaluate_context(setup, c, b, ratio) for c, b in plan]
    e2e = geomean_speedups(rows) or {}
    doc = {"modeled": True, "note": MODELED_NOTE, "model": setup.attention.model.name,
           "gpu": setup.attention.gpu.name, "cpu": setup.attention.host.name,
           "cpu_model": setup.attention.host.cpu_model, "vram_gib": config.gpu_memory / GiB, "policies": list(POLICIES),
           "baselines": list(BASELINES), "named_baselines": list(NAMED_BASELINES),
           "fixed_ratio": ratio, "cpu_slowdown": config.cpu_slowdown, "host_experts": config.host_experts,
           "kv_prefetch": config.kv_prefetch, "sparse_density": config.sparse_density,
           "solid_locality": config.solid_locality, "feedback_steps": config.feedback_steps,
           "hybridgen_streams": config.hybridgen_streams,
           "layout": dataclasses.asdict(setup.offload.layout), "vram_layout": setup.offload.layout.describe(),
           "rates": _rates(setup), "rows": rows,
           "geomean_speedup": e2e.get("geomean_speedup"),
           "geomean_speedup_over_best_baseline": e2e.get("over_best_baseline"),
           "geomean_speedup_over_all_baselines": e2e.get("over_all_baselines"),
           "geomean_speedup_over_best_named_baseline": e2e.get("over_best_named_baseline"),
           "geomean_speedup_over_all_named_baselines": e2e.get("over_all_named_baselines"),
           "attention_phase": geomean_speedups(rows, "attention_s")}
    return doc


def _rates(setup: Setup) -> dict:
    """The rates the split is planned from (what the text's third line says), in GB/s of KV."""
    a = setup.attention
    return {"cpu_attention_gb_per_s": 1 / a.cpu_s_per_byte() / 1e9,
            "cpu_attention_bound": "compute" if a.cpu_compute_bound() else "memory",
            "flop_per_kv_byte": a.flops_per_kv_byte(), "link_gb_per_s": 1 / a.link_s_per_byte() / 1e9,
            "device_attention_gb_per_s": 1 / a.device_s_per_byte() / 1e9}
