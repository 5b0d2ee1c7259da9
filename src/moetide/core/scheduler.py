"""Continuous batching in vLLM v1's step model, shared by the simulator and the engine.

There are no prefill and decode phases: each step, every running request's computed tokens catch up with its
known tokens as far as ``max_num_batched_tokens`` allows (chunked prefill), then waiting requests are admitted in
FCFS order while budget, ``max_num_seqs`` and memory allow. ``schedule()`` returns a plan, the backend executes it
(the simulator charges time, the engine runs tensors), and ``update()`` consumes the result.

Memory: a request's blocks come from ``KVCacheManager.allocate_slots``, which never evicts implicitly. When it
returns ``None`` the scheduler asks the pressure policy (``core.pressure``) for a plan — evict cached prefixes,
preempt, offload experts — carries it out and retries. Rules inherited from vLLM v1:
* only running requests not yet scheduled in this step may be preempted (so a block registered this step is
  always computed this step — see ``core.kv_manager``);
* a preempted request frees its blocks, goes back to the *front* of the waiting queue, and later recomputes
  whatever the prefix cache no longer holds;
* if anything was preempted in a step, no waiting request is admitted in that step;
* a waiting request that cannot get memory blocks the queue behind it (FCFS);
* a waiting (or preempted) request is admitted only if its whole known sequence fits — the free blocks, cached
  ones included, less its own hits, cover every block it needs — not just its first chunk
  (``scheduler_reserve_full_isl``, vLLM 0.32's default, PR #37307); without it, as in older vLLM (0.15), a
  long prompt is admitted on its first chunk and later chunks preempt the requests behind it;
* ``long_prefill_token_threshold`` caps chunks only while more than one request is running or waiting: a lone
  request has nobody to starve (``threshold_caps_lone_request`` restores vLLM 0.15's cap on every chunk).
With a host KV tier (a two-tier pool), ``max_host_blocks_held`` bounds admission by the host KV that running
requests attend each step: a waiting request that would take it past the bound waits, as one short of memory
does, once evicting cached device prefixes and moving its own host hits onto the device cannot make room
(``core.host_admission``). Without a bound, every spilled context is attended every step, and a large tier buys
shorter queues with slower steps (docs/writescope.md, "An admission bound").
A request leaves by finishing (``update``), by failing to fit even alone, or by ``abort_request``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from moetide.core.expert_line import ExpertLine
from moetide.core.host_admission import HostAdmission
from moetide.core.kv_manager import KVCacheManager
from moetide.core.mamba_states import aligned_chunk
from moetide.core.pressure import EvictPrefix, OffloadExperts, Preempt, PressurePolicy, PressureView
from moetide.core.request import Request, RequestStatus
from moetide.core.step_plan import BlockedAdmission, SchedulerOutput


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits (vLLM's names and defaults for online serving)."""

    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    long_prefill_token_threshold: int = 0  # 0: a prefill chunk may take the whole token budget
    enable_prefix_caching: bool = True
    # admit a waiting request only if its whole known sequence fits (vLLM 0.32's default); False: its first chunk
    scheduler_reserve_full_isl: bool = True
    # the threshold caps a lone request's chunks too (vLLM 0.15); False: only while others run or wait (0.32)
    threshold_caps_lone_request: bool = False
    # Two-tier pool (host KV): admit a waiting request only if the host blocks that running requests hold, plus
    # what it would add, stay within this bound (None: no bound). See ``core.host_admission``.
    max_host_blocks_held: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
        if self.max_host_blocks_held is not None and self.max_host_blocks_held < 1:
            raise ValueError(f"max_host_blocks_held must be a positive number of blocks, got "
                             f"{self.max_host_blocks_held}")


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        policy: PressurePolicy,
        expert_line: ExpertLine | None = None,
    ) -> None:
        self.config = config
        self.kv = kv
        self.policy = policy
        self.expert_line = expert_line
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.now_s = 0.0
        self.num_preemptions = 0
        self.num_evicted_blocks = 0
        self.num_host_bound_waits = 0  # admissions deferred by max_host_blocks_held
        # two-tier pool: the rule of config.max_host_blocks_held (read each admission, so the bound may change)
        self.host_admission = HostAdmission(kv) if kv.pool.host_tier is not None else None
        self._blocked: BlockedAdmission | None = None
        self._threshold = config.long_prefill_token_threshold  # this step's (schedule() drops it for a lone request)

    @property
    def num_host_hits_promoted(self) -> int:
        """Host prefix hits past ``max_host_blocks_held`` copied to device blocks (``core.host_admission``)."""
        return self.host_admission.num_promoted if self.host_admission is not None else 0

    @property
    def num_host_hits_dropped(self) -> int:
        """Host prefix hits past ``max_host_blocks_held`` recomputed onto the device instead."""
        return self.host_admission.num_dropped if self.host_admission is not None else 0

    # ---- requests in and out ------------------------------------------------------------------------------
    def add_request(self, request: Request, now_s: float | None = None) -> None:
        if now_s is not None:
            self.now_s = now_s
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> Request | None:
        """Drop a request wherever it is — waiting, preempted or running — and free its blocks, as vLLM's
        ``finish_requests(..., FINISHED_ABORTED)`` does (a client that left). Call between steps. Returns the
        request, or None when no request with that id is in the queues (finished already, or never added)."""
        for queue in (self.running, self.waiting):
            request = next((r for r in queue if r.request_id == request_id), None)
            if request is not None:
                queue.remove(request)
                self.kv.free(request_id)
                request.status = RequestStatus.FINISHED
                if self._blocked is not None and self._blocked.request is request:
                    self._blocked = None
                return request
        return None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def waiting_head_blocked(self, budget: int) -> bool:
        """Whether admitting the head of the waiting queue with ``budget`` tokens left would fail as the last
        failed admission did (``BlockedAdmission``): nothing has been freed since and the budget is no larger."""
        blocked = self._blocked
        return (blocked is not None and bool(self.waiting)
                and blocked.holds(self.waiting[0], self.kv.pool.free_version, budget, self.now_s))

    @property
    def blocked_until_s(self) -> float:
        """When the last failed admission stops holding by itself (``BlockedAdmission.until_s``; +inf if none)."""
        return math.inf if self._blocked is None else self._blocked.until_s

    # ---- one step -----------------------------------------------------------------------------------------
    def schedule(self, now_s: float | None = None) -> SchedulerOutput:
        if now_s is not None:
            self.now_s = now_s
        out = SchedulerOutput()
        self.kv.new_step()
        threshold = self.config.long_prefill_token_threshold
        alone = len(self.running) + len(self.waiting) <= 1 and not self.config.threshold_caps_lone_request
        self._threshold = 0 if alone else threshold
        if self.expert_line is not None:
            out.reclaimed = self.policy.maybe_reclaim(self.expert_line, self.kv.pool, self.now_s)
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        out.total_num_scheduled_tokens = sum(n for _, n in out.scheduled)
        return out

    def _chunk(self, request: Request, budget: int) -> int:
        n = min(request.num_tokens_to_compute, budget)
        threshold = self._threshold
        if threshold:
            n = min(n, threshold)
        if self.kv.mamba is not None:  # a hybrid model's chunk ends where a state can be kept
            config = self.config
            budget_cap = config.long_prefill_token_threshold or config.max_num_batched_tokens
            n = aligned_chunk(start=request.num_computed_tokens, num_new_tokens=n,
                              num_prompt_tokens=request.num_prompt_tokens, num_tokens=request.num_tokens,
                              block_size=self.kv.block_size,
                              max_prefill_tokens=min(config.max_num_batched_tokens, budget_cap),
                              shared_prefix_boundary=request.shared_prefix_boundary)
        return n

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        append_slot = self.kv.append_slot
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            computed = request.num_computed_tokens
            if (computed + 1 == request.num_prompt_tokens + request.num_output_tokens  # decode: one token, room
                    and append_slot(request.request_id, computed + 1, request.block_hashes,
                                    num_prompt_tokens=request.num_prompt_tokens,
                                    shared_prefix_boundary=request.shared_prefix_boundary)):
                out.scheduled.append((request, 1))
                out.num_computed_before.append(computed)
                budget -= 1
                i += 1
                continue
            n = self._chunk(request, budget)
            if n <= 0:
                i += 1
                continue
            if self._allocate(request, n, (), True, i, out):
                out.scheduled.append((request, n))
                out.num_computed_before.append(request.num_computed_tokens)
                budget -= n
                i += 1
            elif request.status is not RequestStatus.PREEMPTED:
                i += 1  # no way out this step and not preempted: skip it (cannot happen under `vllm`)
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        caching, bound = self.config.enable_prefix_caching, self.config.max_host_blocks_held
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if self.running and self.waiting_head_blocked(budget):
                break
            hits: list[int] = []
            num_computed = 0
            if caching:
                hits, num_computed, request.shared_prefix_boundary = self.kv.find_prefix(request.block_hashes,
                                                                                         request.num_tokens)
            if bound is not None and self.host_admission is not None:
                evicted = out.num_evicted_blocks
                kept = self.host_admission.admit(request, hits, self.running, bound, out)
                self.num_evicted_blocks += out.num_evicted_blocks - evicted
                if kept is None:
                    self._blocked = BlockedAdmission(request, self.kv.pool.free_version, budget)
                    self.num_host_bound_waits += 1
                    break  # FCFS: wait for running requests to release host KV
                if kept is not hits:  # host hits moved to device blocks, or dropped to be recomputed
                    hits, num_computed = kept, len(kept) * self.kv.block_size
            request.num_computed_tokens = num_computed
            self.policy.admitting(request, self.now_s, self.expert_line)
            n = self._chunk(request, budget)
            if n == 0 or not self.kv.hits_ready(hits):  # (hybrid) no aligned chunk fits, or its state is unwritten
                request.num_computed_tokens = 0
                break
            if not (self._full_sequence_fits(request, hits, out)
                    and self._allocate(request, n, hits, False, len(self.running), out)):
                request.num_computed_tokens = 0
                if self.running:
                    self._blocked = BlockedAdmission(request, self.kv.pool.free_version, budget,
                                                     self.policy.refusal_holds_until(self.now_s))
                    break  # FCFS: wait for running requests to release memory
                self._fail(request, out)  # nothing holds memory and it still does not fit: it never will
                continue
            self.waiting.popleft()
            if request.num_cached_prompt_tokens is None:
                request.num_cached_prompt_tokens = min(num_computed, request.num_prompt_tokens)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append((request, n))
            out.num_computed_before.append(num_computed)
            budget -= n

    def _full_sequence_fits(self, request: Request, hits: list[int], out: SchedulerOutput) -> bool:
        """vLLM's ``full_sequence_must_fit`` admission gate (``scheduler_reserve_full_isl``): every block the
        request's known tokens need beyond its hits must be free, counting cached-free blocks other than its hits
        as free (they would be evicted as the chunks come). Nothing is evicted here; only when even that is short
        is the policy asked, with the shortfall in uncached blocks as ``_allocate`` asks it (``vllm`` then has no
        way out and the request waits; ``vamp`` may move the line)."""
        if not self.config.scheduler_reserve_full_isl:
            return True
        kv, pool = self.kv, self.kv.pool
        protected = kv.protected(hits)
        while True:
            computed = request.num_computed_tokens
            short = kv.num_blocks_short(request.request_id, request.num_tokens - computed, computed, len(hits))
            if short == 0 or short <= pool.num_cached_free_blocks - pool.num_free_among(protected):
                return True
            view = PressureView(short, request, False, [], pool, protected, self.now_s, self.expert_line,
                                self.running, whole_sequence=True)
            actions = self.policy.relieve(view)
            if not actions or not self._apply(actions, hits, out, request, []):
                return False

    def allocate_last_running(self, request: Request, n: int) -> bool:
        """Allocate ``n`` new tokens for the last running request, asking the policy as a step would but
        offering no request for preemption (``core.runs``' prefill runs); evictions count in
        ``num_evicted_blocks``, the step record is discarded."""
        return self._allocate(request, n, [], True, len(self.running) - 1, SchedulerOutput())

    def _allocate(
        self, request: Request, n: int, hits: list[int], is_running: bool, index: int, out: SchedulerOutput
    ) -> bool:
        """Allocate for ``n`` new tokens, asking the policy until it succeeds or the policy gives up."""
        kv = self.kv
        while True:
            new = kv.allocate_slots(
                request.request_id, n, request.block_hashes,
                num_computed_tokens=request.num_computed_tokens, new_computed_blocks=hits,
                num_prompt_tokens=request.num_prompt_tokens, shared_prefix_boundary=request.shared_prefix_boundary,
            )
            if new is not None:
                return True
            shortfall = kv.num_blocks_short(request.request_id, n, request.num_computed_tokens, len(hits))
            # only running requests not yet scheduled in this step, and only for a running requester (FCFS)
            preemptible = self.running[index + 1 :] if is_running else []
            view = PressureView(shortfall, request, is_running, preemptible, kv.pool, kv.protected(hits),
                                self.now_s, self.expert_line, self.running)
            actions = self.policy.relieve(view)
            if not actions or not self._apply(actions, hits, out, request, preemptible):
                return False
            if is_running and request.status is RequestStatus.PREEMPTED:
                return False  # the policy preempted the requester itself

    def _apply(self, actions: list, hits: list[int], out: SchedulerOutput, requester: Request,
               preemptible: list[Request]) -> bool:
        """Carry out a plan; False if it freed nothing (so the caller stops asking)."""
        free_before = self.kv.pool.num_uncached_free_blocks
        preempted_any = False
        for action in actions:
            if isinstance(action, EvictPrefix):
                evicted = self.kv.pool.evict(action.num_blocks, protect=self.kv.protected(hits))
                out.num_evicted_blocks += len(evicted)
                self.num_evicted_blocks += len(evicted)
            elif isinstance(action, Preempt):
                victim = self._running_by_id(action.request_id)
                if victim is not requester and victim not in preemptible:
                    raise RuntimeError(f"policy {self.policy.name!r} preempted {action.request_id!r}, which the "
                                       f"view did not offer")
                self._preempt(victim, out)
                preempted_any = True
            elif isinstance(action, OffloadExperts):
                if self.expert_line is None:
                    raise RuntimeError(f"policy {self.policy.name!r} offloaded experts but no expert line is set")
                self.expert_line.offload(action.region)
                out.offloaded.extend(action.region)
            else:
                raise TypeError(f"unknown pressure action {action!r}")
        return preempted_any or self.kv.pool.num_uncached_free_blocks > free_before

    def _running_by_id(self, request_id: str) -> Request:
        for request in self.running:
            if request.request_id == request_id:
                return request
        raise KeyError(f"policy asked to preempt {request_id!r}, which is not running")

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.kv.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted.append(request)

    # ---- consume a step's result --------------------------------------------------------------------------
    def update(
        self, out: SchedulerOutput, sampled: Mapping[str, int] | None = None, now_s: float | None = None
    ) -> tuple[list[Request], list[Request]]:
        """Advance computed tokens; requests that caught up emit a token (``sampled`` gives its id in the engine;
        replay passes None). Returns (requests that emitted a token, requests that finished)."""
        if now_s is not None:
            self.now_s = now_s
        sampled = sampled or {}
        emitted: list[Request] = []
        finished: list[Request] = []
        for (request, n), start in zip(out.scheduled, out.num_computed_before):
            if request.status is not RequestStatus.RUNNING:
                continue
            end = start + n
            request.computed_to(start, end)
            if end == request.num_tokens:
                request.append_output(sampled.get(request.request_id))
                emitted.append(request)
                if request.is_done:
                    self._finish(request)
                    finished.append(request)
        return emitted, finished

    def _finish(self, request: Request) -> None:
        request.status = RequestStatus.FINISHED
        self.running.remove(request)
        self.kv.free(request.request_id)

    def _fail(self, request: Request, out: SchedulerOutput) -> None:
        """Drop the head waiting request: with nothing running and every cached block evictable, it still did
        not fit, so the KV budget is smaller than the request. Counted as a failed request in the metrics."""
        self.waiting.popleft()
        self.kv.free(request.request_id)
        request.status = RequestStatus.FINISHED
        out.failed.append(request)
