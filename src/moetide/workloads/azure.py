"""Azure LLM inference CSV traces (Splitwise, ISCA'24): open loop, arrival and length shape only.

Columns ``TIMESTAMP,ContextTokens,GeneratedTokens`` (found by name in the header, any order). Timestamps are
ISO-like (``2023-11-16 18:17:03.9799600``: seven fractional digits, cut to microseconds; an offset such as
``+00:00`` is honoured); arrivals are seconds after the earliest row. There are no sessions and no prefix
hashes, so every row is a session of one turn with no block keys and ``key_block_size`` is None.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

from moetide.errors import UserError
from moetide.workloads.base import NO_KEYS, Session, Turn, Workload, fail, iter_lines, sorted_sessions, trace_name

COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_FRACTION = re.compile(r"(\.\d{6})\d+")  # datetime takes at most microseconds


def sniff(line: str) -> bool:
    """A CSV header naming the three columns."""
    names = {name.strip() for name in line.strip().split(",")}
    return all(column in names for column in COLUMNS)


def read(path: Path, *, seed: int = 0, session_rate_per_s: float | None = None) -> Workload:
    """Read an Azure trace. ``seed`` is unused (nothing is random); ``session_rate_per_s`` is refused."""
    del seed
    if session_rate_per_s is not None:
        raise UserError(f"{path}: session_rate_per_s applies to closed-loop traces; Azure arrivals are recorded")
    lines = iter_lines(path)
    columns = _header(path, lines)
    rows = []  # (time, line_no, prompt_tokens, output_tokens)
    for line_no, line in lines:
        if line.strip():
            rows.append(_parse_row(line, columns, f"{path}:{line_no}", line_no))
    if not rows:
        raise UserError(f"{path}: the trace has no requests")
    _check_offsets(path, rows)
    t0 = min(row[0] for row in rows)
    sessions = [_session(row, (row[0] - t0).total_seconds()) for row in rows]
    return Workload(
        name=trace_name(path),
        source=str(path),
        mode="open",
        key_block_size=None,
        sessions=sorted_sessions(sessions),
    )


def _header(path: Path, lines: Iterator[tuple[int, str]]) -> dict[str, int]:
    for line_no, line in lines:
        if not line.strip():
            continue
        names = [name.strip() for name in next(csv.reader([line]))]
        missing = [column for column in COLUMNS if column not in names]
        if missing:
            raise UserError(f"{path}:{line_no}: CSV header lacks column(s) {', '.join(missing)}; got {names}")
        return {column: names.index(column) for column in COLUMNS}
    raise UserError(f"{path}: the trace is empty")


def _parse_row(line: str, columns: dict[str, int], where: str, line_no: int) -> tuple[datetime, int, int, int]:
    cells = next(csv.reader([line]))
    if len(cells) <= max(columns.values()):
        raise UserError(f"{where}: expected {len(columns)} columns, got {len(cells)}")
    stamp = cells[columns["TIMESTAMP"]].strip()
    try:
        when = datetime.fromisoformat(_FRACTION.sub(r"\1", stamp))
    except ValueError:
        fail(where, "TIMESTAMP", f"not a date and time like 2023-11-16 18:17:03.97996, got {stamp!r}")
    prompt_tokens = _count(cells, columns, "ContextTokens", where)
    return when, line_no, prompt_tokens, _count(cells, columns, "GeneratedTokens", where)


def _count(cells: list[str], columns: dict[str, int], name: str, where: str) -> int:
    text = cells[columns[name]].strip()
    if not text.isdigit():
        fail(where, name, f"must be an integer >= 0, got {text!r}")
    return int(text)


def _check_offsets(path: Path, rows: list[tuple[datetime, int, int, int]]) -> None:
    """Times with and without a UTC offset cannot be compared; name the first row that differs from the first."""
    naive = rows[0][0].tzinfo is None
    for when, line_no, _, _ in rows:
        if (when.tzinfo is None) != naive:
            fail(f"{path}:{line_no}", "TIMESTAMP", "mixes times with and without a UTC offset")


def _session(row: tuple[datetime, int, int, int], arrival_s: float) -> Session:
    _, line_no, prompt_tokens, output_tokens = row
    turn = Turn(
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        block_keys=NO_KEYS,
        arrival_s=arrival_s,
        think_time_s=0.0,
        cached_tokens=None,
        request_id=f"L{line_no}",
    )
    return Session(session_id=turn.request_id, start_s=arrival_s, turns=(turn,), parent_session_id=None, key_scope="")
