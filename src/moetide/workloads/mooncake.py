"""Mooncake JSONL traces (FAST'25): open loop, recorded arrival times, global 512-token prefix-block ids.

One request a line: ``{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}``,
optionally with ``session_id``, ``turn`` and ``cached_tokens``. ``hash_ids`` has ``ceil(input_length / 512)``
ids, the last (partial) block included; a partial block has no reusable identity, so only the
``input_length // 512`` full blocks become ``block_keys``. Ids are global to the file (key scope ``""``) and
chained: equal id at position i means the same whole prefix up to block i.

Lines without ``session_id`` are sessions of one turn each; lines with one are grouped into that session, in
arrival order, and every turn keeps its own arrival time (open loop throughout). Arrival times are seconds
after the earliest timestamp (the first line, in the published traces, whose timestamps are sorted).
Every line is validated; the first bad one stops the read with a ``UserError`` naming ``path:line`` and field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from moetide.errors import UserError
from moetide.workloads.base import (
    BlockKeys,
    Session,
    Turn,
    Workload,
    fail,
    get_int,
    get_number,
    iter_lines,
    parse_object,
    sorted_sessions,
    trace_name,
    with_arrival,
)

KEY_BLOCK_SIZE = 512  # tokens per hash id in Mooncake's traces (FAST25-release/README.md)


def sniff(line: str) -> bool:
    """A JSON object with ``hash_ids`` and ``input_length``."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError:
        return False
    return isinstance(obj, dict) and "hash_ids" in obj and "input_length" in obj


def read(path: Path, *, seed: int = 0, session_rate_per_s: float | None = None) -> Workload:
    """Read a Mooncake trace. ``seed`` is unused (nothing is random); ``session_rate_per_s`` is refused."""
    del seed
    if session_rate_per_s is not None:
        raise UserError(f"{path}: session_rate_per_s applies to closed-loop traces; Mooncake arrivals are recorded")
    records = []
    for line_no, line in iter_lines(path):
        if line.strip():
            records.append(_parse_line(line, f"{path}:{line_no}", line_no))
    if not records:
        raise UserError(f"{path}: the trace has no requests")
    return Workload(
        name=trace_name(path),
        source=str(path),
        mode="open",
        key_block_size=KEY_BLOCK_SIZE,
        sessions=_group(records),
    )


def _parse_line(line: str, where: str, line_no: int) -> tuple[float, int, int, str | None, Turn]:
    """``(timestamp_ms, turn, line_no, session_id, Turn)``; the Turn's arrival is fixed in ``_group``."""
    obj = parse_object(line, where)
    timestamp_ms = get_number(obj, "timestamp", where)
    input_length = get_int(obj, "input_length", where)
    output_length = get_int(obj, "output_length", where)
    keys = _full_block_keys(obj, input_length, where)
    turn_index = get_int(obj, "turn", where, optional=True)
    cached_tokens = get_int(obj, "cached_tokens", where, optional=True)
    if cached_tokens is not None and cached_tokens > input_length:
        fail(where, "cached_tokens", f"{cached_tokens} exceeds input_length {input_length}")
    turn = Turn(
        prompt_tokens=input_length,
        output_tokens=output_length,
        block_keys=keys,
        arrival_s=None,
        think_time_s=0.0,
        cached_tokens=cached_tokens,
        request_id=f"L{line_no}",
    )
    return timestamp_ms, turn_index or 0, line_no, _session_id(obj, where), turn


def _full_block_keys(obj: dict[str, Any], input_length: int, where: str) -> BlockKeys:
    hash_ids = obj.get("hash_ids")
    if not isinstance(hash_ids, list):
        fail(where, "hash_ids", "missing" if "hash_ids" not in obj else f"must be a list, got {hash_ids!r}")
    expected = -(-input_length // KEY_BLOCK_SIZE)
    if len(hash_ids) != expected:
        fail(where, "hash_ids", f"has {len(hash_ids)} ids, expected ceil(input_length/512) = {expected}")
    for key in hash_ids:
        if type(key) is not int or key < 0:
            fail(where, "hash_ids", f"ids must be integers >= 0, got {key!r}")
    return BlockKeys.from_keys(hash_ids[: input_length // KEY_BLOCK_SIZE])


def _session_id(obj: dict[str, Any], where: str) -> str | None:
    value = obj.get("session_id")
    if value is None:
        return None
    if type(value) not in (str, int) or value == "":
        fail(where, "session_id", f"must be a non-empty string or an integer, got {value!r}")
    return str(value)


def _group(records: list[tuple[float, int, int, str | None, Turn]]) -> tuple[Session, ...]:
    t0_ms = min(record[0] for record in records)
    by_session: dict[tuple[bool, str], list[tuple[float, int, int, Turn]]] = {}
    for timestamp_ms, turn_index, line_no, session_id, turn in records:
        key = (True, session_id) if session_id is not None else (False, turn.request_id)
        by_session.setdefault(key, []).append(((timestamp_ms - t0_ms) / 1000.0, turn_index, line_no, turn))
    sessions = []
    for (_, session_id), entries in by_session.items():
        entries.sort(key=lambda entry: entry[:3])
        turns = tuple(with_arrival(turn, arrival_s) for arrival_s, _, _, turn in entries)
        sessions.append(
            Session(session_id=session_id, start_s=entries[0][0], turns=turns, parent_session_id=None, key_scope="")
        )
    return sorted_sessions(sessions)
