"""``moetide sweep [TRACE] --max-offload-ratio 0,0.05,…``: one policy (vamp by default) at each offload cap.

JSON: ``{"runs": {"<ratio>": {"config": …, "metrics": …}}}``. Times are MODELED.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from moetide.commands.compare import COLUMNS, comparison_rows, replay_with_metrics
from moetide.commands.replay import add_engine_arguments, add_workload_arguments, config_from, load, write_json
from moetide.errors import UserError
from moetide.report.tables import format_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    add_engine_arguments(parser, with_offload_ratio=False)  # the sweep's own --max-offload-ratio is a list
    parser.add_argument("--max-offload-ratio", dest="ratios", default="0,0.05,0.1,0.15,0.2,0.3",
                        help="comma-separated caps (default %(default)s)")
    parser.add_argument("--policy", default="vamp", help="policy to sweep (default %(default)s)")
    parser.add_argument("--json", type=Path, help="write all runs as JSON here")
    parser.add_argument("--plot", type=Path, help="write a PNG here")


def parse_ratios(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UserError(f"--max-offload-ratio must be comma-separated numbers, got {text!r}") from None
    if not values or any(not 0 <= v <= 1 for v in values):
        raise UserError(f"--max-offload-ratio values must be in [0, 1], got {text!r}")
    return values


def run(args: argparse.Namespace) -> int:
    ratios = parse_ratios(args.ratios)
    args.max_offload_ratio = 0.0
    workload = load(args)
    base = config_from(args, args.policy)
    runs, collectors = {}, {}
    for ratio in ratios:
        key = f"{ratio:g}"
        runs[key], collectors[key] = replay_with_metrics(
            workload, dataclasses.replace(base, max_offload_ratio=ratio), f"{args.policy} cap {key}")
    print(f"{args.policy} at each max offload ratio; times are MODELED by the roofline step-time model\n")
    print(format_table(["cap", *COLUMNS[1:]], comparison_rows(runs), align="<" + ">" * (len(COLUMNS) - 1)))
    if args.json:
        write_json(args.json, {"runs": runs})
        print(f"\nwrote {args.json}")
    if args.plot:
        from moetide.report.plots import plot_runs

        plot_runs({f"cap {k}": (runs[k], collectors[k]) for k in runs}, args.plot)
        print(f"wrote {args.plot}")
    return 0
