"""``moetide replay [TRACE]``: replay a recorded trace (or the built-in agent-session generator) on modeled
hardware through the shared scheduler, and report vLLM-style serving metrics.

Times are MODELED by the roofline step-time model (docs/perf.md); memory is accounted block by block.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from moetide.commands.options import (
    add_json_argument,
    add_plot_argument,
    add_serving_arguments,
    add_workload_arguments,
    bytes_text,
    check_outputs,
    flag_message,
    human_output,
    read_costs,
    write_json_output,
)
from moetide.perf.engines import engine_profiles
from moetide.perf.staging import STAGING_MODES
from moetide.errors import UserError
from moetide.report.progress import ProgressBar
from moetide.report.tables import format_table
from moetide.report.units import duration_text
from moetide.perf import StepTimeModel
from moetide.sim.setup import DTYPES, ReplayConfig, resolve_dtype, run_replay
from moetide.specs import get_gpu, get_model
from moetide.sim.vllm_defaults import MAMBA_CACHE_MODES, SSM_CACHE_DTYPES, VLLM_VERSIONS
from moetide.workloads import generate_agent_sessions, load_workload
from moetide.workloads.base import Workload, within_model_len
from moetide.workloads.generator import GeneratorConfig
from moetide.workloads.scale import WorkloadScale, scale_workload


def add_engine_arguments(parser: argparse.ArgumentParser, *, with_offload_ratio: bool = True,
                         policy: str | None = "vllm") -> None:
    """The modeled engine's options: the ones the PyTorch engine shares (``commands.options``), then the
    replay's own."""
    add_serving_arguments(parser, "replay", with_offload_ratio=with_offload_ratio, policy=policy)
    defaults = ReplayConfig()
    _add_hardware_arguments(parser, defaults)
    _add_vllm_rule_arguments(parser, defaults)
    _add_staging_arguments(parser, defaults)


def _add_hardware_arguments(parser: argparse.ArgumentParser, defaults: ReplayConfig) -> None:
    parser.add_argument("--gpu", default=defaults.gpu, help="GPU preset or hardware file (default %(default)s)")
    parser.add_argument("-tp", "--tensor-parallel-size", dest="tp", type=int, default=defaults.tp, metavar="N",
                        help="tensor-parallel GPUs, as in vLLM (default %(default)s)")
    parser.add_argument("--dtype", choices=DTYPES, default=defaults.dtype,
                        help="weights, KV and activations, as vLLM's --dtype; auto: the device's matmul dtype (bf16 "
                             "on the GPU presets, fp16 on V100, float32 on a `moetide calibrate --device-out` CPU) "
                             "(default %(default)s)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=defaults.gpu_memory_utilization,
                        metavar="F", help="share of HBM the engine may use for weights, activations and the KV "
                                          "cache, as in vLLM (default %(default)s)")
    parser.add_argument("--engine-profile", choices=engine_profiles(), default=defaults.engine_profile,
                        help="the step model's fitted efficiency for a GPU preset (default %(default)s; roofline: "
                             "none; docs/perf.md)")


def _add_vllm_rule_arguments(parser: argparse.ArgumentParser, defaults: ReplayConfig) -> None:
    parser.add_argument("--vllm-version", choices=VLLM_VERSIONS, default=defaults.vllm_version,
                        help="the vLLM whose scheduler defaults the baseline takes: 0.32 (default), or 0.15 (0.15.1, "
                        "the VAMP paper's base: first-chunk admission, the long-prefill threshold on every chunk, "
                        "no prefix caching for hybrid models unless --enable-prefix-caching)")
    caching = parser.add_mutually_exclusive_group()
    caching.add_argument("--enable-prefix-caching", dest="prefix_caching", action="store_true", default=None,
                         help="prefix caching on (the default, except for hybrid models under --vllm-version 0.15)")
    caching.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                         help="prefix caching off")
    parser.add_argument("--scheduler-reserve-full-isl", action=argparse.BooleanOptionalAction, default=None,
                        help="admit a waiting request only if its whole known sequence fits in the KV cache, as "
                        "vLLM 0.32 does (its default); --no-scheduler-reserve-full-isl admits it on its first chunk, "
                        "as vLLM before PR #37307 (e.g. 0.15) did")
    parser.add_argument("--mamba-ssm-cache-dtype", choices=list(SSM_CACHE_DTYPES),
                        default=defaults.mamba_ssm_cache_dtype,
                        help="hybrid models: the recurrent states' dtype, as vLLM's: auto (the model's) or float32 "
                             "(moetide's engine keeps them so) (default %(default)s)")
    parser.add_argument("--mamba-cache-mode", choices=MAMBA_CACHE_MODES, default=None,
                        help="hybrid models (Qwen3-Next): align caches linear-attention states as blocks of their "
                        "own, as vLLM 0.32 does with prefix caching; none keeps one per request and needs "
                        "--no-prefix-caching (default: align with prefix caching, none without)")
    parser.add_argument("--prefix-cache-retention-interval", type=_retention, default=0, metavar="{0,none}",
                        help="hybrid models: which states align mode keeps: 0 (vLLM's default) the prompt's last "
                        "block boundary and shared-prefix junctions; none every block's")


