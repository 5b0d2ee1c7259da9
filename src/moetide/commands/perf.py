"""``moetide perf``: the modeled step time of one decode step (and optionally one prefill step) and the memory
budget, printed with every term so a user can check them by hand.

The figures come from ``moetide.perf`` (roofline step time, per-GPU memory budget); this module only parses, checks
and prints. Bad input, and a budget in which the weights do not fit, surface as ``UserError``: one line on stderr
and exit code 2, from ``moetide.cli``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from moetide.commands.options import add_json_argument, add_memory_option, add_model_argument, check_outputs
from moetide.commands.options import write_json_output
from moetide.errors import UserError
from moetide.perf import MemoryBudget, StepShape, StepTimeModel, memory_budget
from moetide.perf.budget import default_block_size
from moetide.perf.engines import DEFAULT_ENGINE_PROFILE, engine_profiles
from moetide.perf.step_calibrate import step_efficiency_for_gpu
from moetide.report.tables import format_table
from moetide.specs import HardwareSpec, ModelSpec, get_gpu, get_model

DTYPE_NAMES = {1: "fp8", 2: "bf16", 4: "fp32"}
MODELED_NOTE = ("MODELED times from a roofline (bytes and FLOPs against derated datasheet rates), not "
                "measurements; formula and sources in docs/perf.md")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser, default=None, what="a preset model name, a checkpoint folder or its HF config.json")
    parser.add_argument("--gpu", required=True, metavar="NAME|FILE",
                        help="a preset GPU name or a path to a .toml/.json hardware file")
    parser.add_argument("-tp", "--tensor-parallel-size", dest="tp", type=int, default=1, metavar="N",
                        help="tensor-parallel GPUs, as in vLLM (default 1)")
    parser.add_argument("--batch", type=int, default=1, metavar="B", help="sequences in the decode step (default 1)")
    parser.add_argument("--context", type=int, default=4096, metavar="C",
                        help="tokens already cached per sequence before the decode step (default 4096)")
    parser.add_argument("--prefill-tokens", type=int, metavar="P",
                        help="also model one prefill step of P new tokens of one sequence (no cached prefix)")
    parser.add_argument("--block-size", type=int, default=None, metavar="N",
                        help="KV block size in tokens (default: the replay's, vLLM's 16, or for hybrid models the "
                             "size that fits one layer's linear-attention state in a page)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="F",
                        help="share of HBM the engine may use (vLLM's flag; default 0.9)")
    add_memory_option(parser, "--kv-cache-memory", None,
                      "KV cache per GPU instead of the derived one, e.g. 8GiB (must fit beside the weights)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192, metavar="N",
                        help="token budget per step; sizes the activation reserve (default 8192)")
    parser.add_argument("--state-checkpoints", action="store_true",
                        help="hybrid models: charge a linear-attention state copy per cached block (prefix caching)")
    parser.add_argument("--engine-profile", default=DEFAULT_ENGINE_PROFILE, choices=engine_profiles(),
                        help="the serving engine's fitted efficiency profile (default %(default)s; roofline: none); "
                             "a GPU file's own [efficiency] table replaces it")
    parser.add_argument("--dtype-bytes", type=int, default=2, metavar="N", help="bytes per weight (2 = bf16)")
    parser.add_argument("--kv-dtype-bytes", type=int, default=2, metavar="N", help="bytes per KV element (2)")
    add_json_argument(parser, "the figures instead of tables")


def _check_args(args: argparse.Namespace) -> None:
    block_size = 1 if args.block_size is None else args.block_size
    positive = {"--tensor-parallel-size": args.tp, "--batch": args.batch, "--block-size": block_size,
                "--max-num-batched-tokens": args.max_num_batched_tokens, "--dtype-bytes": args.dtype_bytes,
                "--kv-dtype-bytes": args.kv_dtype_bytes}
    if args.prefill_tokens is not None:
        positive["--prefill-tokens"] = args.prefill_tokens
    for flag, value in positive.items():
        if value <= 0:
            raise UserError(f"{flag} must be a positive integer, got {value}")
    if args.context < 0:
        raise UserError(f"--context must be >= 0, got {args.context}")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise UserError(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    if args.kv_cache_memory is not None and not args.kv_cache_memory > 0:
        raise UserError(f"--kv-cache-memory must be positive, got {args.kv_cache_memory:g}")
    check_outputs(args)


def _build(args: argparse.Namespace, model: ModelSpec, gpu: HardwareSpec) -> tuple[StepTimeModel, MemoryBudget]:
    try:
        step = StepTimeModel(model, gpu, tp=args.tp, dtype_bytes=args.dtype_bytes,
                             kv_dtype_bytes=args.kv_dtype_bytes,
                             efficiency=step_efficiency_for_gpu(args.gpu, args.engine_profile))
    except ValueError as exc:
        raise UserError(f"--tensor-parallel-size: {exc}") from None
    block_size = args.block_size or default_block_size(model, tp=args.tp)
    budget = memory_budget(model, gpu, tp=args.tp, block_size=block_size, dtype_bytes=args.dtype_bytes,
                           kv_dtype_bytes=args.kv_dtype_bytes, gpu_memory_utilization=args.gpu_memory_utilization,
                           max_num_batched_tokens=args.max_num_batched_tokens,
                           kv_cache_memory=args.kv_cache_memory,
                           state_checkpoints=args.state_checkpoints)
    return step, budget


def _shapes(args: argparse.Namespace) -> dict[str, StepShape]:
    shapes = {"decode": StepShape.decode(args.batch, args.context)}
    if args.prefill_tokens is not None:
        shapes["prefill"] = StepShape.prefill(args.prefill_tokens)
    return shapes


# ---- text -------------------------------------------------------------------------------------------------


def _term_rows(step: StepTimeModel, bd: dict[str, float]) -> list[list[object]]:
    m = step.model
    names = [("dense", "dense weights"),
             ("experts", f"routed experts ({bd['distinct_experts_per_layer']:.2f} of {m.num_experts}/layer)"),
             ("attention", f"attention ({len(m.full_attention_layer_ids)} full layers)")]
    if m.linear_attention_layer_ids:
        names.append(("linear_attention", f"linear attention ({len(m.linear_attention_layer_ids)} layers)"))
    names.append(("lm_head", "lm head"))
    rows: list[list[object]] = []
    for key, label in names:
        bound = "compute" if bd[f"{key}_compute_s"] > bd[f"{key}_memory_s"] else "memory"
        rows.append([label, f"{bd[f'{key}_flops'] / 1e9:,.2f}", f"{bd[f'{key}_bytes'] / 1e6:,.2f}",
                     f"{bd[f'{key}_compute_s'] * 1e3:.3f}", f"{bd[f'{key}_memory_s'] * 1e3:.3f}",
                     f"{bd[f'{key}_s'] * 1e3:.3f}", bound])
    if step.tp > 1:
        rows.append([f"all-reduce (2 x {m.num_layers} layers)", None, f"{bd['allreduce_bytes'] / 1e6:,.2f}", None,
                     None, f"{bd['allreduce_s'] * 1e3:.3f}", "link"])
    if bd["floors_s"]:
        rows.append(["per-layer kernel floors", None, None, None, None, f"{bd['floors_s'] * 1e3:.3f}", "fixed"])
    rows.append(["step overhead", None, None, None, None, f"{bd['overhead_s'] * 1e3:.3f}", "fixed"])
    rows.append(["total", None, None, None, None, f"{bd['total_s'] * 1e3:.3f}", None])
    return rows


def _step_section(title: str, step: StepTimeModel, shape: StepShape, tokens_out: int) -> str:
    bd = step.breakdown(shape)
    headers = ["term", "GFLOP/GPU", "MB moved/GPU", "compute ms", "memory ms", "term ms", "bound"]
    table = format_table(headers, _term_rows(step, bd), align="<>>>>><")
    rate = tokens_out / bd["total_s"]
    noun = "token" if tokens_out == 1 else "tokens"
    return f"{title}\n{table}\nthroughput: {tokens_out:,} {noun} / {bd['total_s'] * 1e3:.3f} ms = {rate:,.1f} tokens/s"


def _efficiency_line(step: StepTimeModel, profile: str) -> str:
    e, g = step.efficiency, step.gpu
    return (f"efficiency: matmul {e.matmul:.2f} and attention {e.attention:.2f} x {g.matmul_flops_per_s / 1e12:,.1f} "
            f"TFLOP/s, HBM {e.hbm:.2f} x {g.hbm_bandwidth_bytes_per_s / 1e9:,.0f} GB/s, all-reduce {e.allreduce:.2f} x "
            f"{g.gpu_link_bandwidth_bytes_per_s / 1e9:,.0f} GB/s + {e.allreduce_latency_s * 1e6:g} us, "
            f"step overhead {e.step_overhead_s * 1e3:g} ms; profile {profile}")


def _fit_line(budget: MemoryBudget, num_seqs: int, context_tokens: int) -> str:
    need = budget.blocks_for(num_seqs, context_tokens)
    verdict = "fits" if need <= budget.num_blocks else "DOES NOT FIT"
    return (f"decode batch: {num_seqs:,} x {context_tokens:,} tokens needs {need:,} of {budget.num_blocks:,} blocks "
            f"({verdict})")


def _text(args: argparse.Namespace, step: StepTimeModel, budget: MemoryBudget, shapes: dict[str, StepShape]) -> str:
    m, g = step.model, step.gpu
    head = (f"{m.name} on {args.tp} x {g.name} (tp={args.tp}); weights {DTYPE_NAMES.get(args.dtype_bytes, '?')} "
            f"({args.dtype_bytes} B), KV {args.kv_dtype_bytes} B per element\n{MODELED_NOTE}\n"
            f"{_efficiency_line(step, args.engine_profile)}")
    decode = shapes["decode"]
    seqs = "sequence" if args.batch == 1 else "sequences"
    parts = [head, _step_section(
        f"Decode step: {args.batch:,} {seqs} at context {args.context:,} (T = {decode.num_tokens:,}; "
        f"{args.context + 1:,} KV tokens read per sequence per full-attention layer)", step, decode, args.batch)]
    if "prefill" in shapes:
        parts.append(_step_section(f"Prefill step: one sequence, {args.prefill_tokens:,} new tokens, no cached prefix",
                                   step, shapes["prefill"], args.prefill_tokens))
    memory = format_table(["figure", "value"], budget.describe(), align="<<")
    parts.append(f"Memory budget per GPU\n{memory}\n{_fit_line(budget, args.batch, args.context + 1)}")
    return "\n\n".join(parts)


# ---- JSON -------------------------------------------------------------------------------------------------


def _json(args: argparse.Namespace, step: StepTimeModel, budget: MemoryBudget, shapes: dict[str, StepShape]) -> str:
    doc: dict[str, object] = {
        "modeled": True, "note": MODELED_NOTE, "model": step.model.name, "gpu": step.gpu.name, "tp": args.tp,
        "dtype_bytes": args.dtype_bytes, "kv_dtype_bytes": args.kv_dtype_bytes,
        "engine_profile": args.engine_profile, "efficiency": dataclasses.asdict(step.efficiency),
    }
    out_tokens = {"decode": args.batch, "prefill": args.prefill_tokens}
    for kind, shape in shapes.items():
        bd = step.breakdown(shape)
        doc[kind] = {"shape": dataclasses.asdict(shape), "breakdown": bd, "step_time_s": bd["total_s"],
                     "tokens_per_s": out_tokens[kind] / bd["total_s"]}
    doc["memory"] = {**dataclasses.asdict(budget), "max_tokens": budget.max_tokens,
                     "decode_blocks_needed": budget.blocks_for(args.batch, args.context + 1)}
    return json.dumps(doc, indent=2)


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    model, gpu = get_model(args.model), get_gpu(args.gpu)
    step, budget = _build(args, model, gpu)
    shapes = _shapes(args)
    if args.json:
        write_json_output(args.json, _json(args, step, budget, shapes))
        if args.json != "-":
            print(f"wrote {args.json}")
    else:
        print(_text(args, step, budget, shapes))
    return 0
