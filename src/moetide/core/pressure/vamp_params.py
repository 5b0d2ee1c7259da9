"""``vamp``'s coefficients and the rate it measures with: ``VampParams`` (every coefficient, a named field with a
default derived from specs or stated here), ``StepStats`` (what the policy reads of the steps that ran: the
replay's modeled step timer or the engine's measured one) and ``DecayedRate`` (an amount per second over roughly
the last ``tau_s`` seconds). The policy itself is ``core.pressure.vamp``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol


class StepStats(Protocol):
    """What the policy reads of the steps that ran (the replay's modeled step timer; an engine's measured one)."""

    def busy_s(self) -> float:
        """Total seconds spent in steps so far."""
        ...

    def staging_share(self, num_offloaded: int) -> float:
        """Exposed staging seconds per second of step time over the recent step mix, were ``num_offloaded``
        experts offloaded (spread over layers)."""
        ...

    def time_weighted_tokens(self) -> float:
        """Tokens per step over the recent steps, each step weighted by its time: how full the steps that take
        the accelerator's time are (0 before any step)."""
        ...


class TimedTokens:
    """``StepStats.time_weighted_tokens`` for a driver that records steps one by one: Σ seconds·tokens over
    Σ seconds, each step's weight decaying by ``decay`` per step."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self._seconds = 0.0
        self._token_seconds = 0.0

    def record(self, num_tokens: int, seconds: float) -> None:
        self._seconds = self.decay * self._seconds + seconds
        self._token_seconds = self.decay * self._token_seconds + seconds * num_tokens

    def mean(self) -> float:
        return self._token_seconds / self._seconds if self._seconds > 0 else 0.0


@dataclass(frozen=True)
class VampParams:
    prefill_s_per_token: float  # re-prefill of one token at context 0 (a full prefill chunk's time / its tokens)
    steps: StepStats
    block_size: int
    prefill_s_per_token_per_context: float = 0.0  # what one token of context adds to one token's prefill
    # time constant of the measured rates (ghost hits, busy share) and the review interval: long enough to see
    # reuse, short enough to follow the onset of pressure (chosen against an oracle of fixed offload ratios:
    # docs/vamp.md, "The default horizon and window")
    horizon_s: float = 120.0
    remap_s_per_expert: float = 50e-6  # cuMemUnmap/cuMemMap of an expert's pages and the block-table update
    reclaim: bool = False
    reclaim_check_s: float = 5.0  # how often vamp-reclaim looks for a region to give back
    # vamp-reclaim gives a region back only once the pool has had room to spare for reclaim_hold_s: uncached free
    # blocks beyond the region's own of at least reclaim_watermark of the pool (a pool that the larger line keeps
    # full of reused prefixes keeps its pages)
    reclaim_watermark: float = 0.05
    reclaim_hold_s: float = 60.0
    # the line moves out when W more blocks are worth this many times their staging (first-order estimates on both
    # sides, neither seeing the queueing a move causes; the factor absorbs their error)
    margin: float = 2.0
    # a growth of the line is checked one review later against what it was for: the accelerator's busy seconds per
    # prompt token asked for (re-prefill and staging both raise it). Worse by more than this fraction: the window
    # is taken back from the allowance and the line may not grow for growth_hold_reviews reviews.
    growth_tolerance: float = 0.1
    growth_hold_reviews: int = 4
    # give regions back once the allowance falls below what is offloaded: the last region drains (its blocks
    # leave the pool as they come free; none is allocated again) and goes back to its experts. False: the line
    # only grows (the VAMP paper's controller).
    give_back: bool = True
    # ... and, a window at a time, once the pool has had room to spare (vamp-reclaim's watermark) for this many
    # horizons: reviews run only at shortfalls, so a line that pressure moved would otherwise stay out for good
    # once it recedes. Long enough that a lull within a burst keeps the line (docs/vamp.md)
    calm_reviews: float = 10.0
    # a waiting request refused while others run (vLLM 0.32's full-sequence admission: pressure shows as a queue)
    # may move the line at once, outside the reviews, when the queue's time to first token (the waiting requests,
    # in request-seconds per second) outweighs margin times what the region's staging adds to the steps of every
    # request in the batch, and only while the exposed staging share stays within this bound (0 turns it off).
    # The bound is the decode slowdown the line may cost a user for the queue: vLLM's TPOT tolerance of 10%.
    queue_staging_share: float = 0.1
    # the step's token budget (max_num_batched_tokens): the share of step time spent in steps that fill it is
    # compute-bound, and a larger batch gains nothing there (None: unknown, no step counts as full)
    token_budget: int | None = None

    def __post_init__(self) -> None:
        for name in ("prefill_s_per_token", "horizon_s", "reclaim_check_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"VampParams.{name} must be positive, got {getattr(self, name)}")
        if self.block_size <= 0 or self.prefill_s_per_token_per_context < 0 or self.remap_s_per_expert < 0:
            raise ValueError("VampParams: block_size must be positive; per-context and remap costs must be >= 0")
        if not 0 <= self.reclaim_watermark < 1 or not self.reclaim_hold_s >= 0:
            raise ValueError("VampParams: reclaim_watermark must be in [0, 1) and reclaim_hold_s >= 0")
        if not self.margin >= 1:
            raise ValueError(f"VampParams.margin must be >= 1, got {self.margin}")
        if not self.calm_reviews > 0:
            raise ValueError(f"VampParams.calm_reviews must be positive, got {self.calm_reviews}")
        if self.token_budget is not None and self.token_budget <= 0:
            raise ValueError(f"VampParams.token_budget must be positive, got {self.token_budget}")
        if not 0 <= self.queue_staging_share <= 1:
            raise ValueError(f"VampParams.queue_staging_share must be in [0, 1], got {self.queue_staging_share}")
        if not self.growth_tolerance >= 0 or self.growth_hold_reviews < 0:
            raise ValueError("VampParams: growth_tolerance and growth_hold_reviews must be >= 0")

    def step_fill(self) -> float:
        """How full the recent steps are, by time: their time-weighted tokens over the token budget (0 where the
        budget is unknown)."""
        if self.token_budget is None:
            return 0.0
        return min(self.steps.time_weighted_tokens() / self.token_budget, 1.0)

    def block_prefill_s(self, block_index: int) -> float:
        """Re-prefill of pool block ``block_index`` of a prefix (tokens at context ≈ its middle)."""
        middle = (block_index + 0.5) * self.block_size
        return self.block_size * (self.prefill_s_per_token + self.prefill_s_per_token_per_context * middle)


class DecayedRate:
    """Amount per second over roughly the last ``tau_s`` seconds: Σ amount·e^(−age/τ) over ∫ e^(−age/τ) dt since
    the first observation (so the estimate is not ramped up from zero)."""

    def __init__(self, tau_s: float) -> None:
        self.tau_s = tau_s
        self._sum = 0.0
        self._elapsed = 0.0
        self._t: float | None = None

    def _advance(self, now_s: float) -> None:
        if self._t is None:
            self._t = now_s
            return
        dt = now_s - self._t
        if dt > 0:
            f = math.exp(-dt / self.tau_s)
            self._sum *= f
            self._elapsed = self._elapsed * f + self.tau_s * (1.0 - f)
            self._t = now_s

    def add(self, now_s: float, amount: float) -> None:
        self._advance(now_s)
        self._sum += amount

    def add_spread(self, now_s: float, amount: float) -> None:
        """``amount`` accrued evenly since the last observation (busy seconds read only now and then): counted as
        a constant rate over that interval, not as one event now, which would overstate the rate after a long gap.
        The first observation only starts the clock (its interval is unknown)."""
        if self._t is None:
            self._t = now_s
            return
        dt = now_s - self._t
        self._advance(now_s)
        self._sum += amount if dt <= 0 else amount * self.tau_s * (1.0 - math.exp(-dt / self.tau_s)) / dt

    def rate(self, now_s: float) -> float | None:
        self._advance(now_s)
        return self._sum / self._elapsed if self._elapsed > 0 else None
