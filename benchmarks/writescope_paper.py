"""The WriteScope paper's comparison in the cost model: its three models on an A100 and a V100 capped at 32 GiB,
beside a Xeon Gold 5318Y, against its four named baselines, with its two ablations and its two-user case.

MODELED, every figure (``moetide plan-split``'s model). One JSON line per (model, GPU, host, host experts, sparse
density): the geometric-mean speedup of writescope over each compared policy at contexts >= 8K (1M tokens of KV in
total per row, the paper's aggregate), and the ablation ratios the paper reports as throughput fractions:
``fixed_0.5`` = writescope time / fixed-ratio-0.5 time, ``monolithic`` = writescope time / monolithic time, both
geometric means over the same rows. ``--contention`` adds one line per setup for the two-user case: 32 x 32K,
the CPU ``--cpu-slowdown`` times as slow as modeled (another user on the host; 2 by default, a fair share of the
cores; ``host_contention.py`` measures it), writescope without feedback against writescope with it
(``--feedback-steps`` 20). The paper's figures are in ``PAPER``; docs/writescope.md prints both side by side.

    python benchmarks/writescope_paper.py                   # the main grid (108 lines, ~3 min)
    python benchmarks/writescope_paper.py --contention      # plus the two-user lines
    python benchmarks/writescope_paper.py --contention --no-grid --cpu-slowdown 2.2   # those lines only
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from pathlib import Path

from moetide.commands import plan_split
from moetide.sim import split_study
from moetide.perf.host_share import HOST_EXPERT_PLACES

HOSTS = {"preset": "xeon-gold-5318y",
         "kernel-share": str(Path(__file__).parent.parent / "docs/writescope/hosts/xeon-gold-5318y-kernel-share.toml"),
         "per-core": str(Path(__file__).parent.parent / "docs/writescope/hosts/xeon-gold-5318y-per-core.toml")}
GPUS = {"A100-32GB": "a100-pcie-40gb", "V100-32GB": "v100-pcie-32gb"}
MODELS = ("deepseek-v2-lite", "qwen3-30b-a3b", "mixtral-8x7b")
PAPER = {"speedup_a100": (1.52, 2.51), "speedup_v100": (1.43, 1.71), "fixed_0.5": (0.89, 0.96),
         "monolithic": (0.26, 0.79), "two_users_ms": (1010, 436)}


def args_for(model: str, gpu: str, host: str, experts: str, density: float, *flags: str,
             **extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    plan_split.add_arguments(parser)
    argv = ["--model", model, "--gpu", gpu, "--cpu", host, "--gpu-memory", "32GiB", "--host-experts", experts,
            "--sparse-density", str(density), *flags]
    for flag, value in extra.items():
        argv += [f"--{flag.replace('_', '-')}", value]
    return parser.parse_args(argv)


def study(args: argparse.Namespace) -> dict:
    """plan-split's document for these flags."""
    return split_study.evaluate(split_study.build_setup(plan_split.study_config(args)))


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def grid_line(model: str, gpu_label: str, host_label: str, experts: str, density: float) -> dict:
    args = args_for(model, GPUS[gpu_label], HOSTS[host_label], experts, density)
    doc = study(args)
    rows = [r for r in doc["rows"] if r["context"] >= split_study.GEOMEAN_MIN_CONTEXT]
    t = [r["step_time_s"] for r in rows]
    generous = args_for(model, GPUS[gpu_label], HOSTS[host_label], experts, density, "--hybridgen-streams")
    streaming = study(generous)["geomean_speedup"]["hybridgen"]
    return {"modeled": True, "model": model, "gpu": gpu_label, "host": host_label, "host_experts": experts,
            "sparse_density": density, "geomean_speedup": {k: round(v, 3) for k, v in doc["geomean_speedup"].items()},
            "over_best_named": round(doc["geomean_speedup_over_best_named_baseline"], 3),
            "hybridgen_streaming": round(streaming, 3),
            "fixed_0.5": round(geomean([x["writescope"] / x["fixed-ratio"] for x in t]), 3),
            "monolithic": round(geomean([x["writescope"] / x["monolithic"] for x in t]), 3),
            "cpu_share": [round(r["cpu_share"], 3) for r in rows],
            "decode_tok_s_32x32k": round(next(r["batch"] / r["step_time_s"]["writescope"] for r in rows
                                              if r["context"] == 32768), 1)}


def contention_line(model: str, gpu_label: str, host_label: str, experts: str, cpu_slowdown: float = 2.0) -> dict:
    out = {"modeled": True, "case": "two users", "model": model, "gpu": gpu_label, "host": host_label,
           "host_experts": experts, "batch": 32, "context": 32768, "cpu_slowdown": cpu_slowdown}
    for label, steps in (("static_ms", "0"), ("feedback_ms", "20")):
        args = args_for(model, GPUS[gpu_label], HOSTS[host_label], experts, 0.125, context="32k", batch="32",
                        cpu_slowdown=str(cpu_slowdown), feedback_steps=steps)
        row = study(args)["rows"][0]
        out[label] = round(row["step_time_s"]["writescope"] * 1e3, 1)
        out[label.replace("_ms", "_cpu_share")] = round(row["cpu_share"], 3)
    idle = args_for(model, GPUS[gpu_label], HOSTS[host_label], experts, 0.125, context="32k", batch="32")
    out["one_user_ms"] = round(study(idle)["rows"][0]["step_time_s"][
        "writescope"] * 1e3, 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contention", action="store_true", help="also the two-user lines")
    parser.add_argument("--cpu-slowdown", type=float, default=2.0, metavar="X",
                        help="the second user's slowdown of CPU attention in the two-user lines (default 2)")
    parser.add_argument("--no-grid", action="store_true", help="skip the main grid")
    parser.add_argument("--hosts", default=",".join(HOSTS), help=f"comma-separated, from {', '.join(HOSTS)}")
    args = parser.parse_args()
    hosts = args.hosts.split(",")
    if not (math.isfinite(args.cpu_slowdown) and args.cpu_slowdown > 0):
        parser.error(f"--cpu-slowdown must be a positive number, got {args.cpu_slowdown}")
    if not args.no_grid:
        for model, gpu, host, experts, density in itertools.product(MODELS, GPUS, hosts, HOST_EXPERT_PLACES,
                                                                    (0.125, 1.0)):
            print(json.dumps(grid_line(model, gpu, host, experts, density)), flush=True)
    if args.contention:
        for model, gpu, host, experts in itertools.product(MODELS, GPUS, hosts, HOST_EXPERT_PLACES):
            print(json.dumps(contention_line(model, gpu, host, experts, args.cpu_slowdown)), flush=True)


if __name__ == "__main__":
    main()