def _add_staging_arguments(parser: argparse.ArgumentParser, defaults: ReplayConfig) -> None:
    parser.add_argument("--staging", choices=list(STAGING_MODES), default=defaults.staging_mode,
                        help="auto: prefetch the likeliest offloaded experts under the previous layer's compute, the "
                        "rest on demand; touched: on demand only; segment: all, every step (default %(default)s)")
    parser.add_argument("--routing-zipf-s", type=float, default=defaults.routing_zipf_s,
                        help="expert popularity skew (Zipf exponent) for staging; 0 = uniform (default)")
    parser.add_argument("--routing-profile", metavar="FILE", default=None,
                        help="measured expert popularity for staging (a `moetide generate --routing-out` file of a "
                             "model with as many routed experts), instead of --routing-zipf-s")
    parser.add_argument("--host-link-shared-by", type=int, default=defaults.host_link_shared_by, metavar="N",
                        help="GPUs that stage experts through one host uplink at the same time (2: tensor-parallel "
                             "partners behind one PCIe switch); each gets 1/N of the link (default %(default)s)")
    parser.add_argument("--cpu", default=defaults.cpu, metavar="NAME|FILE",
                        help="--cold-experts cpu and --kv-host-memory: the host CPU socket, a preset or a `moetide "
                             "calibrate` file (default: the GPU's host, e.g. ddr5-4800-8ch beside an H100)")
    parser.add_argument("--gpus-per-socket", type=int, default=defaults.gpus_per_socket, metavar="N",
                        help="--cold-experts cpu: GPUs whose cold experts one socket computes at once (DGX H200: 4); "
                             "each gets 1/N of it (default %(default)s)")
    parser.add_argument("--cpu-matmul-tflops", type=float, default=None, metavar="X",
                        help="--cold-experts cpu: the socket's sustained expert-GEMM rate in TFLOP/s (default: its "
                             "fp32 FMA peak x 0.5; an AMX BF16 kernel reaches more, e.g. 10.5 per socket from "
                             "KTransformers' 21 TFLOPS on a two-socket Xeon 4)")
    parser.add_argument("--cpu-slowdown", type=float, default=defaults.cpu_slowdown, metavar="X",
                        help="--kv-host-memory: the CPU attends X times slower than modeled (a busy host; writescope's "
                             "online correction learns it, the other policies do not) (default %(default)s)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    add_engine_arguments(parser)
    add_json_argument(parser, "the result")
    add_plot_argument(parser, "TTFT and TPOT CDFs, throughput, KV usage over time")


def parse_window(text: str | None) -> tuple[float, float] | None:
    if text is None:
        return None
    try:
        start, end = (float(part) for part in text.split(":"))
    except ValueError:
        raise UserError(f"--time-window must be START:END in seconds, got {text!r}") from None
    if end <= start:
        raise UserError(f"--time-window end must be after its start, got {text!r}")
    return start, end


def load(args: argparse.Namespace) -> Workload:
    """The workload the arguments name, cut to ``--max-model-len`` (``args.refused_requests``: how many went)."""
    for flag, value in (("--max-requests", args.max_requests), ("--sessions", args.sessions)):
        if value is not None and value < 1:
            raise UserError(f"{flag} must be >= 1, got {value}")
    if args.session_rate is not None and not args.session_rate > 0:
        raise UserError(f"--session-rate must be > 0, got {args.session_rate}")
    if args.trace is None:
        given = [flag for flag, value in (("--format", args.format), ("--max-requests", args.max_requests),
                                          ("--time-window", args.time_window)) if value is not None]
        if given:
            raise UserError(f"{'/'.join(given)} select part of a recorded trace: give a TRACE (the built-in "
                            f"generator takes --sessions and --session-rate)")
        config = GeneratorConfig()
        config = dataclasses.replace(config, num_sessions=args.sessions or config.num_sessions,
                                     session_rate_per_s=args.session_rate or config.session_rate_per_s)
        workload = generate_agent_sessions(args.seed, config=config)
    else:
        path = Path(args.trace)
        if path.is_dir():
            raise UserError(f"{path}: is a folder; give a trace file (Mooncake JSONL, WEKA sessions, Azure CSV)")
        if not path.exists():
            raise UserError(f"{path}: no such trace file")
        workload = load_workload(path, args.format, seed=args.seed, session_rate_per_s=args.session_rate,
                                 max_requests=args.max_requests, time_window=parse_window(args.time_window),
                                 sessions=args.sessions)
    try:
        scale = WorkloadScale(args.length_scale, args.max_input_tokens, args.max_output_tokens, args.time_scale)
    except ValueError as exc:
        field, _, rest = str(exc).partition(" ")
        raise UserError(f"--{field.replace('_', '-')} {rest}") from None
    workload = scale_workload(workload, scale)
    args.refused_requests = 0
    if getattr(args, "max_model_len", None) is not None:
        workload, args.refused_requests = within_model_len(workload, args.max_model_len)
    return workload


def _retention(text: str) -> int | None:
    if text.lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"0 or none, got {text!r}") from None


