"""``moetide sweep [TRACE] --max-offload-ratios 0,0.05,…``: one policy (vamp by default) at each offload cap.

JSON: ``{"runs": {"<ratio>": {"config": …, "metrics": …}}}``. Times are MODELED. Each finished run is saved
before the next starts, as ``compare`` does (``commands.compare.run_each``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from moetide.commands.compare import COLUMNS, comparison_rows, finish, replay_with_metrics, run_each
from moetide.commands.options import add_json_argument, add_plot_argument, add_workload_arguments, check_outputs
from moetide.commands.options import human_output
from moetide.commands.replay import add_engine_arguments, config_from, load, refused_line
from moetide.errors import UserError
from moetide.report.tables import format_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    add_engine_arguments(parser, with_offload_ratio=False, policy="vamp")
    parser.add_argument("--max-offload-ratios", dest="ratios", default="0,0.05,0.1,0.15,0.2,0.3", metavar="LIST",
                        help="comma-separated --max-offload-ratio caps, one run each (default %(default)s)")
    add_json_argument(parser, "every run")
    add_plot_argument(parser, "one line per cap")


def parse_ratios(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UserError(f"--max-offload-ratios must be comma-separated numbers, got {text!r}") from None
    if not values or any(not 0 <= v <= 1 for v in values):
        raise UserError(f"--max-offload-ratios values must be in [0, 1], got {text!r}")
    return values


def _print_runs(policy: str, runs: dict[str, dict]) -> None:
    print(f"{policy} at each max offload ratio; times are MODELED by the roofline step-time model\n")
    print(format_table(["cap", *COLUMNS[1:]], comparison_rows(runs), align="<" + ">" * (len(COLUMNS) - 1)))


def run(args: argparse.Namespace) -> int:
    ratios = {f"{r:g}": r for r in parse_ratios(args.ratios)}
    args.max_offload_ratio = 0.0
    base = config_from(args, args.policy)
    check_outputs(args)
    workload = load(args)
    def one(key: str):
        return replay_with_metrics(workload, dataclasses.replace(base, max_offload_ratio=ratios[key]),
                                   f"{args.policy} cap {key}")

    runs, collectors = run_each(list(ratios), one, args.json, lambda done: {"runs": done},
                                lambda done: _print_runs(args.policy, done), "caps")
    with human_output(args.json):
        _print_runs(args.policy, runs)
        if refused_line(args):
            print(refused_line(args))
    if args.plot:
        from moetide.report.plots import plot_runs

        plot_runs({f"cap {k}": (runs[k], collectors[k]) for k in runs}, args.plot)
    finish(args.json, {"runs": runs})
    if args.plot:
        print(f"wrote {args.plot}", file=sys.stderr if args.json == "-" else sys.stdout)
    return 0
