"""The contract between the scheduler and a memory-pressure policy.

When ``allocate_slots`` cannot be met from uncached free blocks, the scheduler asks the policy for a plan: given a
shortfall of N blocks and a read-only view of the state, a list of actions, each with the policy's estimate of its
future cost in seconds (``None`` where a policy does not estimate, as the ``vllm`` policy does not). The scheduler
carries the actions out in order and retries; the policy never mutates state itself (pure core, thin backends).

Actions:
* ``EvictPrefix(num_blocks)`` — uncache that many cached-free blocks, LRU chain tails first (``BlockPool.evict``).
* ``Preempt(request_id)`` — free a running request's blocks; it returns to the front of the waiting queue and
  recomputes what the cache no longer holds (vLLM's preemption by recompute).
* ``OffloadExperts(region)`` — give (layer, expert) regions' pages to the KV pool; the experts are then staged
  from host memory when routed (``core.arena`` / ``core.experts``).
An empty plan means "no way out": a waiting request keeps waiting; a running one is preempted itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from moetide.core.blocks import BlockPool
    from moetide.core.expert_line import ExpertLine
    from moetide.core.request import Request


@dataclass(frozen=True, slots=True)
class EvictPrefix:
    num_blocks: int
    cost_s: float | None = None


@dataclass(frozen=True, slots=True)
class Preempt:
    request_id: str
    cost_s: float | None = None


@dataclass(frozen=True, slots=True)
class OffloadExperts:
    region: tuple[tuple[int, int], ...]
    cost_s: float | None = None


Action = EvictPrefix | Preempt | OffloadExperts


@dataclass(frozen=True)
class PressureView:
    """What a policy may read. ``preemptible`` lists running requests that may be preempted now (not yet
    scheduled in this step), lowest priority last; ``requester`` is the request that could not allocate."""

    shortfall_blocks: int
    requester: Request
    requester_is_running: bool
    preemptible: Sequence[Request]
    pool: BlockPool
    protected_blocks: frozenset[int]
    now_s: float
    expert_line: ExpertLine | None = None
    running: Sequence[Request] = ()


class PressurePolicy(Protocol):
    name: str

    def relieve(self, view: PressureView) -> list[Action]:
        """Return actions that together free at least ``view.shortfall_blocks`` blocks, or [] if none can."""
        ...

    # Optional, called by the scheduler when a policy has them: ``admitting(request, hits, pool, now_s,
    # expert_line)`` at every waiting request's prefix lookup, before allocation; ``maybe_reclaim(line, pool,
    # now_s)`` before each step.
