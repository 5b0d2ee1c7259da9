"""A recorded workload scaled to what a small model on a CPU serves: shorter prompts and outputs, faster or
slower time.

One rule for every verb that reads a trace, so that ``moetide bench-serve`` (sending a scaled slice to a live
server) and ``moetide replay`` (modeling the same slice) see the same requests: ``length_scale`` multiplies prompt,
output and key-block lengths alike, so a block key still covers one block of the scaled prompt;
``max_input_tokens`` / ``max_output_tokens`` then cap them, a capped prompt keeping the leading keys that still
fit whole (that is where the reuse is); ``time_scale`` multiplies session starts, arrival times and think times.
A length is rounded and never below one token. Choose ``length_scale`` so that a scaled key block is a whole
number of the server's KV blocks, or a shared key straddles a block and only part of it can hit.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from moetide.workloads.base import Turn, Workload


@dataclass(frozen=True)
class WorkloadScale:
    length_scale: float = 1.0
    max_input_tokens: int | None = None
    max_output_tokens: int | None = None
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        for name in ("length_scale", "time_scale"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be > 0, got {value}")
        for name in ("max_input_tokens", "max_output_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")

    @property
    def is_identity(self) -> bool:
        return self == WorkloadScale()

    def tokens(self, recorded: int, cap: int | None) -> int:
        n = max(1, round(recorded * self.length_scale))
        return n if cap is None else min(n, cap)


def scale_workload(workload: Workload, scale: WorkloadScale) -> Workload:
    """The workload with every turn's lengths, keys and times scaled (module docstring); itself when the scale
    changes nothing."""
    if scale.is_identity:
        return workload
    kbs = workload.key_block_size
    block = max(1, round(kbs * scale.length_scale)) if kbs else None
    t = scale.time_scale

    def turn_of(turn: Turn) -> Turn:
        prompt = scale.tokens(turn.prompt_tokens, scale.max_input_tokens)
        keys = turn.block_keys if block is None else turn.block_keys.prefix(min(len(turn.block_keys),
                                                                                  prompt // block))
        cached = None if turn.cached_tokens is None else min(prompt, round(turn.cached_tokens * scale.length_scale))
        return dataclasses.replace(turn, prompt_tokens=prompt,
                                   output_tokens=scale.tokens(turn.output_tokens, scale.max_output_tokens),
                                   block_keys=keys, arrival_s=None if turn.arrival_s is None else turn.arrival_s * t,
                                   think_time_s=turn.think_time_s * t, cached_tokens=cached)

    sessions = tuple(dataclasses.replace(s, start_s=s.start_s * t, turns=tuple(turn_of(x) for x in s.turns))
                     for s in workload.sessions)
    return dataclasses.replace(workload, key_block_size=block, sessions=sessions)

