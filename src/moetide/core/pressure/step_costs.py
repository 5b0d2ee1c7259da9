"""How ``vamp`` is priced from a cost record, in both engines: the record (``EngineCosts``), a step's modeled
seconds (``step_compute_s``), the plugin's ``StepStats`` from the record alone (``RecordSteps``), and ``VampParams``
from a driver's step stats (``engine_vamp_params``). Stdlib only, so vLLM's scheduler process prices the plugin's
policy without torch or moetide's engine; moetide's engine measures the record (``engine.vamp.measure_costs``).

A step's seconds come from the record and the step's token count, never a timing taken mid-run, so the same
requests and the same record make the same decisions on a quiet machine or a loaded one, and the replay given the
record decides as the engines do (the differential tests run both sides from one record).

``RecordSteps`` models staging from uniform routing: an offloaded expert is touched by a step of ``t`` tokens with
probability ``1 - (1 - k/E)^t`` (``k`` experts per token out of ``E``), and each touch costs one
``copy_s_per_expert``. The workers' counted routing decides which experts leave (the residency's hotness), not this
price, which stays a function of the record and the steps' tokens.
"""

from __future__ import annotations

import dataclasses
import math

from moetide.core.experts import ExpertResidency
from moetide.core.pressure.vamp_params import TimedTokens, VampParams

ASSUMED_FLOPS = 1e11  # FLOP/s of one CPU core's fp32 GEMM (`moetide calibrate` measured 9.6e10 on this project's VM)
STEP_DECAY = 0.95  # weight of the previous mean in the step-time and staging means


@dataclasses.dataclass(frozen=True)
class EngineCosts:
    """What vamp's prices read, measured once (``measure_costs``) and recorded: a rerun given this record
    decides exactly as the run that measured it."""

    prefill_s_per_token: float  # one token's step seconds (2 FLOP per active parameter at ASSUMED_FLOPS)
    copy_s_per_expert: float  # one expert's host-to-staging copy
    expert_call_s: float = 0.0  # one resident expert's SwiGLU over one row: what each expert a step runs costs
    host_s_per_expert: float = 0.0  # a, b of an expert computed from its host copy over r rows: a + b·r
    host_s_per_row: float = 0.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"EngineCosts.{f.name} must be a finite number >= 0, got {value!r}")
        if self.prefill_s_per_token <= 0:
            raise ValueError(f"EngineCosts.prefill_s_per_token must be > 0, got {self.prefill_s_per_token!r}")

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def step_compute_s(num_tokens: int, config, experts_per_token: int, *, prefill_s_per_token: float,
                   expert_call_s: float) -> float:
    """A step's modeled seconds without staging: the tokens' compute plus one call per expert each MoE layer runs
    (``config``: the ``ExpertResidencyConfig``). moetide's engine and the vLLM plugin price a step by this."""
    calls = config.num_layers * min(config.num_experts, num_tokens * experts_per_token)
    return num_tokens * prefill_s_per_token + calls * expert_call_s


class RecordSteps:
    """``core.pressure.vamp_params.StepStats`` from a cost record and each step's token count."""

    def __init__(self, costs: EngineCosts, residency: ExpertResidency, experts_per_token: int) -> None:
        self.costs, self.residency, self.experts_per_token = costs, residency, experts_per_token
        self.busy = 0.0
        self._tokens: float | None = None  # decayed mean tokens per step
        self._step_s: float | None = None  # decayed mean seconds per step, staging left out
        self._timed_tokens = TimedTokens(STEP_DECAY)

    def touch_probability(self, num_tokens: float) -> float:
        """Chance that a step of ``num_tokens`` tokens routes at least one token of a layer to a given expert."""
        config = self.residency.config
        share = min(self.experts_per_token / config.num_experts, 1.0)
        return 1.0 - (1.0 - share) ** num_tokens

    def compute_s(self, num_tokens: int) -> float:
        """A step's seconds without staging, as moetide's engine prices one (``step_compute_s``)."""
        return step_compute_s(num_tokens, self.residency.config, self.experts_per_token,
                              prefill_s_per_token=self.costs.prefill_s_per_token,
                              expert_call_s=self.costs.expert_call_s)

    def record(self, num_tokens: int) -> float:
        """One step of ``num_tokens`` tokens ran; returns its modeled seconds, the staging of what is offloaded in."""
        compute = self.compute_s(num_tokens)
        staged = self.residency.num_offloaded * self.touch_probability(num_tokens)
        seconds = compute + staged * self.costs.copy_s_per_expert
        self.busy += seconds
        self._timed_tokens.record(num_tokens, seconds)
        if self._step_s is None:
            self._tokens, self._step_s = float(num_tokens), compute
        else:
            self._tokens = STEP_DECAY * self._tokens + (1 - STEP_DECAY) * num_tokens
            self._step_s = STEP_DECAY * self._step_s + (1 - STEP_DECAY) * compute
        return seconds

    # ---- StepStats ------------------------------------------------------------------------------------------
    def busy_s(self) -> float:
        return self.busy

    def time_weighted_tokens(self) -> float:
        return self._timed_tokens.mean()

    def staging_share(self, num_offloaded: int) -> float:
        if num_offloaded <= 0 or not self._step_s:
            return 0.0
        staged = num_offloaded * self.touch_probability(self._tokens)
        return staged * self.costs.copy_s_per_expert / self._step_s


def engine_vamp_params(steps, *, block_size: int, chunk_tokens: int, horizon_s: float
                       ) -> VampParams:
    """``VampParams`` over a driver's step stats (``EngineStepStats``, ``RecordSteps``: anything with ``compute_s``
    and ``StepStats``'s methods). Re-prefill is priced as the replay prices it: a full chunk's step seconds per
    token; ``chunk_tokens`` is the step's token budget."""
    return VampParams(prefill_s_per_token=steps.compute_s(chunk_tokens) / chunk_tokens, steps=steps,
                      block_size=block_size, token_budget=chunk_tokens,
                      horizon_s=horizon_s, reclaim_check_s=min(horizon_s, VampParams.reclaim_check_s),
                      reclaim_hold_s=min(horizon_s, VampParams.reclaim_hold_s),
                      remap_s_per_expert=0.0)  # conversion relabels pages in Python, inside the step time
