"""``vllm``: what today's engines do. The weights/KV line never moves.

1. Evict cached-but-free blocks in LRU order (chain tails first). vLLM does this implicitly inside
   ``get_new_blocks``; here it is the policy's explicit first action.
2. If that is not enough and the requester is running, preempt the newest running request (the last one in
   FCFS order) by recompute — repeatedly, as vLLM's scheduler does, possibly the requester itself. A waiting
   request never preempts anyone: it waits (vLLM v1 breaks out of its waiting loop when allocation fails).
"""

from __future__ import annotations

from moetide.core.pressure.base import Action, EvictPrefix, Preempt, PressureView


class VllmPolicy:
    name = "vllm"

    def relieve(self, view: PressureView) -> list[Action]:
        actions: list[Action] = []
        evictable = view.pool.num_cached_free_blocks - len(view.protected_blocks & _cached_free(view))
        if evictable > 0:
            actions.append(EvictPrefix(min(view.shortfall_blocks, evictable)))
            if evictable >= view.shortfall_blocks:
                return actions
        if view.requester_is_running:
            victim = view.preemptible[-1] if view.preemptible else view.requester
            actions.append(Preempt(victim.request_id))
        return actions


def _cached_free(view: PressureView) -> set[int]:
    if not view.protected_blocks:
        return set()
    return {b for b in view.protected_blocks if view.pool.is_free(b) and view.pool.block_hash(b) is not None}
