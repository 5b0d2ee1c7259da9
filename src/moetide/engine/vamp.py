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
  With cold experts computed on the host (``cold_experts="cpu"``), a touch of at most ``host_max_rows`` rows is
  priced as that computation instead: a + b·rows seconds, both measured at build (one expert's SwiGLU over 1 and
  over ``host_max_rows`` rows from its host copy, rows there and back, best of ``COPY_REPEATS``). On the CPU
  this is the same work a resident expert would do, so it overstates the cost; on CUDA it is the host's share.

The policy reviews its line once per ``vamp_horizon_s`` of engine time (the engine's clock is wall time since it
was built); the default suits a serving process, tests pass a short one.
"""

from __future__ import annotations

import dataclasses

import torch

from moetide.core.experts import ExpertResidency
from moetide.core.pressure import VampParams
from moetide.engine.experts import StagedExpertProvider, TouchRates
from moetide.engine.models.moe import expert_mlp
from moetide.perf.measure import time_calls

ASSUMED_FLOPS = 1e11  # FLOP/s of one CPU core's fp32 GEMM (`moetide calibrate` measured 9.6e10 on this project's VM)
COPY_REPEATS = 5
STEP_DECAY = 0.95  # weight of the previous mean in the step-time and prefill-rate means


class EngineStepStats:
    """``core.pressure.vamp_params.StepStats`` from the engine's measurements (module docstring)."""

    def __init__(self, provider: StagedExpertProvider, residency: ExpertResidency, copy_s_per_expert: float,
                 host_s: tuple[float, float] = (0.0, 0.0)) -> None:
        self.provider, self.residency = provider, residency
        self.copy_s_per_expert = copy_s_per_expert
        self.host_s_per_expert, self.host_s_per_row = host_s  # a, b of a host-computed expert (cold_experts="cpu")
        self.busy = 0.0
        self._step_s: float | None = None
        self._exposed_per_step: float = 0.0  # staging and host compute a step holds (estimated from its counts)
        self._prefill_s = 0.0
        self._prefill_tokens = 0.0
        self._last = self._offload_counts()
        if provider.touches is None:
            provider.touches = TouchRates(residency.config.num_layers, residency.config.num_experts,
                                          host_max_rows=provider.host_max_rows)

    def _offload_counts(self) -> tuple[int, int, int]:
        p = self.provider
        return p.stager.num_staged, p.num_host_computed, p.num_host_rows

    def record(self, seconds: float, num_tokens: int, is_decode: bool) -> None:
        """One step's wall time and token count (``is_decode``: every request brought one token)."""
        self.busy += seconds
        counts = self._offload_counts()
        staged, host, rows = (now - before for now, before in zip(counts, self._last))
        self._last = counts
        exposed = staged * self.copy_s_per_expert + host * self.host_s_per_expert + rows * self.host_s_per_row
        if self._step_s is None:
            self._step_s, self._exposed_per_step = seconds, exposed
        else:
            self._step_s = STEP_DECAY * self._step_s + (1 - STEP_DECAY) * seconds
            self._exposed_per_step = STEP_DECAY * self._exposed_per_step + (1 - STEP_DECAY) * exposed
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
        touched = sum(rates[m][e] for m, e in order)
        exposed = touched * self.copy_s_per_expert
        if self.provider.host_max_rows:  # small touches are computed on the host instead of staged
            host, host_rows = touches.host_rates()
            on_host = sum(host[m][e] for m, e in order)
            rows = sum(host_rows[m][e] for m, e in order)
            exposed += on_host * (self.host_s_per_expert - self.copy_s_per_expert) + rows * self.host_s_per_row
        base_s = max(self._step_s - self._exposed_per_step, 1e-9)
        return exposed / base_s


@dataclasses.dataclass(frozen=True)
class EngineVampParams(VampParams):
    """``VampParams`` whose re-prefill price is the engine's measured one once a prefill step has run."""

    def block_prefill_s(self, block_index: int) -> float:
        measured = self.steps.prefill_s_per_token()  # type: ignore[attr-defined]
        per_token = self.prefill_s_per_token if measured is None else measured
        return self.block_size * per_token


def _best_s(run, device: torch.device) -> float:
    """Seconds ``run()`` takes, best of ``COPY_REPEATS`` after a warm-up (waiting for a CUDA device each time)."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    return time_calls(lambda: (run(), sync()), COPY_REPEATS)[1]


def measure_copy_s(provider: StagedExpertProvider) -> float:
    """Seconds to copy one expert's host copy into a device buffer (best of ``COPY_REPEATS``)."""
    host = provider.stager.host
    buffer = torch.empty_like(host[0, 0], device=provider.storage.device)
    return _best_s(lambda: buffer.copy_(host[0, 0], non_blocking=buffer.device.type == "cuda"), buffer.device)


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


def engine_vamp_params(provider: StagedExpertProvider, residency: ExpertResidency, *, block_size: int,
                       active_params: int, horizon_s: float) -> EngineVampParams:
    host_s = measure_host_expert_s(provider) if provider.host_max_rows else (0.0, 0.0)
    steps = EngineStepStats(provider, residency, measure_copy_s(provider), host_s)
    return EngineVampParams(prefill_s_per_token=2.0 * active_params / ASSUMED_FLOPS, steps=steps,
                            block_size=block_size, horizon_s=horizon_s,
                            reclaim_check_s=min(horizon_s, VampParams.reclaim_check_s),
                            reclaim_hold_s=min(horizon_s, VampParams.reclaim_hold_s),
                            remap_s_per_expert=0.0)  # conversion relabels pages in Python, inside the step time
