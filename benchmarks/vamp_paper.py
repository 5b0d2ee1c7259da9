"""The VAMP paper's table, reproduced by the replay in the paper's setup, figure by figure (MODELED).

Qwen3-Next-80B-A3B on 2 x H100 NVL at TP 2, 8.02 GiB of KV per GPU, offload cap 0.15, vLLM 0.15's defaults,
the first 40 WEKA Claude Code sessions (the paper: a recorded SWE-bench agent workload we do not hold; 40 agent
workers). Runs, one JSON line each, then one line per figure with the paper's value and the ratio:

- `vllm`: the baseline, vLLM 0.15's defaults (a hybrid model has no prefix caching there);
- `vamp`: the same defaults;
- `vamp+apc`: `vamp` with `--enable-prefix-caching` (the paper's VAMP reports 89.8% prefix hits, which a vLLM
  0.15 hybrid model has only with prefix caching on: its patch must have turned it on);
- `vllm+apc`: the baseline with prefix caching on, the comparison the paper does not make;
- `vllm@18.5`: the baseline given the paper's grown pool for free (18.5 GiB, no staging): what capacity alone buys
  (on an `h200`, the one preset with room for it beside 74 GiB of weights; its HBM is 1.2x faster).

    .venv/bin/python benchmarks/vamp_paper.py [--sessions 40] [--seed 7] [--rate R] [--think-time-scale K]

`--think-time-scale 0` sends each session's next turn as soon as the last one ends (agent workers replaying a
recording back to back, with no tool or user time) instead of after the trace's recorded think time.

TPOT is vLLM's benchmark's (latency - TTFT) / (output tokens - 1) per request, so a preempted request's stall and
re-prefill count in it; the mean is what `vllm bench serve` reports as "Mean TPOT". Every time is the roofline's.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from moetide.perf.budget import weights_per_gpu  # noqa: E402
from moetide.sim.setup import ReplayConfig, run_replay  # noqa: E402
from moetide.specs import get_model  # noqa: E402
from moetide.workloads import Workload, load_workload  # noqa: E402

TRACE = ROOT.parent / "shared" / "traces" / "weka_claude_code" / "weka_cc_traces_compact.jsonl.gz"
PAPER_SETUP = ReplayConfig(model="qwen3-next-80b-a3b", gpu="h100-nvl", tp=2, kv_cache_memory=int(8.02 * 2**30),
                           max_offload_ratio=0.15, vllm_version="0.15")
# arXiv 2609.13537 (via a public summary): vLLM, VAMP
PAPER = {"kv_pool_gib": (8.02, 18.5), "prefix_hit_rate": (0.0019, 0.898), "preemptions_per_1k_turns": (562.7, 0.18),
         "ttft_p90_s": (26.1, 1.10), "tpot_mean_s": (0.1709, 0.2240), "request_throughput_rel": (1.0, 1.207)}
GIB = 1024 ** 3


def runs(seed: int) -> dict[str, ReplayConfig]:
    base = replace(PAPER_SETUP, seed=seed)
    return {"vllm": replace(base, policy="vllm"), "vamp": replace(base, policy="vamp"),
            "vamp+apc": replace(base, policy="vamp", enable_prefix_caching=True),
            "vllm+apc": replace(base, policy="vllm", enable_prefix_caching=True),
            "vllm@18.5": replace(base, policy="vllm", gpu="h200", kv_cache_memory=int(18.5 * 2**30))}


def scale_think_times(workload: Workload, scale: float) -> Workload:
    if scale == 1.0:
        return workload
    sessions = tuple(replace(s, turns=tuple(replace(t, think_time_s=t.think_time_s * scale) for t in s.turns))
                     for s in workload.sessions)
    return replace(workload, sessions=sessions)


def figures(result: dict, config: ReplayConfig, turns: int) -> dict:
    m = result["metrics"]
    routed = weights_per_gpu(get_model(config.model), tp=config.tp).routed_expert_bytes
    return {"kv_pool_gib": config.kv_cache_memory / GIB + m["offloaded_ratio_max"] * routed / GIB,
            "prefix_hit_rate": m["prefix_hit_rate"], "preemptions_per_1k_turns": 1000 * m["preemptions"] / turns,
            "ttft_p90_s": m["ttft_s"]["p90"], "tpot_mean_s": m["tpot_s"]["mean"], "tpot_p50_s": m["tpot_s"]["p50"],
            "request_throughput_per_s": m["request_throughput_per_s"],
            "requests_per_busy_s": m["completed"] / m["busy_s"], "busy_s": m["busy_s"], "steps": m["steps"],
            "recomputed_tokens": m["recomputed_tokens"], "prompt_tokens": m["prompt_tokens"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=40)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--rate", type=float, default=None, help="session arrival rate per second (trace's default)")
    parser.add_argument("--think-time-scale", type=float, default=1.0, help="x the recorded think times")
    parser.add_argument("--only", default=None, help="comma-separated subset of the runs")
    args = parser.parse_args()
    if not TRACE.exists():
        sys.exit(f"vamp_paper: {TRACE} is absent (../shared/traces beside the checkout)")
    workload = scale_think_times(load_workload(TRACE, seed=args.seed, session_rate_per_s=args.rate,
                                               sessions=args.sessions), args.think_time_scale)
    out = {}
    for name, config in runs(args.seed).items():
        if args.only and name not in args.only.split(","):
            continue
        result, _ = run_replay(workload, config)
        out[name] = figures(result, config, workload.num_requests)
        print(json.dumps({"run": name, "seed": args.seed, "rate": args.rate, "think_time_scale": args.think_time_scale, "turns": workload.num_requests, "modeled": True,
                          **out[name]}), flush=True)
    if "vllm" not in out:
        return
    for vamp_run in ("vamp", "vamp+apc"):
        if vamp_run not in out:
            continue
        for figure, (paper_vllm, paper_vamp) in PAPER.items():
            if figure == "request_throughput_rel":
                ours = (1.0, out[vamp_run]["requests_per_busy_s"] / out["vllm"]["requests_per_busy_s"])
            else:
                ours = (out["vllm"][figure], out[vamp_run][figure])
            print(json.dumps({"figure": figure, "vamp_run": vamp_run, "paper_vllm": paper_vllm,
                              "paper_vamp": paper_vamp, "ours_vllm": ours[0], "ours_vamp": ours[1],
                              "ours_over_paper_vllm": ours[0] / paper_vllm if paper_vllm else None,
                              "ours_over_paper_vamp": ours[1] / paper_vamp if paper_vamp else None}), flush=True)


if __name__ == "__main__":
    main()
