"""``moetide plan-split``: the modeled WriteScope split of host-spilled KV, against four baselines, per context.

For each context, ``--batch`` sequences (default: as many as make ``--aggregate-tokens`` of KV in total) decode one
token each. Their blocks are placed by ``core.splits.BlockPlacement`` (device pool shared equally, host after);
each policy of ``core.splits.SPLIT_POLICIES`` chooses the split from coefficients that ``perf.offload`` derives, and
``perf.offload`` charges the step. Same model, GPU, host, VRAM layout and weights for every policy: only the
placement of host-KV attention differs. All figures are MODELED (docs/writescope.md says what and how).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re

from moetide.core.split_planner import SplitPlanner
from moetide.core.splits import (
    BASELINES,
    SPLIT_POLICIES,
    BlockPlacement,
    FixedRatio,
    SplitCosts,
    SplitPolicy,
)
from moetide.errors import UserError
from moetide.perf.attention import AttentionCostModel, HostKVLayout
from moetide.perf.calibrate import offload_efficiency_for_host
from moetide.perf.budget import GiB, cdiv
from moetide.perf.offload import OffloadStepModel, SeqTokens, vram_layout
from moetide.perf.step import StepShape, StepTimeModel
from moetide.report.tables import format_table
from moetide.specs import get_gpu, get_host, get_model

MiB = 2**20
POLICIES = ("writescope", *BASELINES)
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
    parser.add_argument("--cpu", default="ddr4-3200-8ch", metavar="NAME|FILE",
                        help="preset host CPU socket or hardware file (default ddr4-3200-8ch)")
    parser.add_argument("--vram-gib", type=float, default=32.0, metavar="GIB",
                        help="VRAM budget: weights, reserve, ring, device KV and resident experts (default 32)")
    parser.add_argument("--context", default=DEFAULT_CONTEXTS, metavar="LIST",
                        help=f"cached tokens per sequence, comma-separated (default {DEFAULT_CONTEXTS})")
    parser.add_argument("--batch", type=int, metavar="B", help="sequences per step (default: aggregate / context)")
    parser.add_argument("--aggregate-tokens", default="1M", metavar="N",
                        help="without --batch: batch = max(1, N / context) (default 1M)")
    parser.add_argument("--device-kv-gib", type=float, default=4.0, metavar="GIB", help="device KV pool (default 4)")
    parser.add_argument("--ring-mib", type=int, default=256, metavar="MIB", help="staging ring (default 256)")
    parser.add_argument("--ring-slots", type=int, default=4, metavar="N", help="ring slots (default 4)")
    parser.add_argument("--block-size", type=int, default=16, metavar="N", help="KV block size in tokens (16)")
    parser.add_argument("--blocks-per-transfer", type=int, default=64, metavar="N",
                        help="host blocks per contiguous extent, one DMA each (default 64; 1 = no coalescing)")
    parser.add_argument("--fixed-ratio", default="0.5", metavar="R|tuned",
                        help="fixed-ratio baseline's CPU share, or 'tuned': the best single share over the "
                             "contexts >= 8K (default 0.5)")
    parser.add_argument("--cpu-slowdown", type=float, default=1.0, metavar="F",
                        help="true CPU time / modeled (a busy CPU); writescope learns it online (default 1)")
    parser.add_argument("--feedback-steps", type=int, default=20, metavar="N",
                        help="online-correction steps writescope runs before its split is charged (default 20)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--plot", metavar="PATH", help="also write a plot (needs matplotlib: the 'plot' extra)")


def _check_args(args: argparse.Namespace) -> None:
    positive = {"--ring-mib": args.ring_mib, "--ring-slots": args.ring_slots, "--block-size": args.block_size,
                "--blocks-per-transfer": args.blocks_per_transfer, "--feedback-steps": args.feedback_steps}
    if args.batch is not None:
        positive["--batch"] = args.batch
    for flag, value in positive.items():
        if value <= 0:
            raise UserError(f"{flag} must be a positive integer, got {value}")
    for flag, value in {"--vram-gib": args.vram_gib, "--cpu-slowdown": args.cpu_slowdown}.items():
        if not (math.isfinite(value) and value > 0):
            raise UserError(f"{flag} must be a positive number, got {value}")
    if not (math.isfinite(args.device_kv_gib) and args.device_kv_gib >= 0):
        raise UserError(f"--device-kv-gib must be >= 0, got {args.device_kv_gib}")
    if args.fixed_ratio != "tuned":
        try:
            ratio = float(args.fixed_ratio)
        except ValueError:
            raise UserError(f"--fixed-ratio: expected a CPU share in [0, 1] or 'tuned', got {args.fixed_ratio!r}")
        if not 0 <= ratio <= 1:
            raise UserError(f"--fixed-ratio: a CPU share must be in [0, 1], got {ratio}")


@dataclasses.dataclass(frozen=True)
class Setup:
    offload: OffloadStepModel
    args: argparse.Namespace
    host_kv_capacity_bytes: int

    @property
    def attention(self) -> AttentionCostModel:
        return self.offload.attention


def build_setup(args: argparse.Namespace) -> Setup:
    model, gpu, host = get_model(args.model), get_gpu(args.gpu), get_host(args.cpu)
    vram = int(args.vram_gib * GiB)
    if vram > gpu.hbm_bytes:
        raise UserError(f"--vram-gib {args.vram_gib:g} exceeds {gpu.name}'s {gpu.hbm_bytes / GiB:.0f} GiB of HBM")
    kv_layout = HostKVLayout(block_size=args.block_size, blocks_per_transfer=args.blocks_per_transfer,
                             ring_bytes=args.ring_mib * MiB, ring_slots=args.ring_slots)
    try:
        attention = AttentionCostModel(model, gpu, host, layout=kv_layout,
                                       offload=offload_efficiency_for_host(args.cpu))
    except ValueError as exc:
        raise UserError(f"--model: {exc}") from None
    layout = vram_layout(model, vram_bytes=vram, device_kv_bytes=int(args.device_kv_gib * GiB),
                         ring_bytes=kv_layout.ring_bytes)
    offloaded = (layout.num_experts_total - layout.num_experts_resident) * layout.expert_bytes
    return Setup(OffloadStepModel(attention, StepTimeModel(model, gpu), layout), args, host.dram_bytes - offloaded)


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
    placement = BlockPlacement(device_blocks, batch * num_blocks, max_device_blocks_per_seq=device_blocks // batch)
    for _ in range(num_blocks):
        for seq_id in range(batch):
            placement.place(seq_id)
    return [placement.residency(seq_id) for seq_id in range(batch)]


def _tokens(split, context: int, block_size: int) -> SeqTokens:
    """Block counts to tokens: the last block holds the remainder; the new token is attended on the device."""
    device = min(context, split.num_device_blocks * block_size)
    cpu = min(context - device, split.num_cpu_blocks * block_size)
    return SeqTokens(device + 1, cpu, context - device - cpu)


def _charge(setup: Setup, splits, context: int, slowdown: float):
    toks = [_tokens(s, context, setup.attention.layout.block_size) for s in splits]
    return setup.offload.attention_phase(toks, 1, slowdown)


def _writescope(setup: Setup, costs: SplitCosts, seqs: list, context: int) -> tuple:
    """Run the online loop: plan, charge with the true CPU slowdown, feed the measured CPU time back."""
    planner, slowdown = SplitPlanner(probe_every=0), setup.args.cpu_slowdown  # report the optimum, not a probe
    plan = planner.plan(costs, seqs, setup.attention.block_bytes)
    for _ in range(setup.args.feedback_steps if slowdown != 1.0 else 0):
        planner.observe(plan, _charge(setup, plan.splits, context, slowdown).cpu_s)
        plan = planner.plan(costs, seqs, setup.attention.block_bytes)
    return plan.splits, plan.cpu_share


def evaluate_context(setup: Setup, context: int, batch: int, fixed_ratio: float) -> dict:
    a, slowdown = setup.attention, setup.args.cpu_slowdown
    seqs = _place(setup, batch, context)
    device_tokens = sum(min(context, s.num_device_blocks * a.layout.block_size) + 1 for s in seqs)
    costs = SplitCosts(**dataclasses.asdict(setup.offload.coefficients(device_tokens)))
    non_attention = setup.offload.non_attention_s(StepShape.decode(batch, context))
    ws_splits, share = _writescope(setup, costs, seqs, context)
    attention = {"writescope": _charge(setup, ws_splits, context, slowdown).total_s}
    policies: dict[str, SplitPolicy] = {name: SPLIT_POLICIES[name]() for name in BASELINES}
    policies["fixed-ratio"] = FixedRatio(fixed_ratio)
    for name, policy in policies.items():
        attention[name] = _charge(setup, policy.split(costs, seqs, a.block_bytes), context, slowdown).total_s
    return {"context": context, "batch": batch, "cpu_share": share,
            "host_kv_bytes": sum(s.num_host_blocks for s in seqs) * a.block_bytes,
            "step_time_s": {p: non_attention + attention[p] for p in POLICIES},
            "attention_s": {p: attention[p] for p in POLICIES}, "non_attention_s": non_attention}


# ---- all contexts -----------------------------------------------------------------------------------------


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def geomean_speedups(rows: list[dict], key: str = "step_time_s") -> dict | None:
    """Over rows with context >= 8K: the geometric mean of baseline time / writescope time per baseline, of the
    best baseline's per row, and of the four per-baseline figures; None when no row qualifies."""
    kept = [r for r in rows if r["context"] >= GEOMEAN_MIN_CONTEXT]
    if not kept:
        return None
    per = {b: _geomean([r[key][b] / r[key]["writescope"] for r in kept]) for b in BASELINES}
    best = _geomean([min(r[key][b] for b in BASELINES) / r[key]["writescope"] for r in kept])
    return {"geomean_speedup": per, "over_best_baseline": best, "over_all_baselines": _geomean(list(per.values()))}


