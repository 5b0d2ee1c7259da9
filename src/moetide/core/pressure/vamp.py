"""``vamp``: move the weights/KV line when that is the cheapest way out. Estimates are seconds of future work.

Asked before any cached prefix is lost (``allocate_slots`` never evicts by itself), it prices three sources of
free blocks and fills the shortfall greedily from whichever source's *next unit* is cheapest per block:

* **evict** the next LRU victim (chain tails first): p(reuse) × re-prefill time of every token the eviction
  invalidates — the block and its registered descendants (hashes are chained). p(reuse) comes from the owning
  session: exp(−idle / ``reuse_tau_s``), 1 while it has a request in flight; unknown owner: ``p_reuse_unknown``.
* **offload** the next expert of ``ExpertResidency.next_offload_region`` (cold first, spread over layers):
  expected remaining steps (``horizon_s`` / ``decode_step_s``) × the exposed staging time per step it adds
  (``staging_s_per_step(n)`` is the modeled exposed staging for n offloaded experts, so the marginal cost counts
  what overlaps with compute as free) + a one-off ``remap_s_per_expert``; never past the offload cap.
* **preempt** (only for a running requester; newest running request first): recompute of its computed tokens,
  the same again as the delay it suffers, and the stall its recompute imposes on each other running request.

Units are taken until the shortfall is covered; if all three cannot cover it, a running requester preempts
itself (as under ``vllm``) and a waiting one waits. Every coefficient is a named field of ``VampParams``; the
replay or engine setup derives them from specs and the perf model (core never imports perf).

``vamp-reclaim`` also gives the last offloaded region back once the free share of the pool has stayed
above ``reclaim_free_share`` for ``reclaim_patience_s`` and the region's blocks are all free (hysteresis: a
reclaim restarts the clock).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from moetide.core.pressure.base import Action, EvictPrefix, OffloadExperts, Preempt, PressureView


@dataclass(frozen=True)
class VampParams:
    prefill_s_per_token: float  # re-prefill cost of one token (a full prefill chunk's modeled time / its tokens)
    decode_step_s: float  # a typical decode step's modeled time
    # exposed staging seconds per step with n experts offloaded, for steps of T tokens: (n, T) -> s
    staging_s_per_step: Callable[[int, int], float]
    block_size: int
    reference_step_tokens: int = 32  # T to price staging at until the scheduler has seen steps
    horizon_s: float = 60.0  # how long an offload is expected to persist (without reclaim: the rest of the run)
    reuse_tau_s: float = 300.0  # idle time after which a session's prefix is e^-1 as likely to be reused
    p_reuse_unknown: float = 0.5  # cached blocks no session claims
    remap_s_per_expert: float = 50e-6  # cuMemUnmap/cuMemMap of an expert's pages and the block-table update
    reclaim: bool = False
    reclaim_free_share: float = 0.25  # free share of the pool (cached-free included) that must persist
    reclaim_patience_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("prefill_s_per_token", "decode_step_s", "horizon_s", "reuse_tau_s", "reclaim_patience_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"VampParams.{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.p_reuse_unknown <= 1 or not 0 < self.reclaim_free_share < 1:
            raise ValueError("p_reuse_unknown must be in [0, 1] and reclaim_free_share in (0, 1)")


class VampPolicy:
    name = "vamp"
    reads_every_step = True  # step-time averages and the reclaim clock: the replay must not skip steps

    def __init__(self, params: VampParams) -> None:
        self.params = params
        self._free_since_s: float | None = None

    def relieve(self, view: PressureView) -> list[Action]:
        need = view.shortfall_blocks
        sources = [self._evict_units(view), self._offload_units(view)]
        if view.requester_is_running:
            sources.append(self._preempt_units(view))
        heads = [next(it, None) for it in sources]
        evict = offload = 0
        total = 0.0
        region: list[tuple[int, int]] = []
        victims: list[str] = []
        while need > 0 and any(h is not None for h in heads):
            i = min((i for i, h in enumerate(heads) if h is not None), key=lambda i: heads[i][0])
            cost, blocks, unit = heads[i]
            need -= blocks
            total += cost * blocks
            if i == 0:
                evict += blocks
            elif i == 1:
                region.append(unit)
                offload += blocks
            else:
                victims.append(unit)
            heads[i] = next(sources[i], None)
        if need > 0:  # the three sources cannot cover it
            return [Preempt(view.requester.request_id)] if view.requester_is_running else []
        if view.requester.request_id in victims:
            return [Preempt(view.requester.request_id)]  # cheapest was to step back itself
        if not view.requester_is_running and region and total > self._wait_cost_s(view):
            return []  # waiting for running requests to free memory is cheaper than moving the line
        actions: list[Action] = []
        if region:
            actions.append(OffloadExperts(tuple(region)))
        if evict:
            actions.append(EvictPrefix(evict))
        actions.extend(Preempt(r) for r in victims)
        return actions

    # ---- the three sources, each an iterator of (cost per block, blocks, unit) in the order they must be taken
    def _evict_units(self, view: PressureView):
        p = self.params
        token_s = p.prefill_s_per_token * p.block_size
        pool = view.pool
        counted: set[int] = set()  # blocks an earlier victim of this plan already invalidates
        for block_id in pool.peek_victims(view.shortfall_blocks, view.protected_blocks):
            if block_id in counted:
                continue
            # every lost block costs the same per block, so counting past the shortfall changes no decision
            more = pool.registered_descendants(block_id, max(view.shortfall_blocks - len(counted), 1), counted)
            lost = [block_id, *more]
            counted.update(lost)
            freed = sum(1 for b in lost if pool.is_free(b))  # in-use descendants are uncached, not freed
            if freed:
                yield self._p_reuse(view, pool.owner_of(block_id)) * token_s * len(lost) / freed, freed, block_id

    def _offload_units(self, view: PressureView):
        line = view.expert_line
        if line is None:
            return
        p = self.params
        residency = line.residency
        room = residency.max_num_offloaded - residency.num_offloaded
        # every running request (and the requester) pays the exposed staging on every step of the horizon
        steps = p.horizon_s / (view.recent_step_s or p.decode_step_s) * (view.num_running + 1)
        offloaded = residency.num_offloaded
        tokens = round(view.recent_step_tokens or p.reference_step_tokens)  # prefill-heavy steps stage more
        taken = 0
        wanted = -(-view.shortfall_blocks * line.block_bytes // line.expert_bytes) + 1  # enough to cover it
        for key in residency.next_offload_region(max_experts=min(room, wanted)):
            gained = line.blocks_gained(taken + 1) - line.blocks_gained(taken)
            cost = steps * (p.staging_s_per_step(offloaded + 1, tokens) - p.staging_s_per_step(offloaded, tokens))
            cost += p.remap_s_per_expert
            taken += 1
            offloaded += 1
            yield (cost / gained if gained else math.inf), gained, key

    def _wait_cost_s(self, view: PressureView) -> float:
        """Waiting: the requester is admitted once the running request closest to finishing frees its blocks —
        its remaining outputs × the recent step time. (Requests queued behind it are not charged: under load
        they wait for capacity either way, and moving the line costs every request throughput.)"""
        left = [r.max_output_tokens - r.num_output_tokens for r in view.running]
        if not left:
            return math.inf
        return min(left) * (view.recent_step_s or self.params.decode_step_s)

    def _preempt_units(self, view: PressureView):
        p = self.params
        others = max(view.num_running - 1, 0)
        candidates = list(reversed(view.preemptible)) + [view.requester]  # itself last: its own way out
        for request in candidates:
            blocks = -(-request.num_computed_tokens // p.block_size)  # its blocks (state blocks not counted)
            if blocks <= 0:
                continue
            recompute_s = request.num_computed_tokens * p.prefill_s_per_token
            cost = recompute_s * (2 + others)  # recompute + its own delay + the stall on the others
            yield cost / blocks, blocks, request.request_id

    def _p_reuse(self, view: PressureView, owner: str | None) -> float:
        if owner is None:
            return self.params.p_reuse_unknown
        state = view.sessions.get(owner)
        if state is None:
            return 0.0  # the session was closed
        if state.num_in_flight > 0:
            return 1.0
        return math.exp(-max(view.now_s - state.last_active_s, 0.0) / self.params.reuse_tau_s)

    # ---- reclaim (vamp-reclaim) ---------------------------------------------------------------------------
    def maybe_reclaim(self, line, pool, now_s: float) -> bool:
        p = self.params
        if not p.reclaim or line.last_region() is None:
            return False
        if pool.num_free_blocks < p.reclaim_free_share * pool.num_blocks:
            self._free_since_s = None
            return False
        if self._free_since_s is None:
            self._free_since_s = now_s
        if now_s - self._free_since_s < p.reclaim_patience_s or not line.reclaim_last():
            return False
        self._free_since_s = now_s
        return True
