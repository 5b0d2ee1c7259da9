"""``moetide plan-split``: the modeled WriteScope split of host-spilled KV, against our four baselines, the
WriteScope paper's four named ones and its monolithic-cache ablation, per context. The flags become a
``SplitStudyConfig``; the study is ``sim.split_study`` and the tables ``report.split_plan``. All figures are
MODELED (docs/writescope.md says what and how)."""

from __future__ import annotations

import argparse
import json
import math
import re

from moetide.commands.options import (add_json_argument, check_outputs, human_output, parse_size,
                                      write_json_output)
from moetide.errors import UserError
from moetide.perf.engines import DEFAULT_ENGINE_PROFILE, engine_profiles
from moetide.perf.host_share import HOST_EXPERT_PLACES
from moetide.report import split_plan
from moetide.sim.split_study import SplitStudyConfig, build_setup, evaluate
from moetide.specs import get_gpu, host_for
from moetide.units import GiB, MiB

DEFAULT_CONTEXTS = "8k,16k,32k,64k,128k,256k,512k,1M"
_SUFFIX = {"": 1, "k": 1024, "m": 1024**2}
_TOKENS_RE = re.compile(r"^(\d+)([kKmM]?)$")

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
    parser.add_argument("--gpu-memory", type=parse_size, default=32 * GiB, metavar="SIZE",
                        help="device memory the layout may use: weights, reserve, ring, device KV and resident "
                             "experts (default 32GiB)")
    parser.add_argument("--context", default=DEFAULT_CONTEXTS, metavar="LIST",
                        help=f"cached tokens per sequence, comma-separated (default {DEFAULT_CONTEXTS})")
    parser.add_argument("--batch", type=int, metavar="B", help="sequences per step (default: aggregate / context)")
    parser.add_argument("--aggregate-tokens", default="1M", metavar="N",
                        help="without --batch: batch = max(1, N / context) (default 1M)")
    parser.add_argument("--kv-cache-memory", type=parse_size, default=4 * GiB, metavar="SIZE",
                        help="device KV cache (default 4GiB)")
    parser.add_argument("--ring-memory", type=parse_size, default=256 * MiB, metavar="SIZE",
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


def _batches(args: argparse.Namespace, contexts: list[int]) -> list[int]:
    if args.batch is not None:
        return [args.batch] * len(contexts)
    aggregate = parse_tokens(args.aggregate_tokens, "--aggregate-tokens")
    return [max(1, aggregate // c) for c in contexts]


def study_config(args: argparse.Namespace) -> SplitStudyConfig:
    """The study the checked flags describe (the host resolved: ``--cpu`` or the GPU's own)."""
    contexts = parse_contexts(args.context)
    fixed = None if args.split_fixed_ratio == "tuned" else float(args.split_fixed_ratio)
    return SplitStudyConfig(
        model=args.model, gpu=args.gpu, cpu=host_for(args.cpu, get_gpu(args.gpu)), engine_profile=args.engine_profile,
        plan=tuple(zip(contexts, _batches(args, contexts))), gpu_memory=args.gpu_memory,
        kv_cache_memory=args.kv_cache_memory, ring_memory=args.ring_memory, ring_slots=args.ring_slots,
        block_size=args.block_size, blocks_per_transfer=args.blocks_per_transfer, split_fixed_ratio=fixed,
        cpu_slowdown=args.cpu_slowdown, feedback_steps=args.feedback_steps, host_experts=args.host_experts,
        kv_prefetch=not args.no_kv_prefetch, sparse_density=args.sparse_density,
        solid_locality=args.solid_locality, hybridgen_streams=args.hybridgen_streams)


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    doc = evaluate(build_setup(study_config(args)))
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
