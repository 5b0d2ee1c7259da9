"""``moetide plan-split``: the modeled WriteScope split of host-spilled KV, against our four baselines, the
WriteScope paper's four named ones and its monolithic-cache ablation, per context.

For each context, ``--batch`` sequences (default: as many as make ``--aggregate-tokens`` of KV in total) decode one
token each. Their blocks are placed as the engine's pool places them (``core.blocks``, two tiers: device blocks
first, host after; written in lockstep, so each sequence gets an equal share of the device, give or take one);
each policy of ``core.split_baselines.MODELED_POLICIES`` chooses the split from coefficients that ``perf.offload``
derives, ``perf.host_share`` says what the MoE phase leaves the link and the CPU, and ``perf.offload`` charges the
step with the policy's ``Mechanism``. Same model, GPU, host, VRAM layout and weights for every policy. All figures
are MODELED (docs/writescope.md says what and how).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re

from moetide.commands.options import (add_json_argument, bytes_text, check_outputs, human_output, parse_bytes,
                                      write_json_output)
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
from moetide.perf.engines import DEFAULT_ENGINE_PROFILE, engine_profiles
from moetide.perf.budget import GiB
from moetide.perf.host_share import HOST_EXPERT_PLACES, HostPhase, host_phase, prefetch_bytes
from moetide.perf.offload import OffloadStepModel, SeqTokens, vram_layout
from moetide.perf.step import StepShape, StepTimeModel
from moetide.perf.step_calibrate import step_efficiency_for_gpu
from moetide.report import split_plan
from moetide.specs import get_gpu, get_host, get_model, host_for
from moetide.units import cdiv

MiB = 2**20
COMPARED = (*BASELINES, *NAMED_BASELINES, "monolithic")
POLICIES = ("writescope", *COMPARED)
GEOMEAN_MIN_CONTEXT = 8 * 1024  # the WriteScope paper states its geometric-mean speedups over contexts >= 8K
DEFAULT_CONTEXTS = "8k,16k,32k,64k,128k,256k,512k,1M"
_SUFFIX = {"": 1, "k": 1024, "m": 1024**2}
_TOKENS_RE = re.compile(r"^(\d+)([kKmM]?)$")
MODELED_NOTE = ("MODELED step times (roofline of bytes and FLOPs against derated datasheet rates, a modeled "
                "CPU), not measurements; see docs/writescope.md")


def parse_tokens(text: str, flag: str) -> int:
    """'8k' -> 8192, '1M' -> 1048576, '4096' -> 4096 (binary k and M, as context lengths are quoted)."""
    match = _TOKENS_RE.match(text.strip())
    if not match or int(match.group(1)) <= 0:
        raise UserError(f"{flag}: {text.strip()!r} is not a positive token count (e.g. 8k, 128k, 1M, 4096)")
    return int(match.group(1)) * _SUFFIX[match.group(2).lower()]


def parse_contexts(text: str) -> list[int]:
    items = [t for t in text.split(",")]
    if not text.strip() or any(not t.strip() for t in items):
        raise UserError(f"--context: expected a comma-separated list such as {DEFAULT_CONTEXTS}, got {text!r}")
    return [parse_tokens(t, "--context") for t in items]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="NAME|CONFIG_JSON", help="preset model or HF config.json")
    parser.add_argument("--gpu", required=True, metavar="NAME|FILE", help="preset GPU or hardware file")
    parser.add_argument("--engine-profile", default=DEFAULT_ENGINE_PROFILE, choices=engine_profiles(),
                        help="the step model's fitted efficiency for a GPU preset (default %(default)s; roofline: "
                             "none; docs/perf.md)")
    parser.add_argument("--cpu", metavar="NAME|FILE",
                        help="host CPU socket, a preset or hardware file (default: the GPU's host, e.g. ddr4-3200-8ch "
                             "beside an A100)")
    parser.add_argument("--gpu-memory", type=parse_bytes, default=32 * GiB, metavar="SIZE",
                        help="device memory the layout may use: weights, reserve, ring, device KV and resident "
                             "experts (default 32GiB)")
    parser.add_argument("--context", default=DEFAULT_CONTEXTS, metavar="LIST",
                        help=f"cached tokens per sequence, comma-separated (default {DEFAULT_CONTEXTS})")
    parser.add_argument("--batch", type=int, metavar="B", help="sequences per step (default: aggregate / context)")
    parser.add_argument("--aggregate-tokens", default="1M", metavar="N",
                        help="without --batch: batch = max(1, N / context) (default 1M)")
    parser.add_argument("--kv-cache-memory", type=parse_bytes, default=4 * GiB, metavar="SIZE",
                        help="device KV cache (default 4GiB)")
    parser.add_argument("--ring-memory", type=parse_bytes, default=256 * MiB, metavar="SIZE",
                        help="staging ring (default 256MiB)")
    parser.add_argument("--ring-slots", type=int, default=4, metavar="N", help="ring slots (default 4)")
    parser.add_argument("--block-size", type=int, default=16, metavar="N", help="KV block size in tokens (16)")
    parser.add_argument("--blocks-per-transfer", type=int, default=64, metavar="N",
                        help="host blocks per contiguous extent, one DMA each (default 64; 1 = no coalescing)")
    parser.add_argument("--split-fixed-ratio", default="0.5", metavar="R|tuned",
                        help="fixed-ratio baseline's CPU share, or 'tuned': the best single share over the "
                             "contexts >= 8K (default 0.5)")
    parser.add_argument("--cpu-slowdown", type=float, default=1.0, metavar="F",
                        help="true CPU time / modeled (a busy CPU); writescope learns it online (default 1)")
    parser.add_argument("--feedback-steps", type=int, default=20, metavar="N",
                        help="online-correction steps writescope runs before its split is charged (default 20)")
    parser.add_argument("--host-experts", choices=HOST_EXPERT_PLACES, default="stage",
                        help="where the experts that do not fit in VRAM run: staged over the link to the GPU, on "
                             "the host CPU as KTransformers does, or split between the two per layer, the share that "
                             "shortens the MoE phase most (default stage)")
    parser.add_argument("--no-kv-prefetch", action="store_true",
                        help="the link does not prefetch streamed KV while it idles in the MoE phase")
    parser.add_argument("--sparse-density", type=float, default=0.125, metavar="F",
                        help="share of host KV blocks the sparse baselines (ScoutAttention, SolidAttention) attend "
                             "(default 0.125, assumed)")
    parser.add_argument("--solid-locality", type=float, default=0.8, metavar="F",
                        help="share of SolidAttention's selection that repeats step to step (default 0.8, assumed)")
    parser.add_argument("--hybridgen-streams", action="store_true",
                        help="the generous reading of HybridGen: its feedback may also stream host KV (default: "
                             "each processor attends the tokens in its own memory)")
    add_json_argument(parser, "the results (instead of the tables)")
    parser.add_argument("--plot", metavar="PATH", help="also write a plot (needs matplotlib: the 'plot' extra)")


def _check_args(args: argparse.Namespace) -> None:
    positive = {"--ring-memory": args.ring_memory, "--ring-slots": args.ring_slots, "--block-size": args.block_size,
                "--blocks-per-transfer": args.blocks_per_transfer, "--feedback-steps": args.feedback_steps}
    if args.batch is not None:
        positive["--batch"] = args.batch
    for flag, value in positive.items():
        if value <= 0:
            raise UserError(f"{flag} must be a positive integer, got {value}")
    for flag, value in {"--gpu-memory": args.gpu_memory, "--cpu-slowdown": args.cpu_slowdown}.items():
        if not (math.isfinite(value) and value > 0):
            raise UserError(f"{flag} must be a positive number, got {value}")
    if not 0 < args.sparse_density <= 1:
        raise UserError(f"--sparse-density: a share of blocks must be in (0, 1], got {args.sparse_density}")
    if not 0 <= args.solid_locality < 1:
        raise UserError(f"--solid-locality: a share of blocks must be in [0, 1), got {args.solid_locality}")
    check_outputs(args)
    if not args.kv_cache_memory >= 0:
        raise UserError(f"--kv-cache-memory must be >= 0, got {args.kv_cache_memory:g}")
    if args.split_fixed_ratio != "tuned":
        try:
            ratio = float(args.split_fixed_ratio)
        except ValueError:
            raise UserError(f"--split-fixed-ratio: expected a CPU share in [0, 1] or 'tuned', got "
                            f"{args.split_fixed_ratio!r}")
        if not 0 <= ratio <= 1:
            raise UserError(f"--split-fixed-ratio: a CPU share must be in [0, 1], got {ratio}")


@dataclasses.dataclass(frozen=True)
class Setup:
    offload: OffloadStepModel
    args: argparse.Namespace
    host_kv_capacity_bytes: int

    @property
    def attention(self) -> AttentionCostModel:
        return self.offload.attention


def build_setup(args: argparse.Namespace) -> Setup:
    model, gpu = get_model(args.model), get_gpu(args.gpu)
    args.cpu = host_for(args.cpu, gpu)
    host = get_host(args.cpu)
    vram = int(args.gpu_memory)
    if vram > gpu.hbm_bytes:
        raise UserError(f"--gpu-memory {bytes_text(vram)} exceeds {gpu.name}'s {gpu.hbm_bytes / GiB:.0f} GiB of HBM")
    kv_layout = HostKVLayout(block_size=args.block_size, blocks_per_transfer=args.blocks_per_transfer,
                             ring_bytes=int(args.ring_memory), ring_slots=args.ring_slots)
    try:
        efficiency = step_efficiency_for_gpu(args.gpu, args.engine_profile)
        attention = AttentionCostModel(model, gpu, host, layout=kv_layout, efficiency=efficiency,
                                       offload=offload_efficiency_for_host(args.cpu))
    except ValueError as exc:
        raise UserError(f"--model: {exc}") from None
    layout = vram_layout(model, vram_bytes=vram, device_kv_bytes=int(args.kv_cache_memory),
                         ring_bytes=kv_layout.ring_bytes)
    offloaded = (layout.num_experts_total - layout.num_experts_resident) * layout.expert_bytes
    step = StepTimeModel(model, gpu, efficiency=efficiency)
    return Setup(OffloadStepModel(attention, step, layout), args, host.dram_bytes - offloaded)


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
    phase = host_phase(setup.offload, batch, setup.args.host_experts)
    prefetch = 0.0 if setup.args.no_kv_prefetch else prefetch_bytes(setup.offload, phase)
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
        toks, 1, setup.args.cpu_slowdown if slowdown is None else slowdown, prefetch_bytes=step.prefetch_bytes,
        reuse_bytes=mechanism.reuse_fraction * min(streamed, room),
        cpu_head_start_s=step.phase.cpu_idle_s if mechanism.layer_ahead_cpu else 0.0,
        relayout_bytes=len(splits) * step.context * a.kv_bytes_per_token if mechanism.relayout else 0.0)


def _writescope(setup: Setup, step: Step) -> tuple:
    """Run the online loop: plan, charge with the true CPU slowdown, feed the measured CPU time back."""
    planner, slowdown = SplitPlanner(probe_every=0), setup.args.cpu_slowdown  # report the optimum, not a probe
    plan = planner.plan(step.costs, step.seqs, setup.attention.block_bytes)
    for _ in range(setup.args.feedback_steps if slowdown != 1.0 else 0):
        planner.observe(plan, _charge(setup, step, plan.splits).cpu_s)
        plan = planner.plan(step.costs, step.seqs, setup.attention.block_bytes)
    return plan.splits, plan.cpu_share


def _flatten(seqs: list) -> list:
    """A cache with no device-resident blocks: the device pool holds a sparse policy's selection instead."""
    return [SeqResidency(s.seq_id, 0, s.num_device_blocks + s.num_host_blocks) for s in seqs]


