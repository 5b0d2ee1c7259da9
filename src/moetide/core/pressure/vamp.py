"""``vamp``: move the weights/KV line when more KV is worth more than the expert bytes it costs.

Asked before any cached prefix is lost (``allocate_slots`` never evicts by itself), it weighs in seconds of
accelerator work per second what the next ``W`` blocks of KV would save against what the experts that would give
them up would cost: utility-based cache partitioning (Qureshi & Patt, MICRO 2006) between two tenants of one HBM.

* **Evicting — measured.** Evicted blocks' hashes go into a ghost list as long as the blocks the offload cap could
  add (``G``). An admission whose prefix misses on ghost blocks would have hit in a pool larger by their eviction
  depth; each such block's re-prefill at its position (``prefill_s_per_token`` +
  ``prefill_s_per_token_per_context`` · x per token), decayed over ``horizon_s``, is what ``W`` more blocks are
  worth. A preemption a window would have avoided adds the recompute no cache keeps.
* **Offloading — modeled** with the driver's own staging model (``StepStats``): busy share × the change in exposed
  staging per step-second over the recent step mix, plus a remap per expert.

Reviews move an *allowance*, not each decision: once per ``horizon_s`` the allowance grows by the experts of one
window (``W = G / 8``) if ``W`` blocks would have saved more than ``margin`` times their staging (the dead band
stands for the error of two first-order estimates that see no queueing). A growth is checked one review later
against the busy seconds per prompt token asked for and taken back if that rose by more than
``growth_tolerance``. A shortfall is covered by offloading cold experts up to the allowance and eviction of the
rest; past it, as ``vllm`` would (LRU eviction, then preemption of the newest running request for a running
requester; a waiting one waits, unless nothing runs and only the line can admit it).

**The queue — measured, outside the reviews.** Under vLLM 0.32's full-sequence admission pressure shows as requests
waiting, not as evictions or preemptions. A waiting request refused at that gate while others run (admitted, its
whole sequence is reserved, so no preemption follows; under first-chunk admission a request admitted early is one
preempted later, and the rule does not apply) may move the line at once
(``_queue_region``): the queue drains at the rate the batch runs, which one more running request raises by at
most 1/n and the region's KV by at most its share of the pool (none in the share of step time whose steps fill
the token budget: compute-bound, ``VampParams.step_fill``), and which the region's staging lowers by the share it
adds to every step (``StepStats.staging_share``); the region goes out when the first outweighs ``margin`` times
the second, within ``queue_staging_share`` of exposed staging in all.
Both sides are shares of the same throughput, so no horizon enters. The allowance follows the region, which goes
back as any growth does (below), not when the queue is gone: draining it then loses the cached prefixes it holds,
which the reviews count as ghost hits and answer with whole windows (docs/vamp/policy.md).

The line follows the allowance back (``give_back``): the last region drains (its free blocks leave the pool, each
used block when its request lets it go) and its experts get their pages back when it is empty; a calm pool gives
a window back after ``calm_reviews`` horizons. ``vamp-reclaim`` also lowers the allowance by the last region once
the pool has had room to spare for ``reclaim_hold_s``. ``give_back=False`` is the paper's controller.

Every coefficient is a named field of ``VampParams`` (``core.pressure.vamp_params``), derived by the driver's cost
provider. The measurements behind each rule: docs/vamp/policy.md.
"""

from __future__ import annotations

import math
from collections import OrderedDict

from moetide.core.pressure.base import Action, EvictPrefix, OffloadExperts, Preempt, PressurePolicy, PressureView
from moetide.core.pressure.vamp_params import DecayedRate, StepStats, VampParams
from moetide.units import cdiv

__all__ = ["DecayedRate", "StepStats", "VampParams", "VampPolicy"]

WINDOWS_PER_CAP = 8  # W = G / 8: the line moves by an eighth of what the cap can add at a time


