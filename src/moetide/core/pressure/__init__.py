"""Memory-pressure policies, registered by name. ``get_policy("vllm")`` → a new policy instance."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

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


def _vamp_reclaim(params: VampParams) -> VampPolicy:
    policy = VampPolicy(dataclasses.replace(params, reclaim=True))
    policy.name = "vamp-reclaim"
    return policy


POLICIES: dict[str, Callable[..., PressurePolicy]] = {
    "vllm": VllmPolicy,
    "static-offload": StaticOffloadPolicy,
    "vamp": VampPolicy,
    "vamp-reclaim": _vamp_reclaim,
}
# Policies whose constructor takes VampParams (the setup derives them from specs and perf).
NEEDS_VAMP_PARAMS = frozenset({"vamp", "vamp-reclaim"})
# Policies that can offload experts (a driver keeps device room for staging beside them).
OFFLOADING_POLICIES = NEEDS_VAMP_PARAMS | {"static-offload"}


def get_policy(name: str, **params: object) -> PressurePolicy:
    try:
        factory = POLICIES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of: {', '.join(sorted(POLICIES))}") from None
    return factory(**params)


__all__ = [
    "Action", "EvictPrefix", "NEEDS_VAMP_PARAMS", "OFFLOADING_POLICIES", "OffloadExperts", "POLICIES", "Preempt",
    "PressurePolicy", "PressureView", "StepStats", "VampParams", "VampPolicy", "get_policy", "start_offload",
]
