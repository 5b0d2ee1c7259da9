"""What one scheduler step decided (``SchedulerOutput``, the plan a driver executes) and the last admission that
failed (``BlockedAdmission``, the scheduler's reason not to retry it)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from moetide.core.request import Request


@dataclass
class SchedulerOutput:
    """One step's plan. ``scheduled`` pairs each request with its new tokens, in batch order;
    ``num_computed_before`` is where each request's chunk starts (its context length before the step)."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    num_computed_before: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)  # can never fit: the pool is smaller than the request
    offloaded: list[tuple[int, int]] = field(default_factory=list)
    reclaimed: bool = False  # the policy gave the last offloaded region back to its experts before this step
    # (host block, device block): the device block took over the host block's place in the prefix cache
    # (``BlockPool.promote``); the backend copies its content before this step's forward, scheduled or not
    promoted: list[tuple[int, int]] = field(default_factory=list)
    num_evicted_blocks: int = 0
    total_num_scheduled_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True, slots=True)
class BlockedAdmission:
    """The last failed admission: until blocks are freed, the same head with no smaller budget (a chunk at least
    as large) fails again before ``until_s``, so it is not retried (it would cost O(context) per step).
    ``until_s`` is the policy's ``refusal_holds_until`` (+inf for ``vllm``; ``vamp``'s next review), so the head
    is asked again at the first step the policy's answer could differ, as asking at every step would."""

    request: Request
    free_version: int  # the pool's free_version then
    budget: int  # the token budget it had
    until_s: float = math.inf

    def holds(self, head: Request, free_version: int, budget: int, now_s: float) -> bool:
        """Whether admitting ``head`` with ``budget`` tokens left at ``now_s`` would fail as this one did."""
        return (head is self.request and free_version == self.free_version and budget >= self.budget
                and now_s < self.until_s)
