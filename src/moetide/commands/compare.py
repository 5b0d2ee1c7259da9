"""``moetide compare [TRACE] --policies vllm,vamp,…``: one workload, same seed, each policy; one table, JSON and plot.

JSON: ``{"runs": {"<policy>": {"config": …, "metrics": …}}, "ratios": {"<policy>/<baseline>": {…}}}`` with the
replay's metric names (``offloaded_ratio_max`` and ``staged_bytes`` included) plus ``offloaded_ratio_mean`` (the
offloaded share averaged over steps: what running requests saw; idle time, when nothing is staged, not counted)
and ``requests_per_busy_s`` (completed requests per second of accelerator time: what an engine kept saturated
would deliver; closed-loop request throughput is paced by the recorded think times instead). Times are MODELED.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from moetide.commands.replay import add_engine_arguments, add_workload_arguments, config_from, load, write_json
from moetide.errors import UserError
from moetide.report.progress import ProgressBar
from moetide.report.tables import format_table
from moetide.sim.setup import run_replay

DEFAULT_POLICIES = "vllm,vamp,vamp-reclaim,static-offload"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    add_engine_arguments(parser)
    parser.add_argument("--policies", default=DEFAULT_POLICIES, help="comma-separated (default %(default)s); "
                        "the first is the baseline of the ratios")
    parser.add_argument("--json", type=Path, help="write all runs as JSON here")
    parser.add_argument("--plot", type=Path, help="write a PNG (TTFT and TPOT CDFs, throughput, KV usage) here")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:,.1f}"


COLUMNS = ["policy", "TTFT p50 ms", "TTFT p90 ms", "TPOT ms", "req/s", "req/busy s", "prefix hit", "preempt",
           "offload max", "offload mean", "staged GiB", "done/failed"]


def replay_with_metrics(workload, config, label: str) -> tuple[dict, object]:
    """One replay under a progress bar, as ``run_replay`` returns it, its metrics with
    ``offloaded_ratio_mean`` (over the sampled steps, which are evenly spaced in step count) and
    ``requests_per_busy_s`` added."""
    progress = ProgressBar(label)
    result, collector = run_replay(workload, config, progress)
    progress.close()
    m = result["metrics"]
    samples = collector.offload_usage
    m["offloaded_ratio_mean"] = sum(r for _, r in samples) / len(samples) if samples else 0.0
    m["requests_per_busy_s"] = m["completed"] / m["busy_s"] if m["busy_s"] else 0.0
    return result, collector


def comparison_rows(runs: dict[str, dict]) -> list[list[str]]:
    rows = []
    for policy, result in runs.items():
        m = result["metrics"]
        rows.append([policy, _ms(m["ttft_s"]["p50"]), _ms(m["ttft_s"]["p90"]), _ms(m["tpot_s"]["mean"]),
                     f"{m['request_throughput_per_s']:.4f}", f"{m['requests_per_busy_s']:.4f}",
                     f"{m['prefix_hit_rate']:.3f}", f"{m['preemptions']:,}", f"{m['offloaded_ratio_max']:.3f}",
                     f"{m['offloaded_ratio_mean']:.3f}", f"{m['staged_bytes'] / 2**30:,.1f}",
                     f"{m['completed']:,}/{m['failed']:,}"])
    return rows


def ratios(runs: dict[str, dict]) -> dict[str, dict[str, float | None]]:
    names = list(runs)
    base = runs[names[0]]["metrics"]
    out = {}
    for name in names[1:]:
        m = runs[name]["metrics"]
        out[f"{name}/{names[0]}"] = {
            "ttft_p50": _ratio(m["ttft_s"]["p50"], base["ttft_s"]["p50"]),
            "ttft_p90": _ratio(m["ttft_s"]["p90"], base["ttft_s"]["p90"]),
            "tpot_mean": _ratio(m["tpot_s"]["mean"], base["tpot_s"]["mean"]),
            "request_throughput": _ratio(m["request_throughput_per_s"], base["request_throughput_per_s"]),
            "requests_per_busy_s": _ratio(m["requests_per_busy_s"], base["requests_per_busy_s"]),
        }
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def run(args: argparse.Namespace) -> int:
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies or len(set(policies)) != len(policies):
        raise UserError(f"--policies needs distinct comma-separated names, got {args.policies!r}")
    configs = {policy: config_from(args, policy) for policy in policies}  # every bad setting before any replay
    workload = load(args)
    runs, collectors = {}, {}
    for policy in policies:
        runs[policy], collectors[policy] = replay_with_metrics(workload, configs[policy], f"replay {policy}")
    first = runs[policies[0]]["config"]
    print(f"{first['workload']['name']}: {first['workload']['requests']:,} requests | {first['model']} on "
          f"{first['tp']} x {first['gpu']} | {first['memory']['num_blocks']:,} KV blocks per GPU at start | "
          f"max offload {first['max_offload_ratio']}, staging {first['staging_mode']}")
    print("times are MODELED by the roofline step-time model, not measured\n")
    print(format_table(COLUMNS, comparison_rows(runs), align="<" + ">" * (len(COLUMNS) - 1)))
    table = ratios(runs)
    if table:
        print()
        print(format_table(["vs " + policies[0], "TTFT p50", "TTFT p90", "TPOT", "req/s", "req/busy s"],
                           [[k, *(("-" if v is None else f"{v:.3f}x") for v in r.values())] for k, r in table.items()],
                           align="<>>>>>"))
    if args.json:
        write_json(args.json, {"runs": runs, "ratios": table})
        print(f"\nwrote {args.json}")
    if args.plot:
        from moetide.report.plots import plot_runs

        plot_runs({p: (runs[p], collectors[p]) for p in policies}, args.plot)
        print(f"wrote {args.plot}")
    return 0
