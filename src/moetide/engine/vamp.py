"""``--policy vamp`` in the engine: the core's policy, priced from a cost record the engine measures once.

``core.pressure.vamp`` weighs re-prefill saved by more KV against staging added by offloaded experts; the replay
feeds it modeled seconds, the engine feeds it seconds from ``EngineCosts`` (``core.pressure.step_costs``),
measured at build (or given back from an earlier run's record, ``Engine(costs=...)``), never a timing taken
mid-run, so the same input and the same record make the same decisions on a quiet machine or a loaded one
(``EngineStepStats``, the policy's ``StepStats``):

* **step seconds**: each step's tokens × ``prefill_s_per_token`` (2 FLOP per active parameter per token at
  ``ASSUMED_FLOPS``), plus one ``expert_call_s`` per expert each MoE layer runs (what dominates a small model's
  step), plus the staging it held (its staged experts × the copy time, its host-computed experts at
  a + b·rows); the busy share and the engine's default clock for the policy's reviews are these seconds.
* **re-prefill per token**: a full chunk's (``max_num_batched_tokens``) compute seconds per token, as the
  replay prices it (the engine does not fit the context term the replay's perf model has, so
  ``prefill_s_per_token_per_context`` is 0 here).
* **staging share** of ``n`` offloaded experts: Σ over those experts of their touch rate per step
  (``engine.experts.TouchRates``, counted from routing: the experts offloaded now, coldest first, then those
  ``ExpertResidency`` would offload next) × the seconds one expert's copy into the staging buffer took (best of
  ``COPY_REPEATS`` at build), over the mean step time less the staging it already contains. On the CPU the
  copies are synchronous, so this is the exposed time; on CUDA they overlap the previous layer and this is an
  upper bound. With cold experts computed on the host (``cold_experts="cpu"``), a touch of at most
  ``host_max_rows`` rows is priced as that computation instead: a + b·rows seconds, both measured at build (one
  expert's SwiGLU over 1 and over ``host_max_rows`` rows from its host copy, rows there and back).

The policy reviews its line once per ``vamp_horizon_s`` of those modeled engine seconds unless the engine is given
a clock; the default suits a serving process, tests pass a short one.
"""

from __future__ import annotations

import torch

from moetide.core.experts import ExpertResidency
from moetide.core.pressure.step_costs import ASSUMED_FLOPS, STEP_DECAY, EngineCosts, step_compute_s
from moetide.core.pressure.vamp_params import TimedTokens
from moetide.engine.experts import StagedExpertProvider, TouchRates
from moetide.engine.models.moe import expert_mlp
from moetide.engine.measure import time_calls

COPY_REPEATS = 5


def measure_costs(provider: StagedExpertProvider, active_params: int) -> EngineCosts:
    host_a, host_b = measure_host_expert_s(provider) if provider.host_max_rows else (0.0, 0.0)
    return EngineCosts(prefill_s_per_token=2.0 * active_params / ASSUMED_FLOPS,
                       copy_s_per_expert=measure_copy_s(provider), expert_call_s=measure_expert_call_s(provider),
                       host_s_per_expert=host_a, host_s_per_row=host_b)


