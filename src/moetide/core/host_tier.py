"""The host tier of a two-tier KV pool (``core.blocks``): which block ids are host blocks, and where each lives.

Its own module so that the drivers that lay host memory out (``engine.host_kv``, ``sim.host_kv``) and the rules
that count host blocks (``core.kv_manager``, ``core.host_admission``) share one definition of "a host block".
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class HostTier:
    """The host KV blocks of a two-tier pool: ``num_blocks`` ids from ``first_id`` on, numbered in a row so a
    driver can map each to its slot in host memory (``index``). Device blocks are every other id the pool owns."""

    first_id: int
    num_blocks: int

    def __post_init__(self) -> None:
        if self.first_id < 0 or self.num_blocks < 0:
            raise ValueError(f"HostTier needs first_id >= 0 and num_blocks >= 0, got {self}")

    @property
    def end_id(self) -> int:
        """One past the last host id: ``first_id <= b < end_id`` is ``holds(b)``, for loops that inline it."""
        return self.first_id + self.num_blocks

    def holds(self, block_id: int) -> bool:
        return self.first_id <= block_id < self.first_id + self.num_blocks

    def index(self, block_id: int) -> int:
        """The block's slot among the host blocks (0 for ``first_id``)."""
        return block_id - self.first_id

    def ids(self) -> range:
        return range(self.first_id, self.first_id + self.num_blocks)

    def count(self, block_ids: Iterable[int]) -> int:
        """How many of the given blocks are host blocks."""
        first, end = self.first_id, self.first_id + self.num_blocks
        return sum(1 for b in block_ids if first <= b < end)