def _batches(args: argparse.Namespace, contexts: list[int]) -> list[int]:
    if args.batch is not None:
        return [args.batch] * len(contexts)
    aggregate = parse_tokens(args.aggregate_tokens, "--aggregate-tokens")
    return [max(1, aggregate // c) for c in contexts]


def _tune_fixed_ratio(setup: Setup, plan: list[tuple[int, int]]) -> float:
    """The single CPU share (0.00 .. 1.00) with the smallest geometric-mean step time over the contexts >= 8K."""
    kept = [p for p in plan if p[0] >= GEOMEAN_MIN_CONTEXT] or plan
    prepared = []
    for context, batch in kept:
        seqs = _place(setup, batch, context)
        dev = sum(min(context, s.num_device_blocks * setup.attention.layout.block_size) + 1 for s in seqs)
        prepared.append((context, seqs, SplitCosts(**dataclasses.asdict(setup.offload.coefficients(dev)))))

    def score(ratio: float) -> float:
        return sum(math.log(_charge(setup, FixedRatio(ratio).split(costs, seqs, setup.attention.block_bytes),
                                    context, setup.args.cpu_slowdown).total_s) for context, seqs, costs in prepared)

    return min((i / 100 for i in range(101)), key=score)


def evaluate(args: argparse.Namespace, setup: Setup) -> dict:
    contexts = parse_contexts(args.context)
    plan = list(zip(contexts, _batches(args, contexts)))
    ratio = _tune_fixed_ratio(setup, plan) if args.fixed_ratio == "tuned" else float(args.fixed_ratio)
    rows = [evaluate_context(setup, c, b, ratio) for c, b in plan]
    e2e = geomean_speedups(rows) or {}
    doc = {"modeled": True, "note": MODELED_NOTE, "model": setup.attention.model.name,
           "gpu": setup.attention.gpu.name, "cpu": setup.attention.host.name, "vram_gib": args.vram_gib,
           "fixed_ratio": ratio, "cpu_slowdown": args.cpu_slowdown,
           "layout": dataclasses.asdict(setup.offload.layout), "rows": rows,
           "geomean_speedup": e2e.get("geomean_speedup"),
           "geomean_speedup_over_best_baseline": e2e.get("over_best_baseline"),
           "geomean_speedup_over_all_baselines": e2e.get("over_all_baselines"),
           "attention_phase": geomean_speedups(rows, "attention_s")}
    return doc


# ---- output -----------------------------------------------------------------------------------------------


def _rates_line(setup: Setup) -> str:
    a = setup.attention
    cpu_rate, link_rate = 1 / a.cpu_s_per_byte() / 1e9, 1 / a.link_s_per_byte() / 1e9
    h = a.host
    bound = "compute" if a.flops_per_kv_byte() / (h.fp32_flops_per_s * a.offload.cpu_compute) > 1 / (
        h.dram_bandwidth_bytes_per_s * a.offload.cpu_memory) else "memory"
    return (f"CPU attention {cpu_rate:,.1f} GB/s of KV ({bound}-bound, {a.flops_per_kv_byte():.1f} FLOP per KV byte); "
            f"host link {link_rate:,.1f} GB/s; device attention {1 / a.device_s_per_byte() / 1e9:,.0f} GB/s")


def _fmt_tokens(n: int) -> str:
    for suffix, unit in (("M", 1024**2), ("k", 1024)):
        if n % unit == 0:
            return f"{n // unit}{suffix}"
    return f"{n:,}"


def _text(doc: dict, setup: Setup) -> str:
    head = (f"{doc['model']} on {doc['gpu']} + {doc['cpu']} ({setup.attention.host.cpu_model}), VRAM budget "
            f"{doc['vram_gib']:g} GiB; fixed-ratio = {doc['fixed_ratio']:.2f}, CPU slowdown {doc['cpu_slowdown']:g}"
            f"\n{MODELED_NOTE}\n{_rates_line(setup)}")
    layout = format_table(["VRAM", "bytes"], setup.offload.layout.describe(), align="<<")
    headers = ["context", "batch", "host KV GiB", "CPU share", *(f"{p} ms" for p in POLICIES), "vs best"]
    body = []
    for r in doc["rows"]:
        t = r["step_time_s"]
        best = min(t[b] for b in BASELINES)
        body.append([_fmt_tokens(r["context"]), r["batch"], f"{r['host_kv_bytes'] / GiB:,.1f}",
                     f"{r['cpu_share']:.3f}", *(f"{t[p] * 1e3:,.1f}" for p in POLICIES),
                     f"{best / t['writescope']:.2f}x"])
    parts = [head, layout, "Decode step time (end to end)\n" + format_table(headers, body)]
    attention = doc["attention_phase"] or {}
    summaries = (("end to end", doc["geomean_speedup"], doc["geomean_speedup_over_all_baselines"],
                  doc["geomean_speedup_over_best_baseline"]),
                 ("attention phase only", attention.get("geomean_speedup"), attention.get("over_all_baselines"),
                  attention.get("over_best_baseline")))
    for label, per, overall, best in summaries:
        if per is None:
            parts.append(f"geomean speedup ({label}): no context >= 8k")
            continue
        items = ", ".join(f"{b} {per[b]:.2f}x" for b in BASELINES)
        parts.append(f"writescope geomean speedup, contexts >= 8k ({label}): {items}; over all four "
                     f"{overall:.2f}x; over the best baseline {best:.2f}x")
    return "\n\n".join(parts)


def _plot(doc: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install 'moetide[plot]'") from None
    rows = doc["rows"]
    x = [r["context"] for r in rows]
    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(11, 4))
    for p in POLICIES:
        ax_t.plot(x, [r["step_time_s"][p] * 1e3 for r in rows], marker="o", label=p)
    ax_s.plot(x, [r["cpu_share"] for r in rows], marker="o", color="black")
    for ax, label in ((ax_t, "modeled decode step (ms)"), (ax_s, "writescope CPU share of host KV")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context tokens per sequence")
        ax.set_ylabel(label)
    ax_t.set_yscale("log")
    ax_t.legend(fontsize=8)
    ax_s.set_ylim(0, 1)
    fig.suptitle(f"{doc['model']} on {doc['gpu']} + {doc['cpu']}, {doc['vram_gib']:g} GiB VRAM (MODELED)")
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as exc:
        raise UserError(f"--plot: cannot write {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    setup = build_setup(args)
    doc = evaluate(args, setup)
    if args.plot:
        _plot(doc, args.plot)
    print(json.dumps(doc, indent=2) if args.json else _text(doc, setup))
    return 0
