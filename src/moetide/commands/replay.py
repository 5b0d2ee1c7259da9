"""``moetide replay [TRACE]``: replay a recorded trace (or the built-in agent-session generator) on modeled
hardware through the shared scheduler, and report vLLM-style serving metrics.

Times are MODELED by the roofline step-time model (docs/perf.md); memory is accounted block by block.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from moetide.core.splits import SPLIT_POLICIES
from moetide.perf.staging import COLD_EXPERT_MODES, STAGING_MODES
from moetide.errors import UserError
from moetide.report.progress import ProgressBar
from moetide.report.tables import format_table
from moetide.sim.setup import DEVICE_PREFIXES, ReplayConfig, run_replay
from moetide.sim.vllm_defaults import MAMBA_CACHE_MODES, VLLM_VERSIONS
from moetide.workloads import generate_agent_sessions, load_workload
from moetide.workloads.base import Workload


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", nargs="?", help="trace file (Mooncake JSONL, WEKA sessions, Azure CSV; .gz ok); "
                        "omitted: the built-in agent-session generator")
    parser.add_argument("--format", choices=["mooncake", "weka", "azure"], help="trace format (default: sniffed)")
    parser.add_argument("--session-rate", type=float, help="closed-loop traces: new sessions per second (Poisson)")
    parser.add_argument("--max-requests", type=int, help="keep the first N requests (whole sessions)")
    parser.add_argument("--time-window", help="keep START:END seconds of the trace, e.g. 0:600")
    parser.add_argument("--sessions", type=int, help="keep the first N sessions")
    parser.add_argument("--seed", type=int, default=0, help="one seed for everything random (default 0)")


def add_engine_arguments(parser: argparse.ArgumentParser, *, with_offload_ratio: bool = True) -> None:
    defaults = ReplayConfig()
    parser.add_argument("--model", default=defaults.model, help="model preset or config.json (default %(default)s)")
    parser.add_argument("--gpu", default=defaults.gpu, help="GPU preset or hardware file (default %(default)s)")
    parser.add_argument("--tp", type=int, default=defaults.tp, help="tensor-parallel GPUs (default %(default)s)")
    parser.add_argument("--kv-budget-gib", type=float, help="KV cache per GPU in GiB (default: what is left of "
                        "--gpu-memory-utilization x HBM after weights and activations)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=defaults.gpu_memory_utilization)
    parser.add_argument("--block-size", type=int, default=defaults.block_size,
                        help="tokens per KV block (default: vLLM's, 16, or for hybrid models the size that fits one "
                        "layer's linear-attention state in a page: 544 for Qwen3-Next-80B at TP 1-2)")
    parser.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs,
                        help="most requests running at once (default: vLLM 0.32's server default for the GPU: "
                        "1024 on H100/H200-class GPUs, 256 on A100, V100 and smaller)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens,
                        help="token budget of a step (default: vLLM 0.32's server default for the GPU: 8192 on "
                        "H100/H200-class GPUs, 16384 from 160 GiB, 2048 on A100, V100 and smaller)")
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
    parser.add_argument("--mamba-cache-mode", choices=MAMBA_CACHE_MODES, default=None,
                        help="hybrid models (Qwen3-Next): align caches linear-attention states as blocks of their "
                        "own, as vLLM 0.32 does with prefix caching; none keeps one per request and needs "
                        "--no-prefix-caching (default: align with prefix caching, none without)")
    parser.add_argument("--prefix-cache-retention-interval", type=_retention, default=0, metavar="{0,none}",
                        help="hybrid models: which states align mode keeps: 0 (vLLM's default) the prompt's last "
                        "block boundary and shared-prefix junctions; none every block's")
    parser.add_argument("--state-checkpoints", action="store_true", help=argparse.SUPPRESS)  # deprecated
    if with_offload_ratio:
        parser.add_argument("--max-offload-ratio", type=float, default=defaults.max_offload_ratio,
                            help="cap on the offloaded share of routed-expert bytes (default %(default)s)")
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
    parser.add_argument("--cold-experts", choices=list(COLD_EXPERT_MODES), default=defaults.cold_experts,
                        help="offloaded experts the prefetch does not carry: fetch them over the host link on demand, "
                             "or let the host CPU compute them where they lie when that is cheaper for the step "
                             "(modeled; default %(default)s)")
    parser.add_argument("--cpu", default=defaults.cpu, metavar="HOST",
                        help="--cold-experts cpu and --kv-host-gib: the host CPU socket, a preset or a `moetide "
                             "calibrate` file (default %(default)s)")
    parser.add_argument("--gpus-per-socket", type=int, default=defaults.gpus_per_socket, metavar="N",
                        help="--cold-experts cpu: GPUs whose cold experts one socket computes at once (DGX H200: 4); "
                             "each gets 1/N of it (default %(default)s)")
    parser.add_argument("--cpu-matmul-tflops", type=float, default=None, metavar="X",
                        help="--cold-experts cpu: the socket's sustained expert-GEMM rate in TFLOP/s (default: its "
                             "fp32 FMA peak x 0.5; an AMX BF16 kernel reaches more, e.g. 10.5 per socket from "
                             "KTransformers' 21 TFLOPS on a two-socket Xeon 4)")
    parser.add_argument("--kv-host-gib", type=float, default=defaults.kv_host_gib, metavar="G",
                        help="a host KV tier of G GiB: KV that does not fit on the GPU is written there instead of "
                             "preempting, and each step the --split-policy splits it between the CPU (attended in "
                             "place) and the host link (streamed); modeled, one GPU (default: none)")
    parser.add_argument("--split-policy", choices=list(SPLIT_POLICIES), default=defaults.split_policy,
                        help="--kv-host-gib: who attends the host KV (default %(default)s)")
    parser.add_argument("--fixed-ratio", type=float, default=defaults.split_fixed_ratio, metavar="X",
                        help="--split-policy fixed-ratio: the CPU's share of every sequence's host KV "
                             "(default %(default)s)")
    parser.add_argument("--cpu-slowdown", type=float, default=defaults.cpu_slowdown, metavar="X",
                        help="--kv-host-gib: the CPU attends X times slower than modeled (a busy host; writescope's "
                             "online correction learns it, the other policies do not) (default %(default)s)")
    parser.add_argument("--device-prefixes", choices=list(DEVICE_PREFIXES), default=defaults.device_prefixes,
                        help="--kv-host-gib: when no uncached device block is free, keep the cached prefixes in "
                             "device blocks and spill new KV to the host, or evict the least recently used of them "
                             "first (default %(default)s)")
    parser.add_argument("--kv-host-active-gib", type=float, default=defaults.kv_host_active_gib, metavar="A",
                        help="--kv-host-gib: admit a request only while the host KV that running requests attend "
                             "each step stays within A GiB (the rest of the tier holds cached prefixes); bounds "
                             "the time per output token that host KV adds (default: no bound)")
    parser.add_argument("--vamp-horizon-s", type=float, default=defaults.vamp_horizon_s,
                        help="vamp: seconds between reviews of the line, and the time constant of its measured "
                             "rates; staging is priced over the step mix of 10 of them (default %(default)s)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    add_engine_arguments(parser)
    parser.add_argument("--policy", default="vllm", help="memory-pressure policy (default %(default)s)")
    parser.add_argument("--json", type=Path, help="write the result as JSON here")
    parser.add_argument("--plot", type=Path, help="write a PNG (TTFT CDF, KV usage over time) here")


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
    if args.trace is None:
        if args.format or args.max_requests or args.time_window or args.sessions or args.session_rate:
            raise UserError("--format/--max-requests/--time-window/--sessions/--session-rate need a TRACE")
        return generate_agent_sessions(args.seed)
    if not Path(args.trace).is_file():
        raise UserError(f"{args.trace}: no such trace file")
    return load_workload(args.trace, args.format, seed=args.seed, session_rate_per_s=args.session_rate,
                         max_requests=args.max_requests, time_window=parse_window(args.time_window),
                         sessions=args.sessions)


def _retention(text: str) -> int | None:
    if text.lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"0 or none, got {text!r}") from None


_WARNED: list[bool] = []  # the deprecation warning, once per process


def _retention_of(args: argparse.Namespace) -> int | None:
    """--state-checkpoints (deprecated) charged a state per cached block: every block's state kept."""
    if args.state_checkpoints:
        if not _WARNED:
            _WARNED.append(True)
            print("moetide: warning: --state-checkpoints is deprecated: hybrid states are now cached blocks, kept as "
                  "vLLM keeps them; it means --prefix-cache-retention-interval none", file=sys.stderr)
        return None
    return args.prefix_cache_retention_interval


