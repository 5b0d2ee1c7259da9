"""Step-exactness inside vLLM: vLLM 0.32's real v1 scheduler against moetide's core, same requests, no model.

``--policy vllm`` (default): stock vLLM against the core's ``vllm`` policy (the replay's baseline).
``--policy vamp`` (or any policy): vLLM with moetide's plugin scheduler running that policy against the core
running it, from one cost record (``--costs``), an expert line of a Qwen3-30B-A3B-like shape scaled so the cap's
reserve is a few hundred blocks; each step compares scheduled tokens, preemptions, blocks evicted and line moves.
How the two sides are driven: ``moetide_testing.vllm_differential``.

Prints one JSON line per configuration: steps, identical steps, the first divergent step with both sides'
decisions, and per side preemptions, recomputed tokens (prompt tokens computed again after a preemption),
prefix-hit tokens, evicted blocks, experts offloaded and regions given back. Run where vLLM is installed
(scripts/install_vllm.sh), from the project root:

    /work/venv-vllm/bin/python benchmarks/vllm_fidelity.py [--configs mooncake-roomy,...] [--policy vamp]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from moetide_testing.vllm_differential import compare, mooncake, weka  # noqa: E402
from moetide.vllm.settings import ExpertShape, PluginSettings  # noqa: E402

TRACES = ROOT.parent / "shared" / "traces"
# The core's engine prices (moetide.engine.vamp) for a step of a 3B-active model on one GPU-class device.
COSTS = {"prefill_s_per_token": 2e-5, "copy_s_per_expert": 2e-4}

# The routed experts beside the harness's KV caches: Qwen3-30B-A3B's beside its full-attention cache, Qwen3-Next-80B's
# beside the hybrid one (bf16, one rank).
QWEN3_30B_EXPERTS = ExpertShape(num_layers=48, num_experts=128, experts_per_token=8, expert_bytes=3 * 2048 * 768 * 2)
QWEN3_NEXT_EXPERTS = ExpertShape(num_layers=48, num_experts=512, experts_per_token=10, expert_bytes=3 * 2048 * 512 * 2)


@dataclass(frozen=True)
class PolicyArgs:
    policy: str
    horizon_s: float
    costs: dict

    def settings(self, hybrid: bool) -> PluginSettings | None:
        """``vllm``: stock vLLM. Otherwise the plugin with the model's experts and the default offload cap."""
        if self.policy == "vllm":
            return None
        return PluginSettings(policy=self.policy, vamp_horizon_s=self.horizon_s, costs=self.costs,
                              experts=QWEN3_NEXT_EXPERTS if hybrid else QWEN3_30B_EXPERTS)


def run(name: str, sessions, p: PolicyArgs, **kwargs) -> dict:
    return compare(name, sessions, plugin=p.settings(kwargs.get("hybrid", False)), **kwargs)


def mooncake_300():
    return mooncake(TRACES, 300, 50, 8192)  # 300 requests, inputs capped at 8K tokens, 50 ms a step


def weka_30x6():
    return weka(TRACES, 30, 6, 20, 16_384, 10)  # 30 sessions x 6 turns, closed loop, 16K contexts, 20 ms a step


CONFIGS = {
    "mooncake-roomy": lambda p: run("mooncake-roomy", mooncake_300(), p, num_blocks=40_000),
    "mooncake-tight": lambda p: run("mooncake-tight", mooncake_300(), p, num_blocks=2_000),
    "mooncake-tight-threshold": lambda p: run("mooncake-tight-threshold", mooncake_300(), p, num_blocks=2_000,
                                              threshold=512),
    "mooncake-tight-first-chunk": lambda p: run("mooncake-tight-first-chunk", mooncake_300(), p, num_blocks=2_000,
                                                reserve_full_isl=False),
    "weka-roomy": lambda p: run("weka-roomy", weka_30x6(), p, num_blocks=40_000),
    "weka-tight": lambda p: run("weka-tight", weka_30x6(), p, num_blocks=2_500),
    "weka-tight-threshold": lambda p: run("weka-tight-threshold", weka_30x6(), p, num_blocks=2_500, threshold=512),
    # hybrid (Qwen3-Next-shaped), WEKA sessions, 544-token blocks
    "hybrid-roomy": lambda p: run("hybrid-roomy", weka_30x6(), p, num_blocks=2_000, block_size=544, hybrid=True),
    "hybrid-tight": lambda p: run("hybrid-tight", weka_30x6(), p, num_blocks=200, block_size=544, hybrid=True),
    "hybrid-tight-dense": lambda p: run("hybrid-tight-dense", weka_30x6(), p, num_blocks=200, block_size=544,
                                        hybrid=True, retention_interval=None),
    "hybrid-tight-threshold": lambda p: run("hybrid-tight-threshold", weka_30x6(), p, num_blocks=200,
                                            block_size=544, hybrid=True, threshold=1088),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated: " + ", ".join(CONFIGS))
    parser.add_argument("--policy", default="vllm", help="vllm (stock vLLM) or a moetide policy run by the plugin")
    parser.add_argument("--vamp-horizon-s", type=float, default=5.0, help="the policy's review interval")
    parser.add_argument("--costs", type=json.loads, default=COSTS, help="the cost record, JSON")
    args = parser.parse_args()
    for name in args.configs.split(","):
        print(json.dumps(CONFIGS[name](PolicyArgs(args.policy, args.vamp_horizon_s, args.costs))), flush=True)


if __name__ == "__main__":
    main()
