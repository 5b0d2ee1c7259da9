"""`vamp` against an oracle of fixed offload ratios on a small generated agent workload (the check
benchmarks/vamp_oracle.py makes on WEKA sessions, at a size a test can run)."""

from dataclasses import replace

import pytest

from moetide.sim.setup import ReplayConfig, run_replay
from moetide.workloads.generator import GeneratorConfig, LogNormal, generate_agent_sessions

# 16 sessions of ~8K-token contexts into 1 GiB of KV: vLLM 0.15's first-chunk admission preempts hundreds of
# times (seed 2: 2,640, TTFT p90 ~60 s) and a small offloaded share removes every preemption
SESSIONS = GeneratorConfig(num_sessions=16, session_rate_per_s=0.05, system_prompt_tokens=2000,
                           task_prompt_tokens=LogNormal(6000, 0.8, 500, 24000),
                           turns_per_session=LogNormal(10, 0.5, 2, 20), think_time_s=LogNormal(5, 1.0, 0, 60))
# the run lasts ~20 minutes of modeled time: a review every 10 s gives the line room to move within it
# on the plain roofline, where vamp's defaults were chosen; under the fitted vllm-0.32 profile the controller falls
# short of the best fixed ratio here, a miss docs/vamp/fitted-profile-2026-12.md reports
SETUP = ReplayConfig(model="qwen3-next-80b-a3b", gpu="h100-nvl", tp=2, kv_cache_memory=2**30, max_offload_ratio=0.15,
                     vllm_version="0.15", vamp_horizon_s=10.0, engine_profile="roofline")


def ttft_p90(workload, config):
    result, _ = run_replay(workload, config)
    return result["metrics"]["ttft_s"]["p90"]


@pytest.mark.parametrize("seed", [1, 2])
def test_vamp_is_within_ten_percent_of_the_best_fixed_ratio_and_never_worse_than_vllm(seed):
    workload = generate_agent_sessions(seed, config=SESSIONS)
    base = replace(SETUP, seed=seed)
    vllm = ttft_p90(workload, replace(base, policy="vllm"))
    fixed = [ttft_p90(workload, replace(base, policy="static-offload", max_offload_ratio=ratio))
             for ratio in (0.05, 0.10, 0.15)]
    vamp = ttft_p90(workload, replace(base, policy="vamp"))
    best = min([vllm, *fixed])
    assert best < 0.8 * vllm  # the line is what helps here: the oracle is not the baseline
    assert vamp <= 1.10 * best
    assert vamp <= 1.05 * vllm
