"""Discrete-event replay of a workload through the shared scheduler, with modeled step times.

One accelerator (or one tensor-parallel group) runs steps back to back while there is work. Events are request
sends, ordered by (time, priority, sequence number) — the sequence number is per instance, so two replays in one
process never share state, and equal times break ties in trace order. Requests that arrive while a step runs join
at the next step, as in a real engine.

Open loop: every turn is sent at its recorded ``arrival_s``. Closed loop: a session's first turn is sent at its
start; each later turn ``think_time_s`` after the previous turn completed (or failed). A failed turn does not end
its session: the recording went on, so the replay does too.

Prompts are described by trace block keys; ``core.hashing.external_block_hashes`` maps them onto the pool's block
size. A session's next turn usually extends its previous prompt, so the pool-block hashes of the shared key prefix
are reused instead of recomputed — agent contexts run to hundreds of thousands of tokens.
"""

from __future__ import annotations

import heapq
import math
from itertools import repeat
from collections.abc import Callable
from dataclasses import dataclass

from moetide.core import runs
from moetide.core.hashing import external_block_hashes, scope_hash
from moetide.core.request import Request
from moetide.core.scheduler import Scheduler
from moetide.sim.host_kv import HostKV
from moetide.sim.metrics import MetricsCollector
from moetide.workloads.base import BlockKeys, Session, Workload

StepTimeFn = Callable[[int, int, int, int, int], float]  # (tokens, seqs, decode seqs, kv tokens read, pairs) -> s
SEND = 0  # event priority (only one kind of event today; steps are not events but the loop's body)


@dataclass
class _Context:
    """Replay state of one session: where it is, and its last prompt's keys and pool-block hashes."""

    session: Session
    scope: int
    next_turn: int = 0
    prev_keys: BlockKeys | None = None
    prev_hashes: list[int] | None = None


