"""Trace readers by name, format sniffing, and the subsets every reader shares.

``READERS`` maps a format name to a ``TraceReader`` (one module each, the same shape: ``sniff(first_line)`` and
``read(path, *, seed, session_rate_per_s)``), so adding a format is one module and one line here.

Subsets work on session *families* (a top-level session and its sub-agents, which only make sense together)
and are applied in this order, each to what the previous left:
1. ``time_window=(start_s, end_s)``: open loop keeps turns arriving in ``[start_s, end_s)``; closed loop keeps
   families whose top-level session starts in it. Times are then shifted so ``start_s`` becomes 0.
2. ``sessions=N``: the first N families by start time.
3. ``max_requests=N``: open loop keeps the first N turns in arrival order (ties in session order); closed loop
   keeps whole families in start order until at least N requests are kept (a session is never cut, so the last
   family can take the count past N).
A subset is a true subset of the full workload: WEKA's start times are drawn for all sessions first.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from moetide.errors import UserError
from moetide.workloads import azure, mooncake, weka
from moetide.workloads.base import Session, Turn, Workload, first_line, with_arrival


@dataclass(frozen=True)
class TraceReader:
    name: str
    read: Callable[..., Workload]  # read(path, *, seed, session_rate_per_s) -> Workload
    sniff: Callable[[str], bool]  # does the file's first non-empty line look like this format?
    summary: str
    first_line: str  # what ``sniff`` looks for, said to a user whose file it did not recognise


READERS: dict[str, TraceReader] = {
    "mooncake": TraceReader("mooncake", mooncake.read, mooncake.sniff, "Mooncake JSONL, open loop, 512-token keys",
                            "a Mooncake JSON line with 'hash_ids'"),
    "weka": TraceReader("weka", weka.read, weka.sniff, "WEKA agent sessions, closed loop, 64-token keys",
                        "a WEKA line with 'kind'"),
    "azure": TraceReader("azure", azure.read, azure.sniff, "Azure CSV, open loop, no keys",
                         "the Azure CSV header TIMESTAMP,ContextTokens,GeneratedTokens"),
}


def sniff_format(path: Path) -> str:
    """The name of the one reader whose ``sniff`` accepts the file's first non-empty line."""
    line = first_line(Path(path))
    for name, reader in READERS.items():
        if reader.sniff(line):
            return name
    raise UserError(f"{path}: cannot tell the trace format from its first line (expected one of: "
                    f"{'; '.join(reader.first_line for reader in READERS.values())}); name it with --format, one "
                    f"of {', '.join(READERS)}")


def load_workload(
    path: str | Path,
    fmt: str | None = None,
    *,
    seed: int,
    session_rate_per_s: float | None = None,
    max_requests: int | None = None,
    time_window: tuple[float, float] | None = None,
    sessions: int | None = None,
) -> Workload:
    """Read a trace (format sniffed when ``fmt`` is None) and apply the subsets described in this module."""
    path = Path(path)
    name = fmt if fmt is not None else sniff_format(path)
    if name not in READERS:
        raise UserError(f"unknown trace format {name!r}; choose one of {', '.join(READERS)}")
    workload = READERS[name].read(path, seed=seed, session_rate_per_s=session_rate_per_s)
    return select(workload, max_requests=max_requests, time_window=time_window, sessions=sessions)


def select(
    workload: Workload,
    *,
    max_requests: int | None = None,
    time_window: tuple[float, float] | None = None,
    sessions: int | None = None,
) -> Workload:
    """The subset of ``workload`` the arguments name (all None: ``workload`` itself)."""
    _check_count("max_requests", max_requests)
    _check_count("sessions", sessions)
    out = workload
    if time_window is not None:
        start_s, end_s = _check_window(time_window)
        out = _window_open(out, start_s, end_s) if out.mode == "open" else _window_closed(out, start_s, end_s)
    if sessions is not None:
        out = _keep_families(out, _families(out)[:sessions])
    if max_requests is not None:
        out = _first_open(out, max_requests) if out.mode == "open" else _first_closed(out, max_requests)
    if out.num_requests == 0:
        raise UserError(
            f"{workload.source}: the subset (time_window={time_window}, sessions={sessions}, "
            f"max_requests={max_requests}) selects no requests"
        )
    return out


