"""Memory-pressure policies, registered by name with what each one is.

A driver asks the registry, never a list of names: ``policy_entry(name).offloads_experts`` (keep device room for
staging beside the experts), ``.moves_line`` (the line moves while serving), ``.needs_costs`` (the policy is priced
by the driver's cost provider, a callable returning ``VampParams``). ``get_policy(name, costs=...)`` makes one and
calls the provider only for a policy that needs it. A new policy is its module and one entry here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from moetide.core.pressure.base import (
    Action,
    EvictPrefix,
    OffloadExperts,
    Preempt,
    PressurePolicy,
    PressureView,
    start_offload,
)
from moetide.core.pressure.vamp import StepStats, VampParams, VampPolicy
from moetide.core.pressure.vllm import StaticOffloadPolicy, VllmPolicy

CostProvider = Callable[[], VampParams]


@dataclass(frozen=True)
class PolicyEntry:
    """One registered policy. ``make()`` builds it; with ``needs_costs``, ``make(params=VampParams)``."""

    make: Callable[..., PressurePolicy]
    summary: str
    offloads_experts: bool = False  # may give expert memory to the KV cache (staged from host when routed)
    moves_line: bool = False  # moves the line while serving, not only once before the first request
    needs_costs: bool = False  # priced by the driver's cost provider

    def __post_init__(self) -> None:
        if (self.moves_line or self.needs_costs) and not self.offloads_experts:
            raise ValueError("a policy that moves the line or is priced by expert costs offloads experts")


def _vamp_reclaim(params: VampParams) -> VampPolicy:
    policy = VampPolicy(dataclasses.replace(params, reclaim=True))
    policy.name = "vamp-reclaim"
    return policy


POLICIES: dict[str, PolicyEntry] = {
    "vllm": PolicyEntry(VllmPolicy, "vLLM 0.32: evict cached prefixes, then preempt; the line never moves"),
    "static-offload": PolicyEntry(StaticOffloadPolicy, "the offload cap goes out before the first request, then "
                                  "vllm's rules", offloads_experts=True),
    "vamp": PolicyEntry(VampPolicy, "move the line when more KV is worth more than the experts it costs",
                        offloads_experts=True, moves_line=True, needs_costs=True),
    "vamp-reclaim": PolicyEntry(_vamp_reclaim, "vamp, and give regions back once the pool has room to spare",
                                offloads_experts=True, moves_line=True, needs_costs=True),
}


def policy_entry(name: str) -> PolicyEntry:
    """The registered policy ``name`` (any case); ValueError naming the choices otherwise."""
    try:
        return POLICIES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of: {', '.join(sorted(POLICIES))}") from None


def get_policy(name: str, *, costs: CostProvider | None = None, **params: object) -> PressurePolicy:
    """A new policy. One that ``needs_costs`` gets ``params=costs()`` unless ``params`` is given itself."""
    entry = policy_entry(name)
    if entry.needs_costs and "params" not in params:
        if costs is None:
            raise ValueError(f"policy {name} is priced by the driver's costs: give costs (or params)")
        params = {**params, "params": costs()}
    return entry.make(**params)


__all__ = [
    "Action", "CostProvider", "EvictPrefix", "OffloadExperts", "POLICIES", "PolicyEntry", "Preempt",
    "PressurePolicy", "PressureView", "StepStats", "VampParams", "VampPolicy", "get_policy", "policy_entry",
    "start_offload",
]