def config_from(args: argparse.Namespace, policy: str) -> ReplayConfig:
    """The replay's config, every setting checked (the policy's name and --tensor-parallel-size against the heads
    included) before any replay runs."""
    active, host = args.kv_host_active_memory, args.kv_host_memory
    if active is not None and host and not 0 < active <= host:
        raise UserError(f"--kv-host-active-memory {bytes_text(active)} must be more than 0 and at most "
                        f"--kv-host-memory {bytes_text(host)}")
    try:
        config = _config_from(args, policy)
        gpu = get_gpu(config.gpu)
        config = dataclasses.replace(config, dtype=resolve_dtype(config.dtype, gpu))  # against the device, and
        StepTimeModel(get_model(config.model), gpu, tp=config.tp)  # against the heads
    except ValueError as exc:
        message = flag_message(str(exc)) if "ReplayConfig." in str(exc) else f"--tensor-parallel-size: {exc}"
        raise UserError(message) from None
    return config


def _config_from(args: argparse.Namespace, policy: str) -> ReplayConfig:
    return ReplayConfig(
        model=args.model, gpu=args.gpu, tp=args.tp, policy=policy, block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_memory=args.kv_cache_memory,
        vllm_version=args.vllm_version, engine_profile=args.engine_profile, enable_prefix_caching=args.prefix_caching,
        scheduler_reserve_full_isl=args.scheduler_reserve_full_isl, seed=args.seed,
        mamba_cache_mode=args.mamba_cache_mode, mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
        prefix_cache_retention_interval=args.prefix_cache_retention_interval,
        max_offload_ratio=args.max_offload_ratio, staging_mode=args.staging,
        routing_zipf_s=args.routing_zipf_s, routing_profile=args.routing_profile,
        host_link_shared_by=args.host_link_shared_by,
        cold_experts=args.cold_experts, cpu=args.cpu, gpus_per_socket=args.gpus_per_socket,
        cpu_matmul_tflops=args.cpu_matmul_tflops,
        vamp_horizon_s=args.vamp_horizon_s, kv_host_memory=args.kv_host_memory,
        split_policy=args.split_policy,
        split_fixed_ratio=args.split_fixed_ratio, cpu_slowdown=args.cpu_slowdown,
        device_prefixes=args.device_prefixes, kv_host_active_memory=args.kv_host_active_memory,
        dtype=args.dtype, vamp_costs=read_costs(args.vamp_costs) if args.vamp_costs else None,
    )


def summary_rows(metrics: dict) -> list[list[str]]:
    return [[name, *(duration_text(metrics[key][stat]) for stat in ("mean", "p50", "p90", "p99"))]
            for name, key in (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("ITL", "itl_s"), ("E2E", "e2e_s"))]


