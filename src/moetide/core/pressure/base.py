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
    scheduled in this step), lowest priority last; ``requester`` is the request that could not allocate;
    ``whole_sequence``: the shortfall is vLLM 0.32's full-sequence admission gate's (the requester's whole known
    sequence), so admitting it risks no preemption later."""

    shortfall_blocks: int
    requester: Request
    requester_is_running: bool
    preemptible: Sequence[Request]
    pool: BlockPool
    protected_blocks: frozenset[int]
    now_s: float
    expert_line: ExpertLine | None = None
    running: Sequence[Request] = ()
    whole_sequence: bool = False


class PressurePolicy(Protocol):
    """Every hook a driver calls, each with a safe default: a policy subclasses this and overrides what it
    needs. The scheduler and both drivers call these and nothing else of a policy."""

    name: str

    def relieve(self, view: PressureView) -> list[Action]:
        """Return actions that together free at least ``view.shortfall_blocks`` blocks, or [] if none can."""
        ...

    def admitting(self, request: Request, now_s: float, line: ExpertLine | None = None) -> None:
        """Called at every waiting request's prefix lookup (``request.num_computed_tokens`` set to its hits),
        before allocation."""

    def maybe_reclaim(self, line: ExpertLine, pool: BlockPool, now_s: float) -> bool:
        """Called before each step with an expert line; True when it moved the line back towards the experts."""
        return False

    @property
    def reads_every_step(self) -> bool:
        """Whether the scheduler must run every step in full (no decode fast path) because the policy reads
        something at each step. True unless a policy says otherwise: one that keeps per-step state is stepped."""
        return True

    @property
    def evicts_when_it_can(self) -> bool:
        """True only for a policy that, for a running requester with no prefix hits, evicts exactly the
        shortfall whenever cached-free blocks cover it and reads nothing else of the view (``core.runs`` then
        takes prefill runs without asking it)."""
        return False

    def refusal_holds_until(self, now_s: float) -> float:
        """Until when a waiting request this policy could not admit (``relieve`` returned no way out) would be
        refused again while no block is freed: the scheduler does not ask before then. ``now_s`` (ask at every
        step) unless a policy knows better: ``vllm``'s answer moves only with the pool (+inf), ``vamp``'s also at
        its next review."""
        return now_s

    @property
    def offload_at_start(self) -> bool:
        """Whether the whole offload cap goes out before the first request (``start_offload``)."""
        return False


def start_offload(policy: PressurePolicy, line: ExpertLine | None, *, always: bool = False) -> int:
    """Offload the cap's coldest experts before the first request when the policy asks for it (or ``always``:
    the engine's ``static_offload``, whatever the policy); both drivers call this once, after building the
    line. Returns how many experts went out."""
    if line is None or not (always or policy.offload_at_start):
        return 0
    region = line.residency.next_offload_region(max_experts=line.residency.max_num_offloaded)
    if region:
        line.offload(tuple(region))
    return len(region)
