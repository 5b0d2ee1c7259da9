"""``--policy vamp`` in the engine: the core's policy, priced with what the engine measures.

``core.pressure.vamp`` weighs re-prefill saved by more KV against staging added by offloaded experts; the replay
feeds it modeled seconds, the engine feeds it its own measurements (``EngineStepStats``, the policy's
``StepStats``):

* **busy seconds**: every step's wall time (``record``), so the policy's busy share is the engine's.
* **re-prefill per token**: the measured seconds per token of recent steps that carried prefill (an exponentially
  weighted mean over the last ~``1 / (1 - decay)`` such steps, over whatever contexts they had: the engine does not
  fit the context term the replay's perf model has, so ``prefill_s_per_token_per_context`` is 0 here). Until a
  prefill step has run, the spec estimate ``VampParams.prefill_s_per_token`` (2 FLOP per active parameter per
  token at ``ASSUMED_FLOPS``) stands in; no prefix can have been evicted by then, so it prices nothing.
* **staging share** of ``n`` offloaded experts: Σ over those experts of their measured touch rate per step
  (``engine.experts.TouchRates``: the experts offloaded now, coldest first, then those ``ExpertResidency`` would
  offload next) × the seconds one expert's copy into the staging buffer took (measured at build, best of
  ``COPY_REPEATS``), over the mean step time less the staging it already contains. On the CPU the copies are
  synchronous, so this is the exposed time; on CUDA they overlap the previous layer and this is an upper bound.

The policy reviews its line once per ``vamp_horizon_s`` of engine time (the engine's clock is wall time since it
was built); the default suits a serving process, tests pass a short one.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from moetide.core.experts import ExpertResidency
from moetide.core.pressure import VampParams
from moetide.engine.experts import StagedExpertProvider, TouchRates

ASSUMED_FLOPS = 1e11  # FLOP/s of one CPU core's fp32 GEMM (`moetide calibrate` measured 9.6e10 on this project's VM)
COPY_REPEATS = 5
STEP_DECAY = 0.95  # weight of the previous mean in the step-time and prefill-rate means


class EngineStepStats:
    """``core.pressure.vamp.StepStats`` from the engine's measurements (module docstring)."""

    def __init__(self, provider: StagedExpertProvider, residency: ExpertResidency, copy_s_per_expert: float) -> None:
        self.provider, self.residency = provider, residency
        self.copy_s_per_expert = copy_s_per_expert
        self.busy = 0.0
        self._step_s: float | None = None
        self._staged_per_step: float = 0.0
        self._prefill_s = 0.0
        self._prefill_tokens = 0.0
        self._last_staged = provider.stager.num_staged
        if provider.touches is None:
            provider.touches = TouchRates(residency.config.num_layers, residency.config.num_experts)

    def record(self, seconds: float, num_tokens: int, is_decode: bool) -> None:
        """One step's wall time and token count (``is_decode``: every request brought one token)."""
        self.busy += seconds
        staged = self.provider.stager.num_staged
        step_staged, self._last_staged = staged - self._last_staged, staged
        if self._step_s is None:
            self._step_s, self._staged_per_step = seconds, float(step_staged)
        else:
            self._step_s = STEP_DECAY * self._step_s + (1 - STEP_DECAY) * seconds
            self._staged_per_step = STEP_DECAY * self._staged_per_step + (1 - STEP_DECAY) * step_staged
        if not is_decode:
            self._prefill_s = STEP_DECAY * self._prefill_s + seconds
            self._prefill_tokens = STEP_DECAY * self._prefill_tokens + num_tokens

    def prefill_s_per_token(self) -> float | None:
        """Measured seconds per token of recent prefill-carrying steps; None before the first."""
        return self._prefill_s / self._prefill_tokens if self._prefill_tokens else None

    # ---- StepStats ------------------------------------------------------------------------------------------
    def busy_s(self) -> float:
        return self.busy

    def staging_share(self, num_offloaded: int) -> float:
        if num_offloaded <= 0 or self._step_s is None:
            return 0.0
        touches = self.provider.touches
        rates = touches.rates()
        offloaded = sorted(self.residency.all_offloaded(), key=lambda k: rates[k[0]][k[1]])
        order = offloaded[:num_offloaded]
        if num_offloaded > len(order):
            order += self.residency.next_offload_region(max_experts=num_offloaded - len(order))
        staged_per_step = sum(rates[m][e] for m, e in order)
        base_s = max(self._step_s - self._staged_per_step * self.copy_s_per_expert, 1e-9)
        return staged_per_step * self.copy_s_per_expert / base_s


@dataclasses.dataclass(frozen=True)
class EngineVampParams(VampParams):
    """``VampParams`` whose re-prefill price is the engine's measured one once a prefill step has run."""

    def block_prefill_s(self, block_index: int) -> float:
        measured = self.steps.prefill_s_per_token()  # type: ignore[attr-defined]
        per_token = self.prefill_s_per_token if measured is None else measured
        return self.block_size * per_token


def measure_copy_s(provider: StagedExpertProvider) -> float:
    """Seconds to copy one expert's host copy into a device buffer (best of ``COPY_REPEATS``)."""
    host = provider.stager.host
    buffer = torch.empty_like(host[0, 0], device=provider.storage.device)
    cuda = buffer.device.type == "cuda"
    best = float("inf")
    for _ in range(COPY_REPEATS):
        start = time.perf_counter()
        buffer.copy_(host[0, 0], non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize(buffer.device)
        best = min(best, time.perf_counter() - start)
    return best


def engine_vamp_params(provider: StagedExpertProvider, residency: ExpertResidency, *, block_size: int,
                       active_params: int, horizon_s: float) -> EngineVampParams:
    steps = EngineStepStats(provider, residency, measure_copy_s(provider))
    return EngineVampParams(prefill_s_per_token=2.0 * active_params / ASSUMED_FLOPS, steps=steps,
                            block_size=block_size, horizon_s=horizon_s,
                            reclaim_check_s=min(horizon_s, VampParams.reclaim_check_s),
                            reclaim_hold_s=min(horizon_s, VampParams.reclaim_hold_s),
                            remap_s_per_expert=0.0)  # conversion relabels pages in Python, inside the step time