def print_summary(result: dict) -> None:
    config, metrics = result["config"], result["metrics"]
    print(f"{config['workload']['name']}: {config['workload']['requests']:,} requests in "
          f"{config['workload']['sessions']:,} sessions ({config['workload']['mode']} loop) | {config['model']} on "
          f"{config['tp']} x {config['gpu']} | policy {config['policy']} | "
          f"{config['memory']['num_blocks']:,} KV blocks of {config['block_size']} tokens per GPU")
    admission = "whole sequence" if config.get("scheduler_reserve_full_isl", True) else "first chunk"
    hybrid = ""
    if config["memory"].get("state_blocks_per_request"):
        caching = config["enable_prefix_caching"] and config.get("mamba_cache_mode") != "none"
        kept = "every block" if config.get("prefix_cache_retention_interval") is None else "boundaries and junctions"
        hybrid = f", mamba_cache_mode align, states kept at {kept}" if caching else ", mamba_cache_mode none"
    print(f"scheduler: vLLM {config.get('vllm_version', '0.32')}'s v1 rules (admission on the {admission}, "
          f"max_num_seqs {config['max_num_seqs']}, max_num_batched_tokens {config['max_num_batched_tokens']}"
          f"{hybrid}; docs/replay.md)")
    print("times are MODELED by the roofline step-time model, not measured\n")
    print(format_table(["latency", "mean", "p50", "p90", "p99"], summary_rows(metrics), align="<>>>>"))
    print()
    print(format_table(["figure", "value"], [
        ["completed / failed", f"{metrics['completed']:,} / {metrics['failed']:,}"],
        ["request throughput", f"{metrics['request_throughput_per_s']:.3f} req/s"],
        ["output throughput", f"{metrics['output_tokens_per_s']:,.1f} tok/s"],
        ["prefix-hit rate", f"{metrics['prefix_hit_rate']:.3f}"],
        ["recomputed tokens", f"{metrics['recomputed_tokens']:,}"],
        ["preemptions", f"{metrics['preemptions']:,}"],
        ["evicted blocks", f"{metrics['evicted_blocks']:,}"],
        ["peak KV usage", f"{metrics['kv_usage_max']:.3f}"],
        ["peak offloaded ratio", f"{metrics['offloaded_ratio_max']:.3f}"],
        ["staged", f"{metrics['staged_bytes'] / 2**30:,.1f} GiB"],
        *host_kv_rows(config, metrics),
        ["simulated duration", duration_text(metrics["duration_s"])],
    ], align="<>"))
    if metrics["offloaded_ratio_max"] > 0:
        print(f"\nthe weights/KV line moved: up to {metrics['offloaded_ratio_max']:.1%} of the routed-expert bytes "
              f"went to the KV cache ({metrics['offloads']:,} offloads, {metrics['reclaims']:,} regions given back), "
              f"and "
              f"{metrics['staged_bytes'] / 2**30:,.1f} GiB of expert weights were staged from host memory for it")


def host_kv_rows(config: dict, metrics: dict) -> list[list[str]]:
    host = metrics.get("host_kv")
    if host is None:
        return []
    mem = config["memory"]
    return [
        ["host KV tier", f"{bytes_text(config['kv_host_memory'])}: {mem['host_kv_blocks']:,} blocks "
                         f"({mem['device_kv_blocks']:,} on the GPU, {mem['ring_blocks']:,} given to the ring)"],
        ["host KV attended", f"{host['cpu_tokens'] + host['streamed_tokens']:,} token-steps in {host['steps']:,} "
                             f"steps, CPU share {host['cpu_share']:.3f} ({host['policy']})"],
        ["time host KV added", duration_text(host["added_s"])],
        *([["host KV bound", f"{bytes_text(config['kv_host_active_memory'])} ({host['active_bound_blocks']:,} "
                             f"blocks) attended "
                             f"per step: admission held {host['bound_waits']:,} times; host hits copied to the "
                             f"GPU {host['host_hits_promoted_blocks']:,} blocks ({host['promote_s']:,.1f} s), "
                             f"recomputed {host['host_hits_recomputed_blocks']:,}; peak "
                             f"{host['peak_host_blocks_used']:,}"]]
          if host.get("active_bound_blocks") else []),
    ]


def write_json(path: str | Path, payload: dict) -> None:
    write_json_output(path, json.dumps(payload, indent=1, sort_keys=False))


def refused_line(args: argparse.Namespace) -> str | None:
    if not getattr(args, "refused_requests", 0):
        return None
    return (f"{args.refused_requests:,} requests longer than --max-model-len {args.max_model_len:,} refused (vLLM "
            f"answers them with an error)")


def run(args: argparse.Namespace) -> int:
    config = config_from(args, args.policy)
    check_outputs(args)
    workload = load(args)
    progress = ProgressBar("replay")
    result, metrics = run_replay(workload, config, progress)
    progress.close()
    with human_output(args.json):
        print_summary(result)
        if refused_line(args):
            print(refused_line(args))
    if args.json:
        write_json(args.json, result)
        if args.json != "-":
            print(f"\nwrote {args.json}")
    if args.plot:
        from moetide.report.plots import plot_runs

        plot_runs({args.policy: (result, metrics)}, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr if args.json == "-" else sys.stdout)
    return 0
