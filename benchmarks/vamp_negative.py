"""The VAMP paper's negative case: many decode-heavy sessions, where moving the line costs more than it buys
(MODELED).

The paper's LMCache multi-round QA run (128 sessions) lost 44% of vLLM's decode throughput (205.2 -> 115.2 tok/s)
and completed 72% of turns against 95%: its controller offloaded experts to hold more sessions and never gave
the memory back, so every decode step paid staging. This replays an LMCache-multi-round-QA-shaped workload
(`multi-round-qa.py`: a shared system prompt, a per-user history, short questions, long answers, users that
ask again at once) on the paper's setup (Qwen3-Next-80B-A3B, 2 x H100 NVL, TP 2, 8.02 GiB of KV per GPU, cap
0.15, vLLM 0.15's defaults) under `vllm`, `vamp` and `static-offload` at the cap, one JSON line each, then the
check: `vamp` keeps >= 0.95x `vllm`'s decode throughput and completion.

    .venv/bin/python benchmarks/vamp_negative.py [--sessions 128] [--seeds 1,2]

The users are saturated (no think time), so output tokens per second is the throughput the policy allows.
Every time is the roofline's.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from moetide.sim.setup import ReplayConfig, run_replay  # noqa: E402
from moetide.workloads.generator import GeneratorConfig, LogNormal, generate_agent_sessions  # noqa: E402

PAPER_SETUP = ReplayConfig(model="qwen3-next-80b-a3b", gpu="h100-nvl", tp=2, kv_cache_memory=int(8.02 * 2**30),
                           max_offload_ratio=0.15, vllm_version="0.15")


def fixed(value: float) -> LogNormal:
    return LogNormal(value, 0.0, value, value)


def multi_round_qa(num_sessions: int) -> GeneratorConfig:
    """Shaped as LMCache's multi-round QA: 1,000 shared system tokens, a ~8K-token user history, 8 rounds of a
    64-token question and a ~512-token answer, all users arriving within a minute and asking again at once."""
    return GeneratorConfig(num_sessions=num_sessions, session_rate_per_s=2.0, system_prompt_tokens=1000,
                           task_prompt_tokens=LogNormal(8000, 0.3, 2000, 16000), turns_per_session=fixed(8),
                           new_tokens_per_turn=fixed(64), output_tokens=LogNormal(512, 0.3, 64, 2048),
                           think_time_s=LogNormal(1e-3, 0.0, 0.0, 1e-3))


def figures(result: dict, turns: int) -> dict:
    m = result["metrics"]
    return {"decode_tokens_per_s": m["output_tokens_per_s"], "completion": m["completed"] / turns,
            "failed": m["failed"], "ttft_p90_s": m["ttft_s"]["p90"], "tpot_mean_s": m["tpot_s"]["mean"],
            "preemptions": m["preemptions"], "prefix_hit_rate": m["prefix_hit_rate"],
            "offloaded_ratio_max": m["offloaded_ratio_max"], "offloads": m["offloads"], "reclaims": m["reclaims"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=128)
    parser.add_argument("--seeds", default="1,2")
    args = parser.parse_args()
    for seed in (int(s) for s in args.seeds.split(",")):
        workload = generate_agent_sessions(seed, config=multi_round_qa(args.sessions))
        out = {}
        for name in ("vllm", "vamp", "static-offload"):
            result, _ = run_replay(workload, replace(PAPER_SETUP, policy=name, seed=seed))
            out[name] = figures(result, workload.num_requests)
            print(json.dumps({"seed": seed, "run": name, "turns": workload.num_requests, "modeled": True,
                              **out[name]}), flush=True)
        vamp, vllm = out["vamp"], out["vllm"]
        throughput = vamp["decode_tokens_per_s"] / vllm["decode_tokens_per_s"]
        completion = vamp["completion"] / vllm["completion"]
        print(json.dumps({"seed": seed, "vamp_over_vllm_decode_throughput": throughput,
                          "vamp_over_vllm_completion": completion,
                          "holds_095": throughput >= 0.95 and completion >= 0.95}), flush=True)


if __name__ == "__main__":
    main()
