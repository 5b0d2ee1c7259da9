"""Mooncake JSONL traces (FAST'25): open loop, recorded arrival times, global 512-token prefix-block ids.

One request a line: ``{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}``,
optionally with ``session_id``, ``turn`` and ``cached_tokens``. Ids are global to the file (key scope ``""``) and
chained: equal id at position i means the same whole prefix up to block i.

``hash_ids`` may have any length. Mooncake's own files have ``ceil(input_length / 512)`` ids, the last (partial)
block included; files in this format written by other tools hash full blocks only (``input_length // 512`` ids),
or cut their blocks by characters rather than tokens and so carry more or fewer ids than either rule. A recorded
SWE-bench agent trace converted by a third party has fewer than ``ceil`` on 1,170 of its 2,009 lines and more on
429, so refusing such lines would refuse the file. Instead the leading ids key the leading full blocks: the
``block_keys`` are the first ``min(len(hash_ids), input_length // 512)`` ids. A partial block has no reusable
identity, so its id is dropped, and so is any id past it. Full blocks without an id are private: the replay
salts them with the request's own salt (``core.hashing.external_block_hashes``), so they can hit only for that
request (a preempted one resuming), never for another, not even a later turn of the same session. Lines with
fewer ids than full blocks, or more than ``ceil``, are counted and reported in one warning line on stderr per
file (``floor`` and ``ceil`` are both silent); the ids themselves, extras included, must still be integers >= 0.

Lines without ``session_id`` are sessions of one turn each; lines with one are grouped into that session, in
arrival order, and every turn keeps its own arrival time (open loop throughout). Arrival times are seconds
after the earliest timestamp (the first line, in the published traces, whose timestamps are sorted).
Every line is validated; the first bad one stops the read with a ``UserError`` naming ``path:line`` and field.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from moetide.errors import UserError
from moetide.units import cdiv
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
    id_counts: Counter[str] = Counter()
    for line_no, line in iter_lines(path):
        if line.strip():
            records.append(_parse_line(line, f"{path}:{line_no}", line_no, id_counts))
    if not records:
        raise UserError(f"{path}: the trace has no requests")
    _warn_id_counts(path, len(records), id_counts)
    return Workload(
        name=trace_name(path),
        source=str(path),
        mode="open",
        key_block_size=KEY_BLOCK_SIZE,
        sessions=_group(records),
    )


def _parse_line(
    line: str, where: str, line_no: int, id_counts: Counter[str]
) -> tuple[float, int, int, str | None, Turn]:
    """``(timestamp_ms, turn, line_no, session_id, Turn)``; the Turn's arrival is fixed in ``_group``."""
    obj = parse_object(line, where)
    timestamp_ms = get_number(obj, "timestamp", where)
    input_length = get_int(obj, "input_length", where)
    output_length = get_int(obj, "output_length", where)
    keys = _full_block_keys(obj, input_length, where, id_counts)
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


def _full_block_keys(obj: dict[str, Any], input_length: int, where: str, id_counts: Counter[str]) -> BlockKeys:
    """The ids of the full blocks that have one; counts the line in ``id_counts`` under ``fewer`` or ``more``
    when its ids are fewer than its full blocks or more than ``ceil(input_length / 512)``."""
    hash_ids = obj.get("hash_ids")
    if not isinstance(hash_ids, list):
        fail(where, "hash_ids", "missing" if "hash_ids" not in obj else f"must be a list, got {hash_ids!r}")
    for key in hash_ids:
        if type(key) is not int or key < 0:
            fail(where, "hash_ids", f"ids must be integers >= 0, got {key!r}")
    num_full_blocks = input_length // KEY_BLOCK_SIZE
    if len(hash_ids) < num_full_blocks:
        id_counts["fewer"] += 1
    elif len(hash_ids) > cdiv(input_length, KEY_BLOCK_SIZE):
        id_counts["more"] += 1
    return BlockKeys.from_keys(hash_ids[:num_full_blocks])


def _warn_id_counts(path: Path, num_lines: int, id_counts: Counter[str]) -> None:
    """One line on stderr for the whole file: a third-party trace is read, but its user should know how."""
    parts = []
    if id_counts["fewer"]:
        parts.append(f"{id_counts['fewer']:,} of {num_lines:,} lines have fewer hash_ids than full 512-token blocks "
                     "(their last blocks are private)")
    if id_counts["more"]:
        of_lines = "" if parts else f" of {num_lines:,} lines"
        parts.append(f"{id_counts['more']:,}{of_lines} have more than ceil(input_length/512) (the extra ids are "
                     "ignored)")
    if parts:
        print(f"warning: {path}: {'; '.join(parts)}", file=sys.stderr)


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