class EngineStepStats:
    """``core.pressure.vamp_params.StepStats`` from the engine's step counts and its cost record (module
    docstring); the copy and host times may be changed to price what-ifs."""

    def __init__(self, provider: StagedExpertProvider, residency: ExpertResidency, costs: EngineCosts,
                 experts_per_token: int) -> None:
        self.provider, self.residency = provider, residency
        self.experts_per_token = experts_per_token
        self.prefill_s_per_token = costs.prefill_s_per_token
        self.expert_call_s = costs.expert_call_s
        self.copy_s_per_expert = costs.copy_s_per_expert
        self.host_s_per_expert, self.host_s_per_row = costs.host_s_per_expert, costs.host_s_per_row
        self.busy = 0.0
        self._step_s: float | None = None
        self._exposed_per_step: float = 0.0  # staging and host compute a step holds
        self._timed_tokens = TimedTokens(STEP_DECAY)
        self._last = self._offload_counts()
        if provider.touches is None:
            provider.touches = TouchRates(residency.config.num_layers, residency.config.num_experts,
                                          host_max_rows=provider.host_max_rows)

    def _offload_counts(self) -> tuple[int, int, int]:
        p = self.provider
        return p.stager.num_staged, p.num_host_computed, p.num_host_rows

    def record(self, num_tokens: int) -> float:
        """One step of ``num_tokens`` tokens ran; returns its modeled seconds (tokens' compute plus the staging
        and host compute its counts show)."""
        counts = self._offload_counts()
        staged, host, rows = (now - before for now, before in zip(counts, self._last))
        self._last = counts
        exposed = staged * self.copy_s_per_expert + host * self.host_s_per_expert + rows * self.host_s_per_row
        seconds = self.compute_s(num_tokens) + exposed
        self.busy += seconds
        self._timed_tokens.record(num_tokens, seconds)
        if self._step_s is None:
            self._step_s, self._exposed_per_step = seconds, exposed
        else:
            self._step_s = STEP_DECAY * self._step_s + (1 - STEP_DECAY) * seconds
            self._exposed_per_step = STEP_DECAY * self._exposed_per_step + (1 - STEP_DECAY) * exposed
        return seconds

    def compute_s(self, num_tokens: int) -> float:
        """A step's seconds without staging (``step_compute_s``)."""
        return step_compute_s(num_tokens, self.residency.config, self.experts_per_token,
                              prefill_s_per_token=self.prefill_s_per_token, expert_call_s=self.expert_call_s)

    # ---- StepStats ------------------------------------------------------------------------------------------
    def busy_s(self) -> float:
        return self.busy

    def time_weighted_tokens(self) -> float:
        return self._timed_tokens.mean()

    def staging_share(self, num_offloaded: int) -> float:
        if num_offloaded <= 0 or self._step_s is None:
            return 0.0
        touches = self.provider.touches
        rates = touches.rates()
        offloaded = sorted(self.residency.all_offloaded(), key=lambda k: rates[k[0]][k[1]])
        order = offloaded[:num_offloaded]
        if num_offloaded > len(order):
            order += self.residency.next_offload_region(max_experts=num_offloaded - len(order))
        touched = sum(rates[m][e] for m, e in order)
        exposed = touched * self.copy_s_per_expert
        if self.provider.host_max_rows:  # small touches are computed on the host instead of staged
            host, host_rows = touches.host_rates()
            on_host = sum(host[m][e] for m, e in order)
            rows = sum(host_rows[m][e] for m, e in order)
            exposed += on_host * (self.host_s_per_expert - self.copy_s_per_expert) + rows * self.host_s_per_row
        base_s = max(self._step_s - self._exposed_per_step, 1e-9)
        return exposed / base_s


def _best_s(run, device: torch.device) -> float:
    """Seconds ``run()`` takes, best of ``COPY_REPEATS`` after a warm-up (waiting for a CUDA device each time)."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    return time_calls(lambda: (run(), sync()), COPY_REPEATS)[1]


def measure_copy_s(provider: StagedExpertProvider) -> float:
    """Seconds to copy one expert's host copy into a device buffer (best of ``COPY_REPEATS``)."""
    host = provider.stager.host
    buffer = torch.empty_like(host[0, 0], device=provider.storage.device)
    return _best_s(lambda: buffer.copy_(host[0, 0], non_blocking=buffer.device.type == "cuda"), buffer.device)


def measure_expert_call_s(provider: StagedExpertProvider) -> float:
    """Seconds one resident expert's SwiGLU takes over one row, on the engine's device (best of
    ``COPY_REPEATS``): the per-expert cost of a step, which dominates a small model's steps."""
    device = provider.storage.device
    weights = provider.layout.weights(provider.stager.host[0, 0].to(device))
    x = torch.randn(1, weights.down.shape[0], dtype=weights.down.dtype, device=device)
    return _best_s(lambda: expert_mlp(x, weights), device)


def measure_host_expert_s(provider: StagedExpertProvider) -> tuple[float, float]:
    """(a, b): seconds to compute one expert from its host copy over r rows ≈ a + b·r, r from 1 to
    ``host_max_rows`` (rows from the device there and back; best of ``COPY_REPEATS`` each)."""
    weights = provider.host_weights(0, 0)
    device = provider.storage.device
    most = provider.host_max_rows

    def best(rows: int) -> float:
        x = torch.randn(rows, weights.down.shape[0], dtype=weights.down.dtype, device=device)
        return _best_s(lambda: expert_mlp(x, weights), device)

    one, full = best(1), best(most)
    per_row = max(full - one, 0.0) / (most - 1) if most > 1 else 0.0
    return max(one - per_row, 0.0), per_row