def compared_policies(args: argparse.Namespace, fixed_ratio: float) -> dict[str, SplitPolicy]:
    return {"transfer-all": TransferAll(), "cpu-all": CpuAll(), "request-split": RequestSplit(),
            "fixed-ratio": FixedRatio(fixed_ratio), "solidattention": SolidAttention(args.sparse_density,
                                                                                     args.solid_locality),
            "scoutattention": ScoutAttention(args.sparse_density), "hybridgen": HybridGen(args.hybridgen_streams),
            "fastdecode": FastDecode(), "monolithic": Monolithic()}


def evaluate_context(setup: Setup, context: int, batch: int, fixed_ratio: float) -> dict:
    a = setup.attention
    step = _step(setup, batch, context)
    shape = StepShape.decode(batch, context)
    non_attention = setup.offload.non_attention_s(shape) - setup.offload.expert_offload_s(batch) + step.phase.extra_s
    ws_splits, share = _writescope(setup, step)
    attention = {"writescope": _charge(setup, step, ws_splits).total_s}
    shares = {"writescope": share}
    for name, policy in compared_policies(setup.args, fixed_ratio).items():
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
    slowdown = setup.args.cpu_slowdown if setup.args.feedback_steps else 1.0
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


def _batches(args: argparse.Namespace, contexts: list[int]) -> list[int]:
    if args.batch is not None:
        return [args.batch] * len(contexts)
    aggregate = parse_tokens(args.aggregate_tokens, "--aggregate-tokens")
    return [max(1, aggregate // c) for c in contexts]


def _tune_fixed_ratio(setup: Setup, plan: list[tuple[int, int]]) -> float:
    """The single CPU share (0.00 .. 1.00) with the smallest geometric-mean step time over the contexts >= 8K."""
    kept = [p for p in plan if p[0] >= GEOMEAN_MIN_CONTEXT] or plan
    steps = [_step(setup, batch, context) for context, batch in kept]

    def score(ratio: float) -> float:
        return sum(math.log(_charge(setup, st, FixedRatio(ratio).split(st.costs, st.seqs, setup.attention.block_bytes)
                                    ).total_s) for st in steps)

    return min((i / 100 for i in range(101)), key=score)


def evaluate(args: argparse.Namespace, setup: Setup) -> dict:
    contexts = parse_contexts(args.context)
    plan = list(zip(contexts, _batches(args, contexts)))
    ratio = _tune_fixed_ratio(setup, plan) if args.split_fixed_ratio == "tuned" else float(args.split_fixed_ratio)
    rows = [evaluate_context(setup, c, b, ratio) for c, b in plan]
    e2e = geomean_speedups(rows) or {}
    doc = {"modeled": True, "note": MODELED_NOTE, "model": setup.attention.model.name,
           "gpu": setup.attention.gpu.name, "cpu": setup.attention.host.name,
           "cpu_model": setup.attention.host.cpu_model, "vram_gib": args.gpu_memory / GiB, "policies": list(POLICIES),
           "baselines": list(BASELINES), "named_baselines": list(NAMED_BASELINES),
           "fixed_ratio": ratio, "cpu_slowdown": args.cpu_slowdown, "host_experts": args.host_experts,
           "kv_prefetch": not args.no_kv_prefetch, "sparse_density": args.sparse_density,
           "solid_locality": args.solid_locality, "feedback_steps": args.feedback_steps,
           "hybridgen_streams": args.hybridgen_streams,
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
    h = a.host
    compute_bound = a.flops_per_kv_byte() / (h.fp32_flops_per_s * a.offload.cpu_compute) > 1 / (
        h.dram_bandwidth_bytes_per_s * a.offload.cpu_memory)
    return {"cpu_attention_gb_per_s": 1 / a.cpu_s_per_byte() / 1e9,
            "cpu_attention_bound": "compute" if compute_bound else "memory",
            "flop_per_kv_byte": a.flops_per_kv_byte(), "link_gb_per_s": 1 / a.link_s_per_byte() / 1e9,
            "device_attention_gb_per_s": 1 / a.device_s_per_byte() / 1e9}


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    setup = build_setup(args)
    doc = evaluate(args, setup)
    if args.plot:
        split_plan.plot(doc, args.plot)
    if args.json != "-":
        print(split_plan.text(doc))
    if args.json is not None:
        write_json_output(args.json, json.dumps(doc, indent=2))
    with human_output(args.json):
        for flag in ("json", "plot"):
            if getattr(args, flag) not in (None, "-"):
                print(f"wrote {getattr(args, flag)}")
    return 0