class Replay:
    def __init__(
        self,
        workload: Workload,
        scheduler: Scheduler,
        step_time_s: StepTimeFn,
        *,
        progress: Callable[[int, int], None] | None = None,
        fast_forward: bool = True,
        offloaded_ratio: Callable[[], float] = lambda: 0.0,
        host_kv: HostKV | None = None,
        request_overhead_s: Callable[[int], float] | None = None,
    ) -> None:
        self.workload = workload
        self.scheduler = scheduler
        self.step_time_s = step_time_s
        self.block_size = scheduler.kv.block_size
        self.progress = progress
        self.fast_forward = fast_forward  # runs of identical decode steps without per-step scheduling (exact)
        self.offloaded_ratio = offloaded_ratio
        self.host_kv = host_kv  # a host KV tier: each step's split is charged (sim.host_kv)
        # device seconds an arriving request costs besides its steps (a server on the engine's core), by prompt
        # tokens; charged at its send, so the step in flight, or the first one after an idle wait, runs that much later
        self.request_overhead_s = request_overhead_s
        self.metrics = MetricsCollector()
        self.now_s = 0.0
        self._events: list[tuple[float, int, int, _Context]] = []
        self._seq = 0
        self._salt = 0
        self._contexts: dict[str, _Context] = {}
        self._num_requests = workload.num_requests
        self._num_done = 0

    def _push(self, time_s: float, ctx: _Context) -> None:
        self._seq += 1
        heapq.heappush(self._events, (time_s, SEND, self._seq, ctx))

    def run(self) -> MetricsCollector:
        for session in self.workload.sessions:
            ctx = _Context(session, scope_hash(session.key_scope) if session.key_scope else 0)
            self._contexts[session.session_id] = ctx
            first = session.turns[0]
            self._push(first.arrival_s if first.arrival_s is not None else session.start_s, ctx)
        sched, events, metrics = self.scheduler, self._events, self.metrics
        while events or sched.has_work:
            if not sched.has_work:
                self.now_s = max(self.now_s, events[0][0])
            while events and events[0][0] <= self.now_s:
                send_s, _, _, ctx = heapq.heappop(events)
                self._send(ctx, send_s)
            if self.fast_forward and (self._decode_run() or (self.host_kv is None and self._prefill_run())):
                continue
            out = sched.schedule(self.now_s)
            for request in out.failed:
                metrics.failed_request(request, self.now_s)
                self._turn_done(request)
            if out.is_empty:
                if out.promoted:  # an admission that moved host hits, then failed to allocate: the copy still runs
                    self.now_s += self.host_kv.promote_s(len(out.promoted))  # type: ignore[union-attr]
                if events:
                    self.now_s = max(self.now_s, events[0][0])
                elif sched.has_work and not (out.preempted or out.failed):  # a step that only preempted is progress
                    raise RuntimeError(f"replay stalled at t={self.now_s:.3f}s: work left but nothing schedulable")
                continue
            self._execute(out)
        metrics.preemptions = sched.num_preemptions
        metrics.evicted_blocks = sched.num_evicted_blocks
        return metrics

    def _execute(self, out) -> None:
        scheduled = list(zip(out.scheduled, out.num_computed_before))
        added, host_tokens = 0.0, repeat(0)
        if self.host_kv is not None:
            seqs = self.host_kv.seqs(self.scheduler.kv, [(r.request_id, start + n) for (r, n), start in scheduled])
            added, _ = self.host_kv.charge(seqs, max(1, out.total_num_scheduled_tokens // len(seqs)))
            host_tokens = [s.host_tokens for s in seqs]
            if out.promoted:  # host hits copied to device blocks before the step (core.scheduler, _promote)
                added += self.host_kv.promote_s(len(out.promoted))
        # the roofline step attends the device-resident KV only: each query against the host tokens is charged in
        # ``added`` (a chunk whose own tokens went to host blocks is counted as if they preceded it)
        num_decode = kv_read = pairs = 0
        for ((_, n), start), host in zip(scheduled, host_tokens):
            num_decode += n == 1
            kv_read += start + n - host
            pairs += max(0, n * start + n * (n + 1) // 2 - n * host)
        duration = self.step_time_s(out.total_num_scheduled_tokens, len(out.scheduled), num_decode, kv_read,
                                    pairs) + added
        self.now_s += duration
        emitted, finished = self.scheduler.update(out, None, self.now_s)
        self.metrics.tokens(emitted, self.now_s)
        for request in finished:
            self.metrics.finished(request, self.now_s)
            self._turn_done(request)
        pool = self.scheduler.kv.pool
        self.metrics.step(self.now_s, duration, pool.num_used_blocks / max(pool.num_blocks, 1), self.offloaded_ratio(),
                          self.scheduler.num_preemptions)

    def _decode_run(self) -> int:
        """Run the decode steps the scheduler certifies as identical, up to the next send; same times and
        tokens as stepping one by one, without the per-step scheduling work."""
        sched = self.scheduler
        k_max = runs.max_decode_run(sched)
        if k_max < 2:
            return 0
        running = sched.running
        num_seqs = len(running)
        kv_read = sum(r.num_computed_tokens for r in running) + num_seqs
        events, metrics, step_time_s = self._events, self.metrics, self.step_time_s
        pool = sched.kv.pool
        used_share = pool.num_used_blocks / max(pool.num_blocks, 1)
        offloaded, preemptions = self.offloaded_ratio(), self.scheduler.num_preemptions
        host_kv, bs = self.host_kv, sched.kv.block_size
        seqs = [] if host_kv is None else host_kv.seqs(sched.kv, [(r.request_id, r.num_computed_tokens + 1)
                                                                 for r in running])
        # a waiting head the policy refused is asked again once its refusal stops holding (vamp's next review)
        until = sched.blocked_until_s if sched.waiting and num_seqs < sched.config.max_num_seqs else math.inf
        k = 0
        ends: list[float] = []
        while k < k_max and not (events and events[0][0] <= self.now_s) and self.now_s < until:
            if seqs:  # the split and the device-resident KV change as the sequences grow (no block is allocated)
                if k:  # the step before wrote one token each
                    for s in seqs:
                        s.grow(bs)
                added, host_tokens = host_kv.charge(seqs, 1)
                device = kv_read - host_tokens
                duration = step_time_s(num_seqs, num_seqs, num_seqs, device, device) + added
            else:
                duration = step_time_s(num_seqs, num_seqs, num_seqs, kv_read, kv_read)
            self.now_s += duration
            ends.append(self.now_s)
            metrics.step(self.now_s, duration, used_share, offloaded, preemptions)
            kv_read += num_seqs
            k += 1
        metrics.decode_run(running, ends)
        runs.advance_decode(sched, k)
        return k

    def _prefill_run(self) -> int:
        """Run the steps ``core.runs`` certifies as one long prefill beside decodes, up to the next send; same
        times, tokens and books as stepping one by one."""
        sched = self.scheduler
        run = runs.prefill_run(sched)
        if run is None:
            return 0
        decoders, chunk, prefiller = run.decoders, run.chunk, run.prefiller
        num_decode = len(decoders)
        num_tokens = num_decode + chunk
        kv_read = sum(r.num_computed_tokens for r in decoders) + num_decode
        events, metrics, step_time_s = self._events, self.metrics, self.step_time_s
        offloaded, preemptions = self.offloaded_ratio(), self.scheduler.num_preemptions
        pool = sched.kv.pool
        k = 0
        ends: list[float] = []
        while k < run.max_steps and not (events and events[0][0] <= self.now_s):
            start = prefiller.num_computed_tokens
            if not runs.step(sched, run):
                break
            duration = step_time_s(num_tokens, num_decode + 1, num_decode, kv_read + start + chunk,
                                   kv_read + chunk * start + chunk * (chunk + 1) // 2)
            self.now_s += duration
            ends.append(self.now_s)
            metrics.step(self.now_s, duration, pool.num_used_blocks / max(pool.num_blocks, 1), offloaded, preemptions)
            kv_read += num_decode
            k += 1
        metrics.decode_run(decoders, ends)
        runs.finish(sched, run, k)
        return k

    def _send(self, ctx: _Context, send_s: float) -> None:
        """Hand the next turn to the scheduler. Its clock starts at its send time even when the engine only sees
        it at the end of the step during which it was sent (TTFT as a client measures it)."""
        turn = ctx.session.turns[ctx.next_turn]
        keys = turn.block_keys
        reuse: list[int] = []
        if ctx.prev_keys is not None and self.workload.key_block_size:
            shared_tokens = ctx.prev_keys.common_prefix_len(keys) * self.workload.key_block_size
            reuse = ctx.prev_hashes[: shared_tokens // self.block_size]
        self._salt += 1
        hashes = external_block_hashes(
            keys, self.workload.key_block_size or 1, self.block_size, turn.prompt_tokens,
            scope=ctx.scope, salt=self._salt, reuse=reuse,
        )
        ctx.prev_keys, ctx.prev_hashes = keys, hashes
        request = Request(
            turn.request_id, num_prompt_tokens=turn.prompt_tokens, max_output_tokens=max(turn.output_tokens, 1),
            block_size=self.block_size, block_hashes=list(hashes), session_id=ctx.session.session_id,
            arrival_s=send_s, salt=self._salt,
        )
        self.metrics.arrived(send_s)
        if self.request_overhead_s is not None:
            self.now_s += self.request_overhead_s(turn.prompt_tokens)
        self.scheduler.add_request(request, self.now_s)

    def _turn_done(self, request: Request) -> None:
        self._num_done += 1
        if self.progress is not None:
            self.progress(self._num_done, self._num_requests)
        ctx = self._contexts[request.session_id]
        ctx.next_turn += 1
        if ctx.next_turn >= len(ctx.session.turns):
            del self._contexts[request.session_id]
            return
        turn = ctx.session.turns[ctx.next_turn]
        if turn.arrival_s is not None:  # open loop: recorded send time, however the previous turn went
            self._push(max(turn.arrival_s, self.now_s), ctx)
        else:
            self._push(self.now_s + turn.think_time_s, ctx)
