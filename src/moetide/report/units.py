"""Numbers for people: a duration in the unit its magnitude calls for, a ratio with its significant digits, a
parameter count in K/M/B.

Invariant: each is a pure function of its argument (tables stay byte-for-byte reproducible). A fixed unit hides
what matters at the extremes: a TTFT of hours printed as 4,158,395.1 ms, or a 3,700x gain printed as 0.000x.
"""

from __future__ import annotations

import math

# (upper bound in seconds, divisor, unit, decimals), smallest first
_DURATION_UNITS = ((1.0, 1e-3, "ms", 1), (60.0, 1.0, "s", 2), (3600.0, 60.0, "min", 1),
                   (math.inf, 3600.0, "h", 2))


def duration_text(seconds: float | None) -> str:
    """``12.3 ms``, ``19.70 s``, ``4.5 min``, ``1.16 h``; ``-`` for None."""
    if seconds is None:
        return "-"
    for bound, divisor, unit, decimals in _DURATION_UNITS:
        if abs(seconds) < bound:
            return f"{seconds / divisor:,.{decimals}f} {unit}"
    raise AssertionError("unreachable: the last bound is infinite")


def duration_unit(max_seconds: float) -> tuple[float, str]:
    """The divisor and unit name a time axis reaching ``max_seconds`` reads best in."""
    for bound, divisor, unit, _ in _DURATION_UNITS[1:]:
        if max_seconds < 3 * bound:
            return divisor, unit
    return 3600.0, "h"


def ratio_text(value: float | None, digits: int = 3) -> str:
    """A ratio with ``digits`` significant digits and no exponent: ``1.88x``, ``0.000270x``, ``3,700x``."""
    if value is None:
        return "-"
    if value == 0 or not math.isfinite(value):
        return f"{value:g}x"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(value))))
    return f"{value:,.{decimals}f}x"


def count_text(value: float) -> str:
    """A parameter count: ``30.53 B``, ``12.35 M``, ``4.10 K``, or the integer itself below a thousand."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{int(value):,}"
