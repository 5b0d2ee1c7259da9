"""The engine: real tensors executing ``core.scheduler``'s plans, step by step.

One rule (DESIGN.md): the engine makes no memory or scheduling decision. ``core`` decides everything — which
requests run, how many tokens each brings (continuous batching, chunked prefill), which cached prefix is hit or
evicted, whom to preempt, which expert region becomes KV — and the engine carries it out:

    schedule() -> StepBatch + block tables -> model forward (paged attention, block-backed linear state,
    staged experts) -> sample -> update()

Built once per ``Engine``: the arena (``core.arena``: every routed expert in its home pages, then the KV pages of
the budget) and its storage tensor (``engine.storage``), a ``BlockPool`` over exactly the arena's KV block ids,
the ``KVCacheManager`` (with per-request state blocks for hybrid models, ``engine.state``), the
``ExpertResidency`` and the ``Scheduler`` with the named pressure policy and the engine's ``ArenaExpertLine``.
Static offload (``static_offload=True``, or a policy whose ``offload_at_start`` says so, as ``static-offload``'s
does) offloads ``max_offload_ratio`` of the routed-expert bytes at start (``core.pressure.start_offload``)
through the same expert line a policy's ``OffloadExperts`` action uses.

Hybrid models (Qwen3-Next): prefix caching is off and a preempted request recomputes from token 0, because a
linear-attention state cannot be rebuilt from a cached attention prefix (``engine.state``).

Sampling: greedy (argmax) unless a temperature is given; then softmax(logits / T) sampled with one
``torch.Generator`` per request, seeded from the engine seed and the request's index in the call, so a sampled
continuation does not depend on batching, budget or preemption (a preempted request keeps its emitted tokens and
only recomputes their KV).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moetide.core.pressure import PressurePolicy
from moetide.core.request import Request
from moetide.core.scheduler import SchedulerOutput
from moetide.engine.build import EngineConfig, EngineParts, build_engine
from moetide.engine.models import StepBatch, StepContext
from moetide.engine.split_backend import SplitAttentionBackend
from moetide.engine.split_plan import SplitCostSource, SplitCounters
from moetide.engine.vamp import EngineCosts
from moetide.errors import UserError


@dataclass(frozen=True)
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str  # "length", "stop" (an eos token), or "failed" (can never fit the KV budget)


@dataclass
class EngineStats:
    """Counters of one ``generate`` call (``experts_offloaded``, ``kv_blocks``: levels at its end)."""

    steps: int = 0
    prefix_evictions: int = 0  # cached-free blocks evicted
    preemptions: int = 0
    experts_offloaded: int = 0
    expert_reclaims: int = 0  # regions given back to their experts (vamp-reclaim)
    experts_staged: int = 0  # offloaded experts copied into a staging buffer (one per layer that routed to them)
    experts_on_host: int = 0  # offloaded experts computed from their host copies instead (``cold_experts="cpu"``)
    offloaded_ratio: float = 0.0
    kv_blocks: int = 0
    prefix_hit_tokens: int = 0  # tokens found in the prefix cache when a request was (re)admitted
    recomputed_tokens: int = 0  # tokens computed again after a preemption
    failed_requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_tokens: int = 0  # tokens of steps that were not pure decode
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    wall_s: float = 0.0
    kv_host_blocks: int = 0  # host KV capacity in blocks (0: no host KV); ``kv_blocks`` counts them too
    split_policy: str | None = None  # with host KV: the split policy
    host_bound_waits: int = 0  # admissions deferred by the host KV bound (``kv_host_active_bytes``)
    host_blocks_promoted: int = 0  # host prefix hits past that bound copied to device blocks
    host_hits_recomputed: int = 0  # host prefix hits past that bound that could not be copied: recomputed
    split: dict = field(default_factory=dict)  # with host KV: ``SplitCounters`` of this call


@dataclass
class GenerateResult:
    outputs: list[RequestOutput]
    stats: EngineStats = field(default_factory=EngineStats)


class Sampler:
    """Greedy, or temperature sampling with a generator per request (see the module docstring)."""

    def __init__(self, temperature: float | None, seed: int) -> None:
        if temperature is not None and not temperature >= 0:
            raise UserError(f"temperature must be >= 0, got {temperature}")
        self.temperature = temperature or None
        self.seed = seed
        self._generators: dict[str, torch.Generator] = {}

    def sample(self, logits: torch.Tensor, request_ids: Sequence[str], indices: Sequence[int]) -> list[int]:
        """logits [n, V] (rows of the listed requests) -> one token id per row."""
        if self.temperature is None:
            return logits.argmax(dim=-1).tolist()
        probs = torch.softmax(logits.float().cpu() / self.temperature, dim=-1)
        tokens = []
        for row, request_id, index in zip(probs, request_ids, indices):
            generator = self._generators.get(request_id)
            if generator is None:
                generator = self._generators[request_id] = torch.Generator().manual_seed(
                    self.seed * 1_000_003 + index)
            tokens.append(int(torch.multinomial(row, 1, generator=generator)))
        return tokens


class Engine:
    """An MoE model served under a KV budget; ``generate`` runs prompts to completion. Keyword options are
    ``EngineConfig``'s fields; ``policy`` is a registered policy name or a ``PressurePolicy`` instance; ``clock``
    (seconds, read once per step) is the scheduler's time — unless given, the modeled seconds of the steps run
    under ``vamp`` (``engine.vamp``: decisions then follow the input, not the machine's load) and wall time since
    the engine was built otherwise. ``costs`` is what ``vamp`` prices with (``Engine.costs`` of an earlier run,
    or a dict of its fields); measured at build when not given."""

    def __init__(self, model_dir: str | Path, *, kv_budget_mib: float | None = None,
                 kv_host_mib: float | None = None, kv_host_active_mib: float | None = None,
                 policy: str | PressurePolicy = "vllm",
                 policy_params: Mapping[str, object] | None = None, split_costs: SplitCostSource | None = None,
                 clock: Callable[[], float] | None = None, costs: EngineCosts | Mapping[str, float] | None = None,
                 **options: object) -> None:
        if kv_budget_mib is not None:
            options["kv_budget_bytes"] = int(kv_budget_mib * 1024 * 1024)
        if kv_host_mib is not None:
            options["kv_host_bytes"] = int(kv_host_mib * 1024 * 1024)
        if kv_host_active_mib is not None:
            options["kv_host_active_bytes"] = int(kv_host_active_mib * 1024 * 1024)
        if "kv_budget_bytes" not in options:
            raise UserError("an engine needs a KV budget: kv_budget_bytes or kv_budget_mib")
        try:
            config = EngineConfig(**options)  # type: ignore[arg-type]
        except (TypeError, ValueError) as exc:
            raise UserError(str(exc)) from None
        self.config = config
        if costs is not None and not isinstance(costs, EngineCosts):
            try:
                costs = EngineCosts(**costs)
            except (TypeError, ValueError) as exc:
                raise UserError(f"costs: {exc}") from None
        self.parts: EngineParts = build_engine(Path(model_dir), config, policy, dict(policy_params or {}),
                                               split_costs, costs)
        self._next_request = 0
        self._step_stats = self.parts.step_stats
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

    # ---- the loop -----------------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int, temperature: float | None = None,
                 seed: int = 0) -> GenerateResult:
        if max_tokens < 1:
            raise UserError(f"max_tokens must be >= 1, got {max_tokens}")
        vocab = self.parts.model.config.vocab_size
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise UserError(f"prompt {i} is empty")
            if not all(0 <= t < vocab for t in prompt):
                raise UserError(f"prompt {i} has a token id outside the vocabulary [0, {vocab})")
        requests = [self._add_request(prompt, max_tokens) for prompt in prompts]
        sampler = Sampler(temperature, seed)
        index_of = {r.request_id: i for i, r in enumerate(requests)}
        stats, failed = EngineStats(), set()
        counts0 = self._lifetime_counts()
        provider = self.parts.experts
        staged0, on_host0 = provider.stager.num_staged, provider.num_host_computed
        if isinstance(self.parts.attention, SplitAttentionBackend):
            self.parts.attention.counters = SplitCounters()
        start = time.perf_counter()
        while self.scheduler.has_work:
            failed.update(self._step(sampler, index_of, stats))
        stats.wall_s = time.perf_counter() - start
        self._finish_stats(stats, requests, failed, counts0)
        stats.experts_staged = provider.stager.num_staged - staged0
        stats.experts_on_host = provider.num_host_computed - on_host0
        return GenerateResult([self._output(r, r.request_id in failed) for r in requests], stats)

    def _add_request(self, prompt: Sequence[int], max_tokens: int) -> Request:
        request_id = str(self._next_request)
        self._next_request += 1
        request = Request.from_tokens(request_id, prompt, max_tokens, self.config.block_size,
                                      eos_token_ids=self.parts.eos_token_ids)
        self.scheduler.add_request(request)
        return request

    def _step(self, sampler: Sampler, index_of: dict[str, int], stats: EngineStats) -> list[str]:
        """One scheduler step; returns the ids of requests that failed (can never fit)."""
        sched = self.scheduler
        running_before = {id(r) for r in sched.running}
        out = sched.schedule(self._clock())
        if out.promoted:
            self._copy_promoted(out.promoted)
        failed = [r.request_id for r in out.failed]
        if out.is_empty:
            if not (failed or out.preempted) and sched.has_work:
                raise RuntimeError("the scheduler planned an empty step with work pending and nothing failed")
            return failed
        for (request, _), computed in zip(out.scheduled, out.num_computed_before):
            if id(request) not in running_before:
                stats.prefix_hit_tokens += computed
        t0 = time.perf_counter()
        with torch.inference_mode():  # no autograd bookkeeping: cheaper small ops
            logits = self._forward(out)
            sampled = self._sample(out, logits, sampler, index_of)
        sched.update(out, sampled)
        self.parts.attention.end_step()
        self.parts.experts.end_step()
        self.residency.end_step()
        seconds = time.perf_counter() - t0
        decode = self._time_step(out, seconds, stats)
        if self._step_stats is not None:
            self._step_stats.record(out.total_num_scheduled_tokens)
        return failed

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

    @staticmethod
    def _sample(out: SchedulerOutput, logits: torch.Tensor, sampler: Sampler,
                index_of: dict[str, int]) -> dict[str, int]:
        """Sample for the requests whose computed tokens reach their known tokens (the rest were prefill chunks)."""
        rows = [i for i, ((request, n), computed) in enumerate(zip(out.scheduled, out.num_computed_before))
                if computed + n == request.num_tokens]
        if not rows:
            return {}
        ids = [out.scheduled[i][0].request_id for i in rows]
        logits = logits if len(rows) == logits.shape[0] else logits[rows]
        tokens = sampler.sample(logits, ids, [index_of.get(rid, 0) for rid in ids])
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
