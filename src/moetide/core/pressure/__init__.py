"""Memory-pressure policies, registered by name. ``get_policy("vllm")`` → a new policy instance."""

from __future__ import annotations

from collections.abc import Callable

from moetide.core.pressure.base import (
    Action,
    EvictPrefix,
    OffloadExperts,
    Preempt,
    PressurePolicy,
    PressureView,
)
from moetide.core.pressure.vllm import VllmPolicy

POLICIES: dict[str, Callable[..., PressurePolicy]] = {
    "vllm": VllmPolicy,
}


def get_policy(name: str, **params: object) -> PressurePolicy:
    try:
        factory = POLICIES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of: {', '.join(sorted(POLICIES))}") from None
    return factory(**params)


__all__ = [
    "Action", "EvictPrefix", "OffloadExperts", "Preempt", "PressurePolicy", "PressureView", "POLICIES", "get_policy",
]
