"""Runs of predictable steps that replay may execute without the per-request, per-step scheduling work.

``max_decode_run`` certifies runs of steps in which every running request decodes, and ``advance_decode`` applies
them. The rest of this module covers the other common shape of a loaded agent workload: one request prefilling a
long prompt in full chunks, behind running requests that each decode one token. Such a step is fixed by a handful of numbers, so replay executes k of them
with O(1) work per step for the decoders and applies their k tokens at the end (``finish``), as
``advance_decode`` does.

A *prefill run* of k steps is certified (``prefill_run``) when, for each of the next k steps, ``schedule()`` and
``update()`` would certainly do exactly this:

* the running list is D decoders followed by one prefilling request P (the newest, last in FCFS order); each
  decoder is scheduled for one token in blocks it already holds and does not finish;
* P is scheduled for ``budget - D`` tokens, a full chunk that does not reach the end of its prompt, so it emits
  nothing and the token budget is spent: no waiting request is considered;
* P's blocks are found as the ``vllm`` policy finds them (``evicts_when_it_can``): from uncached free blocks, else
  by evicting that many cached-free blocks in LRU order. ``step`` asks the scheduler's own allocation (and so the
  policy) for them, and returns False, changing nothing, when eviction could not cover the step (the policy would
  preempt): the run ends before that step and replay takes it the ordinary way.

Why deferring the decoders is exact: a decoder holds every block of its chain, so P's evictions (cached-free
blocks and their registered descendants) can never reach a decoder's blocks, and registering a decoder's newly
full blocks at the end instead of step by step leaves the same books. ``tests/test_sim_replay.py`` checks replay
with and without runs metric for metric.
"""

from __future__ import annotations

from dataclasses import dataclass

from moetide.core.request import Request
from moetide.core.scheduler import Scheduler


def max_decode_run(sched: Scheduler) -> int:
    """How many next steps are certain to be plain decode steps of exactly the running requests, each
    emitting one token, with no allocation, admission, finish or preemption. 0 when not certain.

    Replay uses it to skip the per-step bookkeeping while nothing can change; ``advance_decode(sched, k)`` then
    leaves every request exactly as k calls of schedule()/update() would (checked by a test)."""
    running = sched.running
    if not running or len(running) > sched.config.max_num_batched_tokens:
        return 0
    if sched.policy.reads_every_step:
        return 0  # the policy keeps per-step state (vamp-reclaim's clock): step normally
    if sched.waiting and len(running) < sched.config.max_num_seqs:
        if not sched.waiting_head_blocked(sched.config.max_num_batched_tokens - len(running)):
            return 0  # the head might be admitted: step normally
    block_size, mamba = sched.kv.block_size, sched.kv.mamba
    k = None
    for request in running:
        if request.num_computed_tokens + 1 != request.num_tokens:
            return 0  # still prefilling
        if mamba is not None and mamba.num_stale(request.request_id, request.num_computed_tokens):
            return 0  # the next step releases an old state block: step normally
        room = sched.kv.num_held_blocks(request.request_id) * block_size - request.num_computed_tokens
        left = request.max_output_tokens - request.num_output_tokens - 1  # the finishing step runs normally
        limit = room if room < left else left
        if k is None or limit < k:
            k = limit
    return max(k or 0, 0)

def advance_decode(sched: Scheduler, num_steps: int, requests: list[Request] | None = None) -> None:
    """Apply ``num_steps`` decode steps (as certified by ``max_decode_run``, or ``core.runs`` for the decoders
    of a prefill run) to ``requests``, every running request by default."""
    kv = sched.kv
    for request in sched.running if requests is None else requests:
        request.append_outputs(num_steps)
        request.computed_to(request.num_computed_tokens, request.num_computed_tokens + num_steps)
        kv.allocate_slots(request.request_id, 0, request.block_hashes,
                          num_computed_tokens=request.num_computed_tokens,
                          num_prompt_tokens=request.num_prompt_tokens,
                          shared_prefix_boundary=request.shared_prefix_boundary)


@dataclass
class PrefillRun:
    prefiller: Request
    decoders: list[Request]
    chunk: int  # P's tokens per step
    max_steps: int


def prefill_run(sched: Scheduler) -> PrefillRun | None:
    """The prefill run that starts now (module docstring), or None when the next steps are not certain."""
    running, config = sched.running, sched.config
    if len(running) < 2 or config.long_prefill_token_threshold or not sched.policy.evicts_when_it_can:
        return None
    if sched.kv.mamba is not None:  # chunks cut at state boundaries, states freed as they go: step normally
        return None
    prefiller, decoders = running[-1], running[:-1]
    chunk = config.max_num_batched_tokens - len(decoders)
    remaining = prefiller.num_tokens - prefiller.num_computed_tokens
    if chunk <= 0 or prefiller.num_computed_tokens + 1 >= prefiller.num_tokens:
        return None
    k = (remaining - 1) // chunk  # steps whose chunk is full and stops short of the prompt's end
    if k < 2:  # the decoders can only lower k
        return None
    block_size = sched.kv.block_size
    for request in decoders:
        if request.num_computed_tokens + 1 != request.num_tokens:
            return None
        room = sched.kv.num_held_blocks(request.request_id) * block_size - request.num_computed_tokens
        left = request.max_output_tokens - request.num_output_tokens - 1
        k = min(k, room, left)
    return PrefillRun(prefiller, decoders, chunk, k) if k >= 2 else None


def step(sched: Scheduler, run: PrefillRun) -> bool:
    """Allocate P's next chunk through the scheduler's own allocation (the policy evicts what is short); False
    (nothing changed) if eviction could not cover it, where the policy would preempt."""
    kv, request = sched.kv, run.prefiller
    if kv.num_blocks_short(request.request_id, run.chunk, request.num_computed_tokens) > kv.pool.num_cached_free_blocks:
        return False
    if not sched.allocate_last_running(request, run.chunk):
        raise RuntimeError(f"prefill run: allocation for {request.request_id!r} failed after eviction")
    request.computed_to(request.num_computed_tokens, request.num_computed_tokens + run.chunk)
    return True


def finish(sched: Scheduler, run: PrefillRun, num_steps: int) -> None:
    """Give each decoder the ``num_steps`` tokens of the run."""
    advance_decode(sched, num_steps, run.decoders)
