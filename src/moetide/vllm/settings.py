"""The plugin's options, as vLLM carries them: ``kv_connector_extra_config`` of ``--kv-transfer-config``.

One JSON object configures both halves of the plugin (the scheduler and the workers read the same
``kv_transfer_config``), so a plain ``vllm serve`` takes it as one flag. Keys, each optional:

* ``policy``: a moetide policy name (``vllm``, ``vamp``, ...); default ``vllm``.
* ``max_offload_ratio``: cap on the offloaded share of routed-expert bytes (moetide's default).
* ``vamp_horizon_s``: vamp's review interval.
* ``clock``: ``modeled`` (the policy's clock is the cost record's step seconds, as moetide's engine does) or
  ``wall`` (seconds since the scheduler started).
* ``costs``: the cost record (``core.pressure.step_costs.EngineCosts`` fields: ``prefill_s_per_token``, ``copy_s_per_expert``,
  ``expert_call_s``); default: priced from the model's active parameters (``plugin_costs``).
* ``experts``: the routed experts' shape (``num_layers``, ``num_experts``, ``experts_per_token``,
  ``expert_bytes``) where the model config does not say it; normally read from the model's config.
* ``line_cycle_steps``: exercise the line (0, the default: off). Every that many steps the last region starts
  going back (it drains, then returns to its experts), or, with none out, the rest of the cap goes out again. For
  soak tests of the KV mechanics under a policy that does not move the line itself (``static-offload``).
* ``cpu_vmm_granule``: on the CPU, run the line as on CUDA, over the driver's virtual-memory calls done with
  ``memfd`` and ``mmap`` (``vllm.vmm.HostDriver``) at this granule in bytes (a multiple of the page size); 0, the
  default: the CPU's own page lending. For testing the CUDA design inside vLLM without a GPU.
* ``kv_host_memory``: bytes of host memory for KV blocks past the device KV cache (0, the default: none), over
  every rank; WriteScope's host tier (``vllm.host_tier``): a block's residency is fixed when it is written and
  attention splits each step between the device blocks, the host blocks the CPU attends in place and the host
  blocks streamed. Not beside a policy that offloads experts.
* ``split_policy``, ``split_fixed_ratio``: who attends the host KV each step (``core.splits``), as moetide's
  engine's ``--split-policy`` and ``--split-fixed-ratio``; ``split_gpu``: the GPU preset or file the split's costs
  are priced for (``engine.split_plan``).

No vLLM import here: the CLI builds these settings and vLLM's side parses them.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass, fields
from typing import Any

from moetide.core.config import ServingConfig
from moetide.core.experts import DEFAULT_MAX_OFFLOAD_RATIO
from moetide.core.pressure import VampParams, policy_entry
from moetide.core.splits import DEFAULT_SPLIT_GPU

CONNECTOR_NAME = "MoetideConnector"
CONNECTOR_MODULE = "moetide.vllm.connector"
SCHEDULER_CLS = "moetide.vllm.scheduler.MoetideScheduler"
CLOCKS = ("modeled", "wall")
WHERE = "kv_transfer_config.kv_connector_extra_config"


@dataclass(frozen=True)
class ExpertShape:
    """The routed experts of one rank: what the line trades against KV blocks."""

    num_layers: int
    num_experts: int
    experts_per_token: int
    expert_bytes: int

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{WHERE}.experts.{f.name} must be a positive whole number, got {value!r}")


PAGE_BYTES = mmap.PAGESIZE


@dataclass(frozen=True)
class PluginSettings:
    policy: str = "vllm"
    max_offload_ratio: float = DEFAULT_MAX_OFFLOAD_RATIO
    vamp_horizon_s: float = VampParams.horizon_s
    clock: str = "modeled"
    costs: dict[str, float] | None = None
    experts: ExpertShape | None = None
    line_cycle_steps: int = 0
    cpu_vmm_granule: int = 0
    kv_host_memory: int = 0
    split_policy: str = "writescope"
    split_fixed_ratio: float = 0.5
    split_gpu: str = DEFAULT_SPLIT_GPU

    def __post_init__(self) -> None:
        if self.clock not in CLOCKS:
            raise ValueError(f"{WHERE}.clock must be one of {', '.join(CLOCKS)}, got {self.clock!r}")
        cycle = self.line_cycle_steps
        if not isinstance(cycle, int) or isinstance(cycle, bool) or cycle < 0:
            raise ValueError(f"{WHERE}.line_cycle_steps must be a whole number >= 0, got {cycle!r}")
        granule = self.cpu_vmm_granule
        if not isinstance(granule, int) or isinstance(granule, bool) or granule < 0 or granule % PAGE_BYTES:
            raise ValueError(f"{WHERE}.cpu_vmm_granule must be 0 or a multiple of {PAGE_BYTES} bytes, got {granule!r}")
        try:
            self.serving_config()
        except ValueError as exc:  # name the key as the user wrote it
            raise ValueError(str(exc).replace("ServingConfig.", f"{WHERE}.")) from None
        entry = policy_entry(self.policy)
        if cycle and (not entry.offloads_experts or entry.moves_line):
            raise ValueError(f"{WHERE}.line_cycle_steps exercises the line under a policy that offloads experts and "
                             f"does not move the line itself (static-offload), not {self.policy!r}")
        if self.kv_host_memory and entry.offloads_experts:
            raise ValueError(f"{WHERE}.kv_host_memory (a host KV tier) and policy {self.policy!r} (which offloads "
                             f"experts) do not run together in the plugin yet: use policy 'vllm', or drop "
                             f"kv_host_memory")

    def serving_config(self) -> ServingConfig:
        return ServingConfig(policy=self.policy, max_offload_ratio=self.max_offload_ratio,
                             vamp_horizon_s=self.vamp_horizon_s, kv_host_memory=self.kv_host_memory,
                             split_policy=self.split_policy, split_fixed_ratio=self.split_fixed_ratio)

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> PluginSettings:
        """Parse the connector's extra config; unknown keys are refused by name."""
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"{WHERE}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        experts = extra.get("experts")
        if experts is not None:
            if not isinstance(experts, dict):
                raise ValueError(f"{WHERE}.experts must be an object, got {experts!r}")
            try:
                extra["experts"] = ExpertShape(**experts)
            except TypeError as exc:
                raise ValueError(f"{WHERE}.experts: {exc}") from None
        costs = extra.get("costs")
        if costs is not None and not (isinstance(costs, dict) and all(
                isinstance(v, (int, float)) and math.isfinite(v) for v in costs.values())):
            raise ValueError(f"{WHERE}.costs must be an object of finite numbers, got {costs!r}")
        return cls(**extra)

    def as_extra_config(self) -> dict[str, Any]:
        """The JSON-ready object ``from_extra_config`` reads back."""
        out: dict[str, Any] = {"policy": self.policy, "max_offload_ratio": self.max_offload_ratio,
                               "vamp_horizon_s": self.vamp_horizon_s, "clock": self.clock,
                               "line_cycle_steps": self.line_cycle_steps, "cpu_vmm_granule": self.cpu_vmm_granule,
                               "kv_host_memory": self.kv_host_memory, "split_policy": self.split_policy,
                               "split_fixed_ratio": self.split_fixed_ratio, "split_gpu": self.split_gpu}
        if self.costs is not None:
            out["costs"] = dict(self.costs)
        if self.experts is not None:
            out["experts"] = {f.name: getattr(self.experts, f.name) for f in fields(ExpertShape)}
        return out

    def kv_transfer_config(self) -> dict[str, Any]:
        """vLLM's ``--kv-transfer-config`` object that loads the plugin's connector with these settings."""
        return {"kv_connector": CONNECTOR_NAME, "kv_connector_module_path": CONNECTOR_MODULE,
                "kv_role": "kv_both", "kv_connector_extra_config": self.as_extra_config()}