def _check_count(name: str, value: int | None) -> None:
    if value is not None and (type(value) is not int or value < 1):
        raise UserError(f"{name} must be a whole number >= 1, got {value!r}")


def _check_window(window: tuple[float, float]) -> tuple[float, float]:
    try:
        start_s, end_s = (float(value) for value in window)
    except (TypeError, ValueError):
        raise UserError(f"time_window must be (start_s, end_s), got {window!r}") from None
    if not (math.isfinite(start_s) and 0 <= start_s < end_s):
        raise UserError(f"time_window needs 0 <= start_s < end_s, got {window!r}")
    return start_s, end_s


def _families(workload: Workload) -> list[list[Session]]:
    """Top-level sessions with their (nested) sub-agents, in the order the top-level sessions start."""
    by_id = {session.session_id: session for session in workload.sessions}
    members: dict[str, list[Session]] = {}
    for session in workload.sessions:
        root = session
        while root.parent_session_id in by_id:
            root = by_id[root.parent_session_id]
        if root is not session:
            members.setdefault(root.session_id, []).append(session)
    roots = [session for session in workload.sessions if session.parent_session_id not in by_id]
    return [[root, *members.get(root.session_id, ())] for root in sorted(roots, key=lambda root: root.start_s)]


def _keep_families(workload: Workload, families: Iterable[list[Session]]) -> Workload:
    kept = {session.session_id for family in families for session in family}
    return _with(workload, (session for session in workload.sessions if session.session_id in kept))


def _with(workload: Workload, sessions: Iterable[Session]) -> Workload:
    return dataclasses.replace(workload, sessions=tuple(sessions))


def _filter_open(workload: Workload, keep: Callable[[Turn], bool], shift_s: float = 0.0) -> Workload:
    """Open loop: keep some turns of each session; a session's start moves to its first kept turn."""
    sessions = []
    for session in workload.sessions:
        turns = tuple(
            with_arrival(turn, turn.arrival_s - shift_s) if shift_s else turn for turn in session.turns if keep(turn)
        )
        if turns:
            sessions.append(dataclasses.replace(session, start_s=turns[0].arrival_s, turns=turns))
    return _with(workload, sessions)


def _window_open(workload: Workload, start_s: float, end_s: float) -> Workload:
    return _filter_open(workload, lambda turn: start_s <= turn.arrival_s < end_s, shift_s=start_s)


def _window_closed(workload: Workload, start_s: float, end_s: float) -> Workload:
    families = [family for family in _families(workload) if start_s <= family[0].start_s < end_s]
    kept = _keep_families(workload, families)
    return _with(kept, (_shift_closed(session, start_s) for session in kept.sessions))


def _shift_closed(session: Session, shift_s: float) -> Session:
    start_s = session.start_s - shift_s
    turns = (with_arrival(session.turns[0], start_s), *session.turns[1:])
    return dataclasses.replace(session, start_s=start_s, turns=turns)


def _first_open(workload: Workload, max_requests: int) -> Workload:
    order = [
        (turn.arrival_s, session_index, turn_index, id(turn))
        for session_index, session in enumerate(workload.sessions)
        for turn_index, turn in enumerate(session.turns)
    ]
    order.sort()
    kept = {entry[3] for entry in order[:max_requests]}
    return _filter_open(workload, lambda turn: id(turn) in kept)


def _first_closed(workload: Workload, max_requests: int) -> Workload:
    families, total = [], 0
    for family in _families(workload):
        if total >= max_requests:
            break
        families.append(family)
        total += sum(len(session.turns) for session in family)
    return _keep_families(workload, families)
