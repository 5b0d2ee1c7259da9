"""``moetide compare [TRACE] --policies vllm,vamp,…``: one workload, same seed, each policy; one table, JSON and plot.

JSON: ``{"runs": {"<policy>": {"config": …, "metrics": …}}, "ratios": {"<policy>/<baseline>": {…}}}`` with the
replay's metric names (``offloaded_ratio_max`` and ``staged_bytes`` included) plus ``offloaded_ratio_mean`` (the
offloaded share averaged over steps: what running requests saw; idle time, when nothing is staged, not counted)
and ``requests_per_busy_s`` (completed requests per second of accelerator time: what an engine kept saturated
would deliver; closed-loop request throughput is paced by the recorded think times instead). Times are MODELED.

Each finished run is written as soon as it is made (``--json PATH``: to ``PATH.partial``, ``"complete": false``,
renamed to PATH once every run is in), so an interrupt or a late failure keeps what was done, and the message
says where; without ``--json`` the finished runs' table is printed before the verb stops.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from moetide.commands.options import add_json_argument, add_plot_argument, add_workload_arguments, check_outputs
from moetide.commands.options import human_output
from moetide.commands.replay import add_engine_arguments, config_from, load, refused_line, write_json
from moetide.errors import UserError
from moetide.report.progress import ProgressBar
from moetide.report.tables import format_table
from moetide.report.units import duration_text, ratio_text
from moetide.sim.setup import run_replay

DEFAULT_POLICIES = "vllm,vamp,vamp-reclaim,static-offload"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    add_engine_arguments(parser, policy=None)
    parser.add_argument("--policies", default=DEFAULT_POLICIES, help="comma-separated "
                        "(default %(default)s); the first is the baseline of "
                        "the ratios")
    add_json_argument(parser, "every run and the ratios")
    add_plot_argument(parser, "TTFT and TPOT CDFs, throughput per second and per busy second, KV usage")


COLUMNS = ["policy", "TTFT p50", "TTFT p90", "TPOT", "req/s", "req/busy s", "prefix hit", "preempt",
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
        rows.append([policy, duration_text(m["ttft_s"]["p50"]), duration_text(m["ttft_s"]["p90"]),
                     duration_text(m["tpot_s"]["mean"]),
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


def partial_path(json_path: str | None) -> Path | None:
    return None if json_path in (None, "-") else Path(f"{json_path}.partial")


def run_each(keys: list[str], run_one: Callable[[str], tuple[dict, object]], json_path: str | None,
             document: Callable[[dict], dict], print_table: Callable[[dict], None], what: str
             ) -> tuple[dict, dict]:
    """Every run in turn, each finished one saved before the next starts (module docstring). On an interrupt or a
    failure the finished runs are printed and kept, the message says where, and the exception goes on."""
    runs, collectors = {}, {}
    partial = partial_path(json_path)
    try:
        for key in keys:
            runs[key], collectors[key] = run_one(key)
            if partial is not None:
                write_json(partial, {**document(runs), "complete": False, "pending": keys[len(runs):]})
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not lose what is being saved
        if runs:
            with human_output(json_path):
                print_table(runs)
            if json_path == "-":
                write_json("-", {**document(runs), "complete": False, "pending": keys[len(runs):]})
            where = f"in {partial}" if partial is not None else "in the table above"
            cause = "interrupted" if isinstance(exc, KeyboardInterrupt) else "stopped by an error"
            print(f"moetide: {cause} after {len(runs)} of {len(keys)} {what}: the finished runs are {where}",
                  file=sys.stderr)
        raise
    return runs, collectors


def finish(json_path: str | None, doc: dict) -> None:
    """The complete document in place of the partial one."""
    if json_path is None:
        return
    write_json(json_path, doc)
    partial = partial_path(json_path)
    if partial is not None and partial.exists():
        os.remove(partial)
    if json_path != "-":
        print(f"\nwrote {json_path}")


def _print_runs(runs: dict[str, dict], header: str) -> None:
    print(header)
    print("times are MODELED by the roofline step-time model, not measured\n")
    print(format_table(COLUMNS, comparison_rows(runs), align="<" + ">" * (len(COLUMNS) - 1)))


def run(args: argparse.Namespace) -> int:
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies or len(set(policies)) != len(policies):
        raise UserError(f"--policies needs distinct comma-separated names, got {args.policies!r}")
    configs = {policy: config_from(args, policy) for policy in policies}  # every bad setting before any replay
    check_outputs(args)
    workload = load(args)

    def header(runs: dict[str, dict]) -> str:
        first = next(iter(runs.values()))["config"]
        return (f"{first['workload']['name']}: {first['workload']['requests']:,} requests | {first['model']} on "
                f"{first['tp']} x {first['gpu']} | {first['memory']['num_blocks']:,} KV blocks per GPU at start | "
                f"max offload {first['max_offload_ratio']}, staging {first['staging_mode']}")

    runs, collectors = run_each(
        policies, lambda p: replay_with_metrics(workload, configs[p], f"replay {p}"), args.json,
        lambda done: {"runs": done, "ratios": ratios(done)}, lambda done: _print_runs(done, header(done)),
        "policies")
    table = ratios(runs)
    with human_output(args.json):
        _print_runs(runs, header(runs))
        if table:
            print()
            print(format_table(["vs " + policies[0], "TTFT p50", "TTFT p90", "TPOT", "req/s", "req/busy s"],
                               [[k, *(ratio_text(v) for v in r.values())] for k, r in table.items()],
                               align="<>>>>>"))
        if refused_line(args):
            print(refused_line(args))
    if args.plot:
        from moetide.report.plots import plot_runs

        plot_runs({p: (runs[p], collectors[p]) for p in policies}, args.plot)
    finish(args.json, {"runs": runs, "ratios": table})
    if args.plot:
        print(f"wrote {args.plot}", file=sys.stderr if args.json == "-" else sys.stdout)
    return 0