class VampPolicy(PressurePolicy):
    name = "vamp"

    def __init__(self, params: VampParams) -> None:
        self.params = params
        self._busy = DecayedRate(params.horizon_s)  # step seconds per second
        self._last_busy_s = 0.0
        self._ghost: OrderedDict[int, int] = OrderedDict()  # evicted block hash -> eviction number
        self._num_evicted = 0  # blocks evicted so far (the ghost list's clock)
        self._ghost_capacity = 0  # G: set from the expert line (blocks the cap can add)
        self._next = DecayedRate(params.horizon_s)  # re-prefill s/s W more blocks would have saved (ghost hits)
        self._preempted = DecayedRate(params.horizon_s)  # ... and the recompute of preemptions W more would avoid
        # the waiting request whose ghost hits were counted last, and its preemptions then: a return after a
        # preemption is an admission of its own
        self._admitted: tuple[str, int] | None = None
        self._allowed = 0  # experts the line may have offloaded now (moved by _review)
        self._demand = DecayedRate(params.horizon_s)  # prompt tokens asked for (first admissions) per second
        self._grew_at: float | None = None  # busy s per demanded token when the line last grew (checked next review)
        self._no_growth_until = -math.inf
        self.num_growths_undone = 0
        self._next_review_s: float | None = None
        self._next_reclaim_check_s = -math.inf
        self._roomy_since: float | None = None  # since when the pool has had room to spare (vamp-reclaim)
        self._draining: list[int] | None = None  # blocks of the region being given back (give_back)
        self._line = None  # the expert line of the last plan (read by reads_every_step)
        self._refused_at_gate = False  # the last ask was at the full-sequence gate
        self.num_given_back = 0

    @property
    def reads_every_step(self) -> bool:
        """Whether the scheduler must step normally (no decode fast path): reclaim keeps a clock read at every
        step, and a draining region goes back at the first step after its last block is freed."""
        if self.params.reclaim or self._draining is not None:
            return True
        line = self._line  # a review lowered the allowance: the next step starts giving back
        return self.params.give_back and line is not None and line.residency.num_offloaded > self._allowed

    # ---- the plan ---------------------------------------------------------------------------------------------
    def refusal_holds_until(self, now_s: float) -> float:
        """A waiting request refused now is refused again until the next review moves the allowance (the other
        ways out, eviction and the room already allowed, move only with the pool), unless it was refused at the
        full-sequence gate where the queue may still move the line: that answer follows the batch and the step mix,
        so it is asked at every step."""
        line = self._line
        if (self._refused_at_gate and self.params.queue_staging_share and line is not None
                and line.residency.num_offloaded < line.residency.max_num_offloaded):
            return now_s
        return now_s if self._next_review_s is None else max(now_s, self._next_review_s)

    def relieve(self, view: PressureView) -> list[Action]:
        self._refused_at_gate = view.whole_sequence  # read by refusal_holds_until, should this ask be refused
        self._observe(view.now_s)
        line = self._line = view.expert_line
        if line is not None:
            self._size_ghost_list(line)
            self._review(line, view.now_s)
        need = view.shortfall_blocks
        room = max(self._allowed - line.residency.num_offloaded, 0) if line is not None else 0
        region, gained = self._offload_region(view, need, room) if room else ([], 0)
        if gained >= need:  # the line covers it: no victim to look at
            self._keep_draining_region(view.pool)
            return [OffloadExperts(tuple(region))]
        evict = list(self._evict_units(view))
        evictable = sum(freed for freed, _ in evict)
        if gained + evictable < need and view.whole_sequence and view.running and line is not None:
            grown = self._queue_region(view, need - evictable)  # a queue: it waits unless the line moves for it
            if grown is not None:
                region, gained = grown
        if not gained and evictable < need:
            if view.requester_is_running:
                # vLLM's way: the newest running request (possibly the requester) steps back, its blocks become
                # evictable and the scheduler asks again
                victim = view.preemptible[-1] if view.preemptible else view.requester
                self._count_preemption(view, victim, need)
                return [Preempt(victim.request_id)]
            if view.running or line is None:
                return []  # a waiting requester waits for running requests to free memory
            cap = line.residency.max_num_offloaded - line.residency.num_offloaded
            region, gained = self._offload_region(view, need, cap)  # nothing runs: only the line can admit it
            if evictable + gained < need:
                return []
            # the allowance follows, or giving back would drain the region this request cannot run without
            self._allowed = max(self._allowed, line.residency.num_offloaded + len(region))
        actions: list[Action] = []
        if region:
            self._keep_draining_region(view.pool)
            actions.append(OffloadExperts(tuple(region)))
        left = need - gained
        if left > 0:
            taken = 0
            for freed, lost in evict:
                if taken >= left:
                    break
                taken += freed
                self._remember(view.pool, lost)
            actions.append(EvictPrefix(left))
        return actions

    def _queue_region(self, view: PressureView, need: int) -> tuple[list[tuple[int, int]], int] | None:
        """The region that admits a waiting requester (``need`` blocks beyond what eviction frees) when the queue's
        throughput outweighs its staging (module docstring), with the allowance raised to keep it; None
        otherwise."""
        p, line = self.params, view.expert_line
        residency = line.residency
        if not p.queue_staging_share:
            return None
        region, gained = self._offload_region(view, need, residency.max_num_offloaded - residency.num_offloaded)
        if gained < need:
            return None
        now = p.steps.staging_share(residency.num_offloaded)
        after = p.steps.staging_share(residency.num_offloaded + len(region))
        # the queue drains at the rate the batch runs. One more running request adds at most 1/n to it, and KV
        # at most its own share of the pool (a KV-bound batch grows in proportion to its pool); nothing in the
        # share of step time whose steps fill the token budget (compute-bound: a larger batch waits on compute
        # there). The region's staging takes (after - now) from every step.
        pool_blocks = line.kv_room(view.pool)[1]
        gain = min(1.0 / len(view.running), gained / max(pool_blocks, 1)) * (1.0 - p.step_fill())
        if after > p.queue_staging_share or gain <= p.margin * (after - now):
            return None
        self._allowed = max(self._allowed, residency.num_offloaded + len(region))
        return region, gained

    def _evict_units(self, view: PressureView):
        """(blocks freed, blocks lost) per LRU victim, in the order ``BlockPool.evict`` takes them."""
        pool = view.pool
        counted: set[int] = set()  # blocks an earlier victim already invalidates
        for block_id in pool.peek_victims(view.shortfall_blocks, view.protected_blocks):
            if block_id in counted:
                continue
            more = pool.registered_descendants(block_id, max(view.shortfall_blocks - len(counted), 1), counted)
            lost = [block_id, *more]
            counted.update(lost)
            freed = sum(1 for b in lost if pool.is_free(b))  # in-use descendants are uncached, not freed
            if freed:
                yield freed, lost

    def _offload_region(self, view: PressureView, need: int, max_experts: int) -> tuple[list[tuple[int, int]], int]:
        """The next cold experts (at most ``max_experts``) that cover ``need`` blocks, and the blocks they give."""
        line = view.expert_line
        residency = line.residency
        room = min(residency.max_num_offloaded - residency.num_offloaded, max_experts)
        wanted = self._experts_for(line, need) + 1
        region = residency.next_offload_region(max_experts=min(room, wanted))
        while region and line.blocks_gained(len(region) - 1) >= need:
            region.pop()  # the rounding's spare expert is not needed
        return region, line.blocks_gained(len(region))

    def _size_ghost_list(self, line) -> None:
        if not self._ghost_capacity:
            self._ghost_capacity = max(line.blocks_gained(line.residency.max_num_offloaded), 1)

    # ---- the comparison ----------------------------------------------------------------------------------------
    def _window(self) -> int:
        return max(self._ghost_capacity // WINDOWS_PER_CAP, 1)

    def _value_s_per_s(self, now_s: float) -> float:
        """Re-prefill seconds per second that ``W`` more blocks of KV would have saved (ghost hits at depth < W)."""
        return (self._next.rate(now_s) or 0.0) + (self._preempted.rate(now_s) or 0.0)

    def _staging_s_per_s(self, now_s: float, start: int, end: int) -> float:
        """Exposed staging seconds per second that offloading ``end`` rather than ``start`` experts adds, at the
        recent busy share."""
        steps = self.params.steps
        delta = steps.staging_share(end) - steps.staging_share(start)
        busy = self._busy.rate(now_s)
        return max(delta, 0.0) * (1.0 if busy is None else min(busy, 1.0))

    def _experts_for(self, line, num_blocks: int) -> int:
        """Experts whose KV bytes (net of the staging buffer) hold ``num_blocks`` blocks."""
        return cdiv(num_blocks * line.block_bytes, line.kv_bytes_per_expert)

    def _review(self, line, now_s: float) -> None:
        """Once per ``horizon_s``, move the allowed line by at most one window (see the module docstring)."""
        if self._next_review_s is None:
            self._next_review_s = now_s + self.params.horizon_s
        if now_s < self._next_review_s:
            return
        self._next_review_s = now_s + self.params.horizon_s
        step = self._experts_for(line, self._window())
        p = self.params
        cost = self._busy_per_demand(now_s)
        grew_at, self._grew_at = self._grew_at, None
        if grew_at is not None and cost is not None and cost > grew_at * (1 + p.growth_tolerance):
            # the last window made each token asked for cost more accelerator time, not less (the queueing and
            # staging it caused outweigh the re-prefill it saved): take it back and hold the line
            self._allowed = max(self._allowed - step, 0)
            self._no_growth_until = now_s + p.growth_hold_reviews * p.horizon_s
            self.num_growths_undone += 1
            return
        value = self._value_s_per_s(now_s)
        cap, allowed = line.residency.max_num_offloaded, self._allowed
        margin = p.margin
        grow = min(allowed + step, cap)
        remap_s_per_s = (grow - allowed) * p.remap_s_per_expert / p.horizon_s  # once a review
        if (allowed < cap and now_s >= self._no_growth_until
                and value > margin * (self._staging_s_per_s(now_s, allowed, grow) + remap_s_per_s)):
            self._allowed = grow
            # a growth bought back from preemptions is not judged by busy seconds per token: it trades the
            # recompute for staging at a load where latency, not the accelerator's time, is what preemption costs
            preempted = self._preempted.rate(now_s) or 0.0
            self._grew_at = None if preempted > (self._next.rate(now_s) or 0.0) else cost

    # ---- measurements -----------------------------------------------------------------------------------------
    def admitting(self, request, now_s: float, line=None) -> None:
        """The scheduler's admission hook, at a waiting request's prefix lookup before anything is allocated:
        every admission, not only those that hit a shortfall, counts its ghost hits and the prompt tokens asked for
        (the growth check's demand). Measured once per admission: a blocked request is retried every step, and
        a preempted one comes back as a new admission."""
        admission = (request.request_id, request.num_preemptions)
        if admission == self._admitted:
            return
        self._admitted = admission
        if request.num_cached_prompt_tokens is None:  # its first admission (not a preempted one's return)
            self._demand.add(now_s, request.num_prompt_tokens)
        if line is not None:
            self._size_ghost_list(line)
        self._count_ghost_hits(request, now_s)

    def _remember(self, pool, lost) -> None:
        """Put evicted blocks' hashes in the ghost list; each freed block advances its clock."""
        ghost = self._ghost
        for block_id in lost:
            block_hash = pool.block_hash(block_id)
            if block_hash is None:
                continue
            if pool.is_free(block_id):
                self._num_evicted += 1
            ghost[block_hash] = self._num_evicted
            ghost.move_to_end(block_hash)
        while len(ghost) > self._ghost_capacity:
            ghost.popitem(last=False)

    def _count_ghost_hits(self, requester, now_s: float) -> None:
        """A waiting request's prefix misses where it continues in the ghost list: price what a larger pool would
        have kept, by the depth it would have taken (once per request)."""
        if not self._ghost:
            return
        ghost, hashes, p = self._ghost, requester.block_hashes, self.params
        window = self._window()
        deepest = 0
        saved = 0.0
        for j in range(requester.num_computed_tokens // p.block_size, len(hashes)):
            evicted_at = ghost.pop(hashes[j], None)
            if evicted_at is None:
                break
            deepest = max(deepest, self._num_evicted - evicted_at)
            if deepest < window:  # a pool W blocks larger would still have held blocks 0..j
                saved += p.block_prefill_s(j)
        if saved:
            self._next.add(now_s, saved)

    def _count_preemption(self, view: PressureView, victim, need: int) -> None:
        """A preemption W more blocks would have avoided (a shortfall within a window) costs the re-prefill of
        the victim's computed tokens that no cache keeps for its return: priced like a ghost hit, as what the
        next window of capacity saves. Its registered prefix is left to the ghost list (it is lost only if it is
        evicted before the victim returns, and then the miss is counted there)."""
        if need > self._window():
            return
        bs = self.params.block_size
        num_blocks = cdiv(victim.num_computed_tokens, bs)
        kept = len(view.pool.lookup_chain(victim.block_hashes[:num_blocks]))
        seconds = sum(self.params.block_prefill_s(j) for j in range(kept, num_blocks))
        if seconds:
            self._preempted.add(view.now_s, seconds)

    # ---- rates -------------------------------------------------------------------------------------------------
    def _busy_per_demand(self, now_s: float) -> float | None:
        """Accelerator seconds per prompt token asked for, over the last ``horizon_s`` (None before both exist);
        the caller has observed the steps up to ``now_s``."""
        busy, demand = self._busy.rate(now_s), self._demand.rate(now_s)
        return busy / demand if busy is not None and demand else None

    def _observe(self, now_s: float) -> None:
        busy = self.params.steps.busy_s()
        self._busy.add_spread(now_s, busy - self._last_busy_s)
        self._last_busy_s = busy
        for rate in (self._next, self._preempted):
            rate.add(now_s, 0.0)  # the clocks run from the start, not from the first hit

    # ---- giving regions back -------------------------------------------------------------------------------
    def maybe_reclaim(self, line, pool, now_s: float) -> bool:
        """The scheduler's call before each step: give the last region back once it has drained (``give_back``),
        start draining it while more experts are offloaded than the line allows, and (``vamp-reclaim``) every
        ``reclaim_check_s`` review the line and lower it by the last region once the pool has had room to spare
        for ``reclaim_hold_s``. Returns whether a region went back."""
        p = self.params
        if p.reclaim and now_s >= self._next_reclaim_check_s:
            self._next_reclaim_check_s = now_s + p.reclaim_check_s
            self._observe(now_s)
            self._review(line, now_s)
            last = line.last_region()
            self._check_room(line, pool, now_s, p.reclaim_hold_s, len(last[0]) if last is not None else 0)
        elif p.give_back and self._allowed and now_s >= self._next_reclaim_check_s:
            # pressure that has receded for good: reviews run only at a shortfall, and none comes
            self._next_reclaim_check_s = now_s + p.reclaim_check_s
            self._size_ghost_list(line)
            self._check_room(line, pool, now_s, p.calm_reviews * p.horizon_s, self._experts_for(line, self._window()))
        return p.give_back and self._give_back(line, pool)

    def _give_back(self, line, pool) -> bool:
        """Start draining the last region while more experts are offloaded than allowed (cancel the drain once they
        are not); give it back once every block of it has drained."""
        if self._draining is None:
            # called every step: the cheap test first
            last = line.last_region() if line.residency.num_offloaded > self._allowed else None
            if last is None:
                return False
            ids = list(last[1])
            self._remember(pool, self._lost_by_drain(pool, ids))
            pool.drain(ids)
            self._draining = ids  # a region whose blocks were all free goes at once, below
        elif line.residency.num_offloaded <= self._allowed:  # the allowance came back up: the region stays
            self._keep_draining_region(pool)
            return False
        if pool.num_drained_blocks < len(self._draining) or not line.reclaim_last():
            return False
        self._draining = None
        self.num_given_back += 1
        return True

    def _keep_draining_region(self, pool) -> None:
        """The line grows again (or the allowance does): a region being given back stays (last first)."""
        if self._draining is not None:
            pool.undrain(self._draining)
            self._draining = None

    def _lost_by_drain(self, pool, ids: list[int]) -> list[int]:
        """The cached prefixes a drain evicts now: the region's free cached blocks and their descendants (blocks
        still in use are uncached when they come free, unrecorded)."""
        lost: list[int] = []
        counted: set[int] = set()
        for block_id in ids:
            if block_id in counted or not pool.is_free(block_id) or pool.block_hash(block_id) is None:
                continue
            more = pool.registered_descendants(block_id, None, counted)
            counted.update((block_id, *more))
            lost += [block_id, *more]
        return lost

    def _check_room(self, line, pool, now_s: float, hold_s: float, experts: int) -> None:
        """Once the pool has had room to spare for ``hold_s`` — uncached free blocks beyond the last region's own
        of at least ``reclaim_watermark`` of the pool (sampled at the checks; restarted after each move) — the
        allowance falls by ``experts`` below what is offloaded: ``vamp-reclaim`` gives the last region back after
        ``reclaim_hold_s``, ``vamp`` a window after ``calm_reviews`` horizons (long enough that a lull within a
        burst of pressure keeps the line)."""
        p = self.params
        last = line.last_region()
        if last is None or self._draining is not None:
            self._roomy_since = None
            return
        free, total = line.kv_room(pool)  # device room (the engine's line leaves host KV out)
        own = sum(1 for b in last[1] if pool.is_free(b) and pool.block_hash(b) is None)  # in ``free`` already
        if free - own < p.reclaim_watermark * total:
            self._roomy_since = None
            return
        if self._roomy_since is None:
            self._roomy_since = now_s
        if now_s - self._roomy_since >= hold_s:
            self._allowed = min(self._allowed, max(line.residency.num_offloaded - experts, 0))
            self._roomy_since = None  # the smaller pool must show room of its own before the next region goes
