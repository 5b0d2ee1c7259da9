"""``vllm``: what today's engines do. The weights/KV line never moves.

Mirrors vLLM v1, where eviction happens inside ``get_new_blocks`` only once ``allocate_slots`` has checked that
free plus evictable blocks cover the request:
1. If cached-but-free blocks (the requester's own prefix hits excepted) cover the shortfall, evict that many in
   LRU order, chain tails first.
2. Otherwise a running requester preempts the newest running request (the last in FCFS order) by recompute —
   possibly itself — and the scheduler asks again; nothing is evicted in vain. A waiting requester waits:
   vLLM v1 stops admitting when allocation fails and never preempts for a waiting request.
A waiting request is first held to vLLM 0.32's full-sequence gate (``Scheduler._full_sequence_fits``): it asks
here only when even every evictable block would not hold its whole sequence, so this returns [] and it waits.
``benchmarks/vllm_fidelity.py`` holds the result to vLLM 0.32's own scheduler step for step (docs/replay.md).
"""

from __future__ import annotations

import math

from moetide.core.pressure.base import Action, EvictPrefix, Preempt, PressurePolicy, PressureView


class VllmPolicy(PressurePolicy):
    name = "vllm"
    reads_every_step = False
    # For a running requester with no prefix hits: evicts exactly the shortfall whenever cached-free blocks cover
    # it, and reads nothing else of the view; core.runs relies on this to take prefill runs without asking.
    evicts_when_it_can = True

    def refusal_holds_until(self, now_s: float) -> float:
        return math.inf  # the answer reads the pool alone

    def relieve(self, view: PressureView) -> list[Action]:
        if view.pool.eviction_covers(view.shortfall_blocks, view.protected_blocks):
            return [EvictPrefix(view.shortfall_blocks)]
        if view.requester_is_running:
            victim = view.preemptible[-1] if view.preemptible else view.requester
            return [Preempt(victim.request_id)]
        return []


class StaticOffloadPolicy(VllmPolicy):
    """``static-offload``: a fixed share of expert bytes is offloaded once, before the first request (what a
    static weight offload gives), then ``vllm``'s behaviour. Shows what adaptivity adds over a fixed line."""

    name = "static-offload"
    offload_at_start = True
