"""The feedback half of WriteScope's split: the online correction factor k (measured / predicted CPU time), the
planner that applies it to writescope each step and probes a CPU it gives no work, and ``SplitStepper``, the
per-step runner of a named policy that the engine and the replay both use. Stdlib only, like ``core.splits``.

A CPU that gets no work is never measured, so ``SplitPlanner`` probes one judged slow: after ``probe_every`` plans
in a row that give it nothing, one plan puts a few blocks on it (``probe_split``), so a recovered CPU is noticed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from moetide.core.splits import (
    SPLIT_POLICIES,
    FixedRatio,
    SeqResidency,
    SeqSplit,
    SplitCosts,
    SplitPolicy,
    StepSplit,
    WriteScope,
)


@dataclass(frozen=True, slots=True)
class CorrectionConfig:
    """EWMA of measured / predicted CPU time. After a step change of the true ratio from r0 to r1 the factor's
    error is (1 - smoothing)^n |r1 - r0| after n samples (while inside the bounds): with 0.3, 7 samples leave
    8% of the step, 9 samples 4%. Samples whose prediction is below ``min_predicted_s`` carry no information
    (no CPU work that step) and are ignored."""

    smoothing: float = 0.3
    min_factor: float = 0.25
    max_factor: float = 4.0
    min_predicted_s: float = 1e-6

    def __post_init__(self) -> None:
        if not 0 < self.smoothing <= 1:
            raise ValueError(f"CorrectionConfig.smoothing must be in (0, 1], got {self.smoothing!r}")
        if not 0 < self.min_factor <= 1 <= self.max_factor < math.inf:
            raise ValueError(f"CorrectionConfig: need 0 < min_factor <= 1 <= max_factor < inf, got "
                             f"[{self.min_factor!r}, {self.max_factor!r}]")
        if not self.min_predicted_s >= 0:
            raise ValueError(f"CorrectionConfig.min_predicted_s must be >= 0, got {self.min_predicted_s!r}")


class OnlineCorrection:
    """The CPU-time correction factor k: starts at 1, follows measured / predicted, clamped to the bounds."""

    def __init__(self, config: CorrectionConfig = CorrectionConfig()) -> None:
        self.config, self.factor, self.num_samples = config, 1.0, 0

    def observe(self, measured_s: float, predicted_s: float) -> float:
        """Fold in one step; ``predicted_s`` is the UNcorrected model's CPU time for the work actually done."""
        if not (math.isfinite(measured_s) and measured_s >= 0):
            raise ValueError(f"measured_s must be a finite number >= 0, got {measured_s!r}")
        c = self.config
        if predicted_s < c.min_predicted_s or predicted_s <= 0:
            return self.factor
        blended = (1 - c.smoothing) * self.factor + c.smoothing * (measured_s / predicted_s)
        self.factor = min(c.max_factor, max(c.min_factor, blended))
        self.num_samples += 1
        return self.factor


DEFAULT_PROBE_EVERY = 16  # stated in docs/writescope.md: a recovered CPU is probed at least every 17th step
PROBE_ABOVE_FACTOR = 1.1  # only a CPU judged >10% slower than its model is probed (the others get work anyway)


def probe_split(costs: SplitCosts, seqs: Sequence[SeqResidency], block_bytes: float) -> tuple[SeqSplit, ...]:
    """The smallest CPU share whose measurement says something about the CPU's rate: the first host blocks of the
    sequence with the most, enough that the modeled byte term at least equals the fixed terms (c + p_c), so a
    slowdown of the roofline part moves the measured / predicted ratio by at least half as much."""
    i = max(range(len(seqs)), key=lambda i: (seqs[i].num_host_blocks, -i))
    per_block = costs.cpu_s_per_byte * block_bytes
    fixed = costs.cpu_fixed_s + costs.cpu_per_seq_s
    n = min(seqs[i].num_host_blocks, max(1, math.ceil(fixed / per_block)))
    cpu = [n if j == i else 0 for j in range(len(seqs))]
    return tuple(SeqSplit(s.seq_id, s.num_device_blocks, c, s.num_host_blocks - c) for s, c in zip(seqs, cpu))


