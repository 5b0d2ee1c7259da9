"""Byte units and the ceiling division, shared by every layer (stdlib only, like ``errors``).

Blocks, pages and experts are counted in whole units everywhere ("how many blocks hold n tokens"), and one
spelling of that rounding keeps the drivers' counts from drifting apart.
"""

KiB, MiB, GiB = 2**10, 2**20, 2**30


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers, exact at any size (no float)."""
    return -(-a // b)


def bytes_text(num_bytes: float) -> str:
    """A size in the binary unit its magnitude calls for (``8 GiB``, ``1.5 MiB``)."""
    for scale, unit in ((2**50, "PiB"), (2**40, "TiB"), (GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if num_bytes >= scale:
            return f"{num_bytes / scale:,.4g} {unit}"
    return f"{num_bytes:,.0f} B"
