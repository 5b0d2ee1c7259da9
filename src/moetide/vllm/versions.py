"""Per-seam adapters keyed on vLLM's release series: the few places where the vLLM internals moetide reads differ.

Each adapter names the series it covers (``"0.32"``, ``"0.33"``, ...), as kvcached names a version range per patch;
a series no adapter names is refused in one line, never guessed from its nearest neighbour. What a series needs is
in docs/vllm_plugin/versions.md.

Covering a series here is not supporting it: the plugin serves only what ``plugin.SUPPORTED`` names, because its
engine-side patches (KV sizing, the workers' allocation and line moves) are written against 0.32 alone. The
scheduler-side seams below also run 0.33 and 0.34, checked with no model (scripts/vllm_versions_check.sh).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# the series whose scheduler-side seams (this module's adapters, the scheduler's, the no-model harness's) are known
SCHEDULER_SIDE = ("0.32", "0.33", "0.34")


def series(version: str | None = None) -> str:
    """``"major.minor"`` of a vLLM version string (``"0.32.0"``, ``"0.33.1rc2"``, ``"0.34.0+cpu"``), by default the
    installed vLLM's."""
    if version is None:
        import vllm

        version = vllm.__version__
    match = re.match(r"(\d+)\.(\d+)(?:\.|$|[a-z+])", version)
    if match is None:
        raise RuntimeError(f"moetide cannot read vLLM's version {version!r}")
    return f"{match.group(1)}.{match.group(2)}"


def for_series(seam: str, table: dict[tuple[str, ...], T], version: str | None = None) -> T:
    """The entry of ``table`` (covered series -> adapter) for this vLLM's series; ``RuntimeError`` in one line
    where no entry covers it."""
    found = series(version)
    for covered, adapter in table.items():
        if found in covered:
            return adapter
    known = ", ".join(s for covered in table for s in covered)
    raise RuntimeError(f"moetide has no {seam} adapter for vLLM {found} (it covers {known})")


def require_scheduler_side(version: str | None = None) -> str:
    """The series, where its scheduler-side seams are covered (``SCHEDULER_SIDE``); else ``RuntimeError``."""
    found = series(version)
    if found not in SCHEDULER_SIDE:
        raise RuntimeError(f"moetide's scheduler-side seams cover vLLM {', '.join(SCHEDULER_SIDE)}, not {found}")
    return found


# ---- BlockHashToBlockMap: the block ids cached under one hash -------------------------------------------------
def _holders_by_block(hash_map, key) -> list[int]:
    """0.32, 0.33 (v1/core/block_pool.py): ``_cache[key]`` is a ``KVCacheBlock``, or a dict block id -> block
    where several blocks hold the hash."""
    held = hash_map._cache.get(key)
    if held is None:
        return []
    return list(held) if isinstance(held, dict) else [held.block_id]


def _holders_by_id(hash_map, key) -> list[int]:
    """0.34 (v1/core/block_pool.py): ``_cache[key]`` is one block id, and every id of a hash held by several
    blocks is in ``_dup_ids[key]`` (kept apart so the cache holds no containers)."""
    held = hash_map._cache.get(key)
    if held is None:
        return []
    dups = hash_map._dup_ids.get(key)
    return list(dups) if dups else [held]


HOLDERS: dict[tuple[str, ...], Callable[[object, object], list[int]]] = {
    ("0.32", "0.33"): _holders_by_block,
    ("0.34",): _holders_by_id,
}


def holders_reader(version: str | None = None) -> Callable[[object, object], list[int]]:
    """``reader(block_hash_to_block_map, key) -> block ids`` for this vLLM (``HOLDERS``)."""
    return for_series("BlockHashToBlockMap", HOLDERS, version)


# ---- Scheduler._get_local_prefix_cache_hit: its parameters, which moetide's override passes through -----------
PREFIX_HIT_PARAMETERS: dict[tuple[str, ...], tuple[str, ...]] = {
    ("0.32",): ("self", "request"),
    ("0.33", "0.34"): ("self", "request", "max_cache_hit_length"),  # the aux-output connector's cap on a hit
}


def check_prefix_hit(method, version: str | None = None) -> None:
    """Refuse, in one line, a ``Scheduler._get_local_prefix_cache_hit`` whose parameters are not those its
    series is known to have: moetide's override passes them through and reads the hit's token count."""
    import inspect

    expected = for_series("prefix-cache lookup", PREFIX_HIT_PARAMETERS, version)
    found = tuple(inspect.signature(method).parameters)
    if found != expected:
        raise RuntimeError(f"vLLM {series(version)}'s Scheduler._get_local_prefix_cache_hit takes {found}, not "
                           f"{expected}: moetide's scheduler seam was not written against it")