# ReplayConfig fields whose flag is not the field's name in dashes
FLAG_OF_FIELD = {"staging_mode": "--staging", "split_fixed_ratio": "--fixed-ratio"}


def flag_message(message: str) -> str:
    """A config error in the CLI's words: each ``ReplayConfig.field`` named as its flag."""
    return re.sub(r"ReplayConfig\.(\w+)",
                  lambda m: FLAG_OF_FIELD.get(m.group(1), "--" + m.group(1).replace("_", "-")), message)


def config_from(args: argparse.Namespace, policy: str) -> ReplayConfig:
    try:
        return _config_from(args, policy)
    except ValueError as exc:
        raise UserError(flag_message(str(exc))) from None


def _config_from(args: argparse.Namespace, policy: str) -> ReplayConfig:
    return ReplayConfig(
        model=args.model, gpu=args.gpu, tp=args.tp, policy=policy, block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        gpu_memory_utilization=args.gpu_memory_utilization, kv_budget_gib=args.kv_budget_gib,
        vllm_version=args.vllm_version, enable_prefix_caching=args.prefix_caching,
        scheduler_reserve_full_isl=args.scheduler_reserve_full_isl, seed=args.seed,
        mamba_cache_mode=args.mamba_cache_mode, prefix_cache_retention_interval=_retention_of(args),
        max_offload_ratio=args.max_offload_ratio, staging_mode=args.staging,
        routing_zipf_s=args.routing_zipf_s, routing_profile=args.routing_profile,
        host_link_shared_by=args.host_link_shared_by,
        cold_experts=args.cold_experts, cpu=args.cpu, gpus_per_socket=args.gpus_per_socket,
        cpu_matmul_tflops=args.cpu_matmul_tflops,
        vamp_horizon_s=args.vamp_horizon_s, kv_host_gib=args.kv_host_gib, split_policy=args.split_policy,
        split_fixed_ratio=args.fixed_ratio, cpu_slowdown=args.cpu_slowdown, device_prefixes=args.device_prefixes,
        kv_host_active_gib=args.kv_host_active_gib,
    )