class SplitPlanner:
    """Writescope each step, with the CPU side scaled by the online correction; ``observe`` closes the loop.

    A CPU judged slow gets no work, and a step without CPU work teaches the correction nothing, so a CPU that
    recovers would never be noticed. While the factor says the CPU is slower than its model (k >
    ``PROBE_ABOVE_FACTOR``), after ``probe_every`` consecutive plans that leave host KV but give the CPU nothing,
    the next plan is a probe (``probe_split``): a few blocks on the CPU, measured like any step. It costs little
    while the streaming side is the longer one, which is why the CPU got nothing. A CPU at or under its model that
    gets nothing (a prefill chunk's step, where streaming wins at any CPU speed) is not probed. ``probe_every=0``
    disables probing."""

    def __init__(self, correction: OnlineCorrection | None = None, *,
                 probe_every: int = DEFAULT_PROBE_EVERY) -> None:
        if not (isinstance(probe_every, int) and probe_every >= 0):
            raise ValueError(f"SplitPlanner.probe_every must be an integer >= 0, got {probe_every!r}")
        self.correction = correction or OnlineCorrection()
        self.probe_every, self.num_probes, self._idle = probe_every, 0, 0

    def plan(self, costs: SplitCosts, seqs: Sequence[SeqResidency], block_bytes: float) -> StepSplit:
        factor = self.correction.factor
        splits = WriteScope().split(costs, seqs, block_bytes, factor)
        idle = not any(s.num_cpu_blocks for s in splits) and any(s.num_host_blocks for s in seqs)
        self._idle = self._idle + 1 if idle else 0
        probe = bool(self.probe_every) and self._idle > self.probe_every and factor > PROBE_ABOVE_FACTOR
        if probe:
            self._idle, self.num_probes = 0, self.num_probes + 1
            splits = probe_split(costs, seqs, block_bytes)
        return StepSplit.of(costs, seqs, splits, block_bytes, factor, probe)

    def observe(self, plan: StepSplit, measured_cpu_s: float) -> float:
        return self.correction.observe(measured_cpu_s, plan.predicted_cpu_s)


class SplitStepper:
    """The named split policy, step by step: what the engine and the replay both run. ``costs`` gives a step's
    ``SplitCosts`` from (device-resident tokens, queries per sequence); for ``writescope`` the plan comes from a
    ``SplitPlanner`` (online correction and probes) and ``observe`` feeds back the step's CPU time; the baselines
    are static (factor 1, nothing observed)."""

    def __init__(self, policy: str | SplitPolicy, costs: Callable[[int, int], SplitCosts], block_bytes: float,
                 fixed_ratio: float = 0.5) -> None:
        if isinstance(policy, str) and policy not in SPLIT_POLICIES:
            raise ValueError(f"unknown split policy {policy!r}; choose from {', '.join(SPLIT_POLICIES)}")
        if not 0 <= fixed_ratio <= 1:
            raise ValueError(f"the fixed-ratio CPU share must be in [0, 1], got {fixed_ratio!r}")
        self.costs, self.block_bytes = costs, block_bytes
        self.name = policy if isinstance(policy, str) else policy.name
        self.planner = SplitPlanner() if policy == "writescope" else None
        self.policy: SplitPolicy | None = None
        if isinstance(policy, SplitPolicy):
            self.policy = policy
        elif self.planner is None:
            self.policy = FixedRatio(fixed_ratio) if policy == "fixed-ratio" else SPLIT_POLICIES[policy]()

    def plan(self, seqs: Sequence[SeqResidency], device_tokens: int, num_queries: int) -> StepSplit:
        costs = self.costs(device_tokens, num_queries)
        if self.planner is not None:
            return self.planner.plan(costs, seqs, self.block_bytes)
        return StepSplit.of(costs, seqs, self.policy.split(costs, seqs, self.block_bytes), self.block_bytes)

    def observe(self, plan: StepSplit, measured_cpu_s: float) -> None:
        """Feed a step's measured CPU time back (writescope only; ``correction_factor`` then says where it is)."""
        if self.planner is not None:
            self.planner.observe(plan, measured_cpu_s)

    @property
    def correction_factor(self) -> float:
        return self.planner.correction.factor if self.planner is not None else 1.0

    @property
    def num_probes(self) -> int:
        return self.planner.num_probes if self.planner is not None else 0
