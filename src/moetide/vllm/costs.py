"""What ``vamp`` reads of vLLM's steps: seconds from a cost record, never a timing taken mid-run.

As in moetide's engine (``engine.vamp``), a step's seconds come from the record (``EngineCosts``) and the step's
token count, so the same requests and the same record make the same decisions on a quiet machine or a loaded one,
and the replay given the record decides as vLLM does (the differential test runs both sides from one record).
The policy's clock is these modeled seconds unless the plugin is told to use the wall clock.

Staging is modeled from uniform routing: an offloaded expert is touched by a step of ``t`` tokens with probability
``1 - (1 - k/E)^t`` (``k`` experts per token out of ``E``) and each touch costs one ``copy_s_per_expert``. The
pager's counted routing decides which experts leave (the residency's hotness), not this price, which stays a
function of the record and the steps' tokens, so one record drives both sides of the differential tests.
"""

from __future__ import annotations

from moetide.core.experts import ExpertResidency
from moetide.engine.vamp import STEP_DECAY, EngineCosts, step_compute_s


class RecordSteps:
    """``core.pressure.vamp_params.StepStats`` from a cost record and each step's token count."""

    def __init__(self, costs: EngineCosts, residency: ExpertResidency, experts_per_token: int) -> None:
        self.costs, self.residency, self.experts_per_token = costs, residency, experts_per_token
        self.busy = 0.0
        self._tokens: float | None = None  # decayed mean tokens per step
        self._step_s: float | None = None  # decayed mean seconds per step, staging left out

    def touch_probability(self, num_tokens: float) -> float:
        """Chance that a step of ``num_tokens`` tokens routes at least one token of a layer to a given expert."""
        config = self.residency.config
        share = min(self.experts_per_token / config.num_experts, 1.0)
        return 1.0 - (1.0 - share) ** num_tokens

    def compute_s(self, num_tokens: int) -> float:
        """A step's seconds without staging, as moetide's engine prices one (``engine.vamp.step_compute_s``)."""
        return step_compute_s(num_tokens, self.residency.config, self.experts_per_token,
                              prefill_s_per_token=self.costs.prefill_s_per_token,
                              expert_call_s=self.costs.expert_call_s)

    def record(self, num_tokens: int) -> float:
        """One step of ``num_tokens`` tokens ran; returns its modeled seconds, the staging of what is offloaded in."""
        compute = self.compute_s(num_tokens)
        staged = self.residency.num_offloaded * self.touch_probability(num_tokens)
        seconds = compute + staged * self.costs.copy_s_per_expert
        self.busy += seconds
        if self._step_s is None:
            self._tokens, self._step_s = float(num_tokens), compute
        else:
            self._tokens = STEP_DECAY * self._tokens + (1 - STEP_DECAY) * num_tokens
            self._step_s = STEP_DECAY * self._step_s + (1 - STEP_DECAY) * compute
        return seconds

    # ---- StepStats ------------------------------------------------------------------------------------------
    def busy_s(self) -> float:
        return self.busy

    def staging_share(self, num_offloaded: int) -> float:
        if num_offloaded <= 0 or not self._step_s:
            return 0.0
        staged = num_offloaded * self.touch_probability(self._tokens)
        return staged * self.costs.copy_s_per_expert / self._step_s