def summary_rows(metrics: dict) -> list[list[str]]:
    def ms(block: dict, key: str) -> str:
        value = block[key]
        return "-" if value is None else f"{value * 1e3:,.1f}"

    rows = [[name, ms(metrics[key], "mean"), ms(metrics[key], "p50"), ms(metrics[key], "p90"), ms(metrics[key], "p99")]
            for name, key in (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("ITL", "itl_s"), ("E2E", "e2e_s"))]
    return rows


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
    print(format_table(["latency (ms)", "mean", "p50", "p90", "p99"], summary_rows(metrics), align="<>>>>"))
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
        ["simulated duration", f"{metrics['duration_s']:,.1f} s"],
    ], align="<>"))


def host_kv_rows(config: dict, metrics: dict) -> list[list[str]]:
    host = metrics.get("host_kv")
    if host is None:
        return []
    mem = config["memory"]
    return [
        ["host KV tier", f"{config['kv_host_gib']:g} GiB: {mem['host_kv_blocks']:,} blocks "
                         f"({mem['device_kv_blocks']:,} on the GPU, {mem['ring_blocks']:,} given to the ring)"],
        ["host KV attended", f"{host['cpu_tokens'] + host['streamed_tokens']:,} token-steps in {host['steps']:,} "
                             f"steps, CPU share {host['cpu_share']:.3f} ({host['policy']})"],
        ["time host KV added", f"{host['added_s']:,.1f} s"],
        *([["host KV bound", f"{config['kv_host_active_gib']:g} GiB ({host['active_bound_blocks']:,} blocks) attended "
                             f"per step: admission held {host['bound_waits']:,} times; host hits copied to the "
                             f"GPU {host['host_hits_promoted_blocks']:,} blocks ({host['promote_s']:,.1f} s), "
                             f"recomputed {host['host_hits_recomputed_blocks']:,}; peak "
                             f"{host['peak_host_blocks_used']:,}"]]
          if host.get("active_bound_blocks") else []),
    ]


def write_json(path: Path, payload: dict) -> None:
    try:
        path.write_text(json.dumps(payload, indent=1, sort_keys=False) + "\n")
    except OSError as exc:
        raise UserError(f"{path}: cannot write JSON: {exc.strerror}") from None


def run(args: argparse.Namespace) -> int:
    workload = load(args)
    progress = ProgressBar("replay")
    result, metrics = run_replay(workload, config_from(args, args.policy), progress)
    progress.close()
    print_summary(result)
    if args.json:
        write_json(args.json, result)
        print(f"\nwrote {args.json}")
    if args.plot:
        from moetide.report.plots import plot_runs

        plot_runs({args.policy: (result, metrics)}, args.plot)
        print(f"wrote {args.plot}")
    return 0
