"""The engine: real tensors executing ``core.scheduler``'s plans, step by step.

One rule (DESIGN.md): the engine makes no memory or scheduling decision. ``core`` decides everything — which
requests run, how many tokens each brings (continuous batching, chunked prefill), which cached prefix is hit or
evicted, whom to preempt, which expert region becomes KV — and the engine carries it out:

    schedule() -> StepBatch + block tables -> model forward (paged attention, block-backed linear state,
    staged experts) -> sample -> update()

Built once per ``Engine``: the arena (``core.arena``: every routed expert in its home pages, then the KV pages of
the budget) and its storage tensor (``engine.storage``), a ``BlockPool`` over exactly the arena's KV block ids,
the ``KVCacheManager`` (with per-request state blocks for hybrid models, ``engine.state``), the
``ExpertResidency`` and the ``Scheduler`` with the named pressure policy and the engine's ``ExpertLine``.
Static offload (``static_offload=True``, or a policy whose ``offload_at_start`` says so, as ``static-offload``'s
does) offloads ``max_offload_ratio`` of the routed-expert bytes at start (``core.pressure.start_offload``)
through the same expert line a policy's ``OffloadExperts`` action uses.

Hybrid models (Qwen3-Next) cache prefixes as vLLM 0.32's align mode does (``core.mamba_states``): a state slot per
block boundary, the boundary states kept as cached blocks, a hit resuming from the state at its end; each new slot
starts from a copy of the state before it (``_copy_states``).

Two ways in, one loop. ``add_request`` / ``step`` / ``abort_request`` / ``has_unfinished_requests`` are the
incremental API a server drives (vLLM's ``LLMEngine`` shape): requests join and leave between steps, and each
``step`` returns the tokens it emitted per request. ``generate`` is that loop run to completion over a batch.

Sampling (``SamplingParams``, vLLM's names): greedy (argmax) unless a temperature is given; then softmax(logits / T),
cut to the ``top_p`` nucleus, sampled with one ``torch.Generator`` per request seeded from the request's ``seed``
(``generate``: the call's seed and the request's index in it), so a sampled continuation does not depend on
batching, budget or preemption (a preempted request keeps its emitted tokens and only recomputes their KV).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from moetide.core.pressure import PressurePolicy
from moetide.core.request import Request
from moetide.core.step_plan import SchedulerOutput
from moetide.engine.build import EngineConfig, EngineParts, build_engine
from moetide.engine.models import StepBatch, StepContext
from moetide.engine.results import EngineMetrics, EngineStats, GenerateResult, RequestOutput, StepOutput
from moetide.engine.sampling import Sampler, SamplingParams
from moetide.engine.split_backend import SplitAttentionBackend
from moetide.engine.split_plan import SplitCostSource, SplitCounters
from moetide.core.pressure.step_costs import EngineCosts
from moetide.perf.step import StepShape
from moetide.errors import UserError


class Engine:
    """An MoE model served under a KV budget; ``generate`` runs prompts to completion. Keyword options are
    ``EngineConfig``'s fields; ``policy`` is a registered policy name or a ``PressurePolicy`` instance; ``clock``
    (seconds, read once per step) is the scheduler's time — unless given, the modeled seconds of the steps run
    under ``vamp`` (``engine.vamp``: decisions then follow the input, not the machine's load) and wall time since
    the engine was built otherwise. ``costs`` is what ``vamp`` prices with (``Engine.costs`` of an earlier run,
    or a dict of its fields); measured at build when not given."""

    def __init__(self, model_dir: str | Path, *, policy: str | PressurePolicy = "vllm",
                 policy_params: Mapping[str, object] | None = None, split_costs: SplitCostSource | None = None,
                 clock: Callable[[], float] | None = None, costs: EngineCosts | Mapping[str, float] | None = None,
                 **options: object) -> None:
        instance = None if isinstance(policy, str) else policy
        try:
            config = EngineConfig(**options, **({"policy": policy} if instance is None else {}))  # type: ignore
        except (TypeError, ValueError) as exc:
            raise UserError(str(exc)) from None
        if costs is not None and not isinstance(costs, EngineCosts):
            try:
                costs = EngineCosts(**costs)
            except (TypeError, ValueError) as exc:
                raise UserError(f"costs: {exc}") from None
        self.parts: EngineParts = build_engine(Path(model_dir), config, instance, dict(policy_params or {}),
                                               split_costs, costs)
        self.config = self.parts.config
        self._next_request = 0
        self._requests: dict[str, Request] = {}  # in flight: added, not yet finished, failed or aborted
        self._sampler = Sampler()
        self._stats = EngineStats()  # the steps' counters since the last ``generate`` began
        self.num_prefix_query_tokens = 0  # lifetime: tokens looked up in the prefix cache at (re)admission
        self.num_prefix_hit_tokens = 0  # lifetime: of those, found cached
        self._step_stats = self.parts.step_stats
        self._last_step: SchedulerOutput | None = None  # the last step that ran (``last_step_shape``)
        if clock is None and self._step_stats is not None:
            clock = self._step_stats.busy_s
        t0 = time.perf_counter()
        self._clock = clock or (lambda: time.perf_counter() - t0)

    # convenient names for the core objects
    @property
    def scheduler(self):
        return self.parts.scheduler

    @property
    def residency(self):
        return self.parts.residency

    @property
    def storage(self):
        return self.parts.storage

    @property
    def host_kv(self):
        return self.parts.host_kv

    @property
    def costs(self) -> EngineCosts | None:
        """The cost record ``vamp`` priced with (None under other policies): give it to a rerun to repeat its
        decisions."""
        steps = self._step_stats
        return None if steps is None else EngineCosts(steps.prefill_s_per_token, steps.copy_s_per_expert,
                                                      steps.expert_call_s, steps.host_s_per_expert,
                                                      steps.host_s_per_row)

    # ---- the incremental API: requests join and leave between steps ------------------------------------------
    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> str:
        """Queue a request; returns its id. The prompt's tokens must be in the vocabulary."""
        vocab = self.parts.model.config.vocab_size
        if not prompt_token_ids:
            raise UserError("the prompt is empty")
        if not all(0 <= t < vocab for t in prompt_token_ids):
            raise UserError(f"the prompt has a token id outside the vocabulary [0, {vocab})")
        request_id = str(self._next_request)
        self._next_request += 1
        eos = (frozenset() if params.ignore_eos else self.parts.eos_token_ids) | params.stop_token_ids
        request = Request.from_tokens(request_id, prompt_token_ids, params.max_tokens, self.config.block_size,
                                      eos_token_ids=eos)
        self.scheduler.add_request(request)
        self._requests[request_id] = request
        self._sampler.add(request_id, params)
        return request_id

    def abort_request(self, request_id: str) -> bool:
        """Drop a request wherever it is (waiting, preempted or running) and free its blocks
        (``Scheduler.abort_request``); False if it is not in flight. Call between steps."""
        if self._requests.get(request_id) is None or self.scheduler.abort_request(request_id) is None:
            return False
        self._forget(request_id)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work

    def num_tokens(self, request_id: str) -> int:
        """Prompt plus output tokens of a request in flight."""
        return self._requests[request_id].num_tokens

    def step(self) -> list[StepOutput]:
        """One scheduler step: the tokens it emitted per request, and the requests it ended."""
        sched, stats = self.scheduler, self._stats
        running_before = {id(r) for r in sched.running}
        out = sched.schedule(self._clock())
        if out.promoted:
            self._copy_promoted(out.promoted)
        self._copy_states()
        outputs = [StepOutput(r.request_id, [], "failed") for r in out.failed]
        for request in out.failed:
            self._forget(request.request_id)
        if out.is_empty:
            if not (out.failed or out.preempted) and sched.has_work:
                raise RuntimeError("the scheduler planned an empty step with work pending and nothing failed")
            return outputs
        for (request, _), computed in zip(out.scheduled, out.num_computed_before):
            if id(request) not in running_before:
                stats.prefix_hit_tokens += computed
                self.num_prefix_query_tokens += request.num_tokens
                self.num_prefix_hit_tokens += computed
        t0 = time.perf_counter()
        with torch.inference_mode():  # no autograd bookkeeping: cheaper small ops
            logits = self._forward(out)
            sampled = self._sample(out, logits)
        emitted, finished = sched.update(out, sampled)
        self.parts.attention.end_step()
        self.parts.experts.end_step()
        self.residency.end_step()
        self._time_step(out, time.perf_counter() - t0, stats)
        self._last_step = out
        if self._step_stats is not None:
            self._step_stats.record(out.total_num_scheduled_tokens)
        done = {id(r) for r in finished}
        for request in emitted:
            reason = None
            if id(request) in done:
                reason = "stop" if request.stopped else "length"
                self._forget(request.request_id)
            outputs.append(StepOutput(request.request_id, [request.token_ids[-1]], reason))
        return outputs

    @property
    def last_step_shape(self) -> tuple[int, int, int, int, int] | None:
        """The last step that ran as the step-time model takes it: (tokens, seqs, decode seqs, KV tokens read,
        attention pairs); ``engine.measure.measure_engine_steps`` times steps against it. Worked out when asked,
        not in every step."""
        out = self._last_step
        if out is None:
            return None
        chunks = ((computed, n) for (_, n), computed in zip(out.scheduled, out.num_computed_before))
        return StepShape.of_step(chunks).as_args()

    def _forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self._sampler.remove(request_id)

    def metrics(self) -> EngineMetrics:
        """The levels and lifetime counters a server exports (read between steps)."""
        sched, provider = self.scheduler, self.parts.experts
        pool = sched.kv.pool
        host_total = self.parts.host_kv.num_blocks if self.parts.host_kv is not None else 0
        host_used = pool.num_host_blocks_in_use  # (kv.num_host_blocks_held counts a shared block per holder)
        device_total = pool.num_blocks - host_total
        return EngineMetrics(
            num_running=len(sched.running), num_waiting=len(sched.waiting),
            kv_cache_usage=(pool.num_used_blocks - host_used) / device_total if device_total else 0.0,
            num_preemptions=sched.num_preemptions, prefix_query_tokens=self.num_prefix_query_tokens,
            prefix_hit_tokens=self.num_prefix_hit_tokens, offloaded_ratio=self.residency.offloaded_ratio,
            experts_offloaded=self.residency.num_offloaded, kv_host_blocks=host_total, kv_host_blocks_used=host_used,
            experts_staged=provider.stager.num_staged, experts_on_host=provider.num_host_computed,
            kv_blocks_held=pool.num_used_blocks)

    # ---- the batch API: the same loop, run to completion -----------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int, temperature: float | None = None,
                 seed: int = 0) -> GenerateResult:
        if max_tokens < 1:
            raise UserError(f"max_tokens must be >= 1, got {max_tokens}")
        if temperature is not None and not temperature >= 0:
            raise UserError(f"temperature must be >= 0, got {temperature}")
        ids = []
        for i, prompt in enumerate(prompts):
            try:
                ids.append(self.add_request(prompt, SamplingParams(max_tokens, temperature,
                                                                   seed=seed * 1_000_003 + i)))
            except UserError as exc:
                for request_id in ids:
                    self.abort_request(request_id)
                raise UserError(f"prompt {i}: {exc}") from None
        requests = [self._requests[request_id] for request_id in ids]
        stats, failed = EngineStats(kv_blocks_at_start=self.scheduler.kv.pool.num_blocks), set()
        self._stats = stats
        counts0 = self._lifetime_counts()
        provider = self.parts.experts
        staged0, on_host0 = provider.stager.num_staged, provider.num_host_computed
        if isinstance(self.parts.attention, SplitAttentionBackend):
            self.parts.attention.counters = SplitCounters()
        start = time.perf_counter()
        while self.has_unfinished_requests():
            failed.update(o.request_id for o in self.step() if o.finish_reason == "failed")
        stats.wall_s = time.perf_counter() - start
        self._finish_stats(stats, requests, failed, counts0)
        stats.experts_staged = provider.stager.num_staged - staged0
        stats.experts_on_host = provider.num_host_computed - on_host0
        return GenerateResult([self._output(r, r.request_id in failed) for r in requests], stats)

    def _copy_states(self) -> None:
        """Hybrid models with prefix caching: each new state slot starts from the previous slot's state (or a
        prefix hit's), copied in before the step writes it (``MambaStates.state_copies``)."""
        mamba, storage = self.scheduler.kv.mamba, self.parts.storage
        if mamba is not None:
            for src, dst in mamba.state_copies():
                storage.kv_block(dst).copy_(storage.kv_block(src))

    def _copy_promoted(self, pairs: list[tuple[int, int]]) -> None:
        """Host prefix blocks whose place in the prefix cache went to device blocks (``SchedulerOutput.promoted``):
        their bytes, in the one layout both tiers share, are copied before the step's forward reads them."""
        host, storage = self.parts.host_kv, self.parts.storage
        for src, dst in pairs:
            storage.kv_block(dst).copy_(host.block_bytes_view[src - host.first_block_id], non_blocking=True)

    def _forward(self, out: SchedulerOutput) -> torch.Tensor:
        parts, kv = self.parts, self.scheduler.kv
        tokens: list[int] = []
        entries = []
        for (request, n), computed in zip(out.scheduled, out.num_computed_before):
            tokens += request.token_ids[computed : computed + n]
            entries.append((int(request.request_id), n, computed))
        batch = StepBatch.of(entries)
        request_ids = [r.request_id for r, _ in out.scheduled]
        parts.attention.prepare(batch, [kv.get_blocks(rid) for rid in request_ids])
        if parts.linear_states is not None:
            parts.linear_states.prepare(batch, [kv.get_state_blocks(rid) for rid in request_ids])
        ctx = StepContext(batch, parts.attention, parts.linear_states, parts.experts)
        logits = parts.model(torch.tensor(tokens, device=parts.storage.device), ctx)  # [B, V]
        if parts.linear_states is not None:
            parts.linear_states.commit()
        return logits

    def _sample(self, out: SchedulerOutput, logits: torch.Tensor) -> dict[str, int]:
        """Sample for the requests whose computed tokens reach their known tokens (the rest were prefill chunks)."""
        rows = [i for i, ((request, n), computed) in enumerate(zip(out.scheduled, out.num_computed_before))
                if computed + n == request.num_tokens]
        if not rows:
            return {}
        ids = [out.scheduled[i][0].request_id for i in rows]
        logits = logits if len(rows) == logits.shape[0] else logits[rows]
        tokens = self._sampler.sample(logits, ids)
        return dict(zip(ids, tokens))

    @staticmethod
    def _time_step(out: SchedulerOutput, seconds: float, stats: EngineStats) -> bool:
        """Count the step into ``stats``; True if it was pure decode."""
        stats.steps += 1
        decode = all(n == 1 and computed >= request.num_prompt_tokens
                     for (request, n), computed in zip(out.scheduled, out.num_computed_before))
        if decode:
            stats.decode_tokens += out.total_num_scheduled_tokens
            stats.decode_s += seconds
        else:
            stats.prefill_tokens += out.total_num_scheduled_tokens
            stats.prefill_s += seconds
        return decode

    def _lifetime_counts(self) -> tuple[int, ...]:
        """The engine's lifetime counters that ``EngineStats`` reports per call (as differences)."""
        sched = self.scheduler
        return (sched.num_evicted_blocks, sched.num_preemptions, self.parts.expert_line.num_reclaims,
                sched.num_host_bound_waits, sched.num_host_hits_promoted, sched.num_host_hits_dropped)

    def _finish_stats(self, stats: EngineStats, requests: list[Request], failed: set[str],
                      counts0: tuple[int, ...]) -> None:
        evicted, preempted, reclaims, waits, promoted, dropped = (
            a - b for a, b in zip(self._lifetime_counts(), counts0))
        stats.prefix_evictions, stats.preemptions, stats.expert_reclaims = evicted, preempted, reclaims
        stats.host_bound_waits, stats.host_blocks_promoted, stats.host_hits_recomputed = waits, promoted, dropped
        stats.experts_offloaded = self.residency.num_offloaded
        stats.offloaded_ratio = self.residency.offloaded_ratio
        stats.kv_blocks = self.scheduler.kv.pool.num_blocks
        stats.recomputed_tokens = sum(r.num_recomputed_tokens for r in requests)
        stats.failed_requests = len(failed)
        stats.prompt_tokens = sum(r.num_prompt_tokens for r in requests)
        stats.generated_tokens = sum(r.num_output_tokens for r in requests)
        attention = self.parts.attention
        if isinstance(attention, SplitAttentionBackend):
            stats.kv_host_blocks = attention.host.num_blocks
            stats.split_policy = attention.stepper.name
            attention.counters.correction_factor = attention.stepper.correction_factor
            stats.split = attention.counters.as_dict()

    @staticmethod
    def _output(request: Request, failed: bool) -> RequestOutput:
        reason = "failed" if failed else "stop" if request.stopped else "length"
        return RequestOutput(list(request.token_ids[: request.num_prompt_tokens]),
                             list(request.token_ids[request.num_prompt_tokens :]), reason)
