"""The workload data model shared by every trace reader and the generator, and the helpers readers share.

A ``Workload`` is a tuple of ``Session``s, each a tuple of ``Turn``s (one request each). Open-loop workloads give
every turn an absolute ``arrival_s``; closed-loop ones give it to a session's first turn only, and each later turn
is sent ``think_time_s`` after the previous one completes — so the replay, not the trace, decides when it goes.

``BlockKeys`` is why a whole WEKA file fits in memory: its 49,334 prompts name 94 million 64-token blocks, which
as tuples of ints would take gigabytes and a minute to build, but a prompt's block ids come in a few runs of
consecutive ints (3.3 on average), so each prompt is stored as its runs. It is an immutable ``Sequence[int]`` that
compares equal to the tuple of its keys; slicing returns a plain tuple (what hashing code wants), ``prefix(n)``
a compact prefix.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
from bisect import bisect_right
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any, Literal, NoReturn

from moetide.errors import UserError

Mode = Literal["open", "closed"]
GZIP_MAGIC = b"\x1f\x8b"


class BlockKeys(Sequence[int]):
    """Immutable sequence of block keys stored as runs ``(start, length)`` of consecutive ints.

    Runs are normalised (adjacent runs merged, empty ones dropped), so two ``BlockKeys`` are equal exactly when
    their runs are. Equal to a tuple with the same keys, and hashes like it.
    """

    __slots__ = ("_runs", "_ends", "_hash")

    def __init__(self, runs: Iterable[tuple[int, int]] = ()) -> None:
        merged: list[tuple[int, int]] = []
        ends: list[int] = []
        total = end = 0
        for start, length in runs:
            if length < 0:
                raise ValueError(f"run length must be >= 0, got {length}")
            if not length:
                continue
            if merged and start == end:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
                ends[-1] += length
            else:
                merged.append((start, length))
                ends.append(total + length)
            total, end = total + length, start + length
        self._runs = tuple(merged)
        self._ends = tuple(ends)
        self._hash: int | None = None

    @classmethod
    def from_keys(cls, keys: Iterable[int]) -> BlockKeys:
        """Compress a plain sequence of keys into runs."""
        runs: list[tuple[int, int]] = []
        start = prev = None
        for key in keys:
            if prev is not None and key == prev + 1:
                prev = key
                continue
            if start is not None:
                runs.append((start, prev - start + 1))
            start = prev = key
        if start is not None:
            runs.append((start, prev - start + 1))
        return cls(runs)

    @property
    def runs(self) -> tuple[tuple[int, int], ...]:
        return self._runs

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def __iter__(self) -> Iterator[int]:
        return chain.from_iterable(range(start, start + length) for start, length in self._runs)

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return self._slice(index)
        size = len(self)
        if index < 0:
            index += size
        if not 0 <= index < size:
            raise IndexError("BlockKeys index out of range")
        run = bisect_right(self._ends, index)
        before = self._ends[run - 1] if run else 0
        return self._runs[run][0] + index - before

    def _slice(self, index: slice) -> tuple[int, ...]:
        lo, hi, step = index.indices(len(self))
        if step != 1:
            return tuple(self)[index]
        out: list[range] = []
        run = bisect_right(self._ends, lo)
        while lo < hi and run < len(self._runs):
            before = self._ends[run - 1] if run else 0
            start = self._runs[run][0]
            stop = min(hi, self._ends[run])
            out.append(range(start + lo - before, start + stop - before))
            lo, run = stop, run + 1
        return tuple(out[0]) if len(out) == 1 else tuple(chain.from_iterable(out))

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, int):
            return super().__contains__(key)  # e.g. 2.0 == 2, as for a tuple
        return any(start <= key < start + length for start, length in self._runs)

    def prefix(self, num_keys: int) -> BlockKeys:
        """The first ``num_keys`` keys, still run-length encoded."""
        runs, left = [], max(0, num_keys)
        for start, length in self._runs:
            if left <= 0:
                break
            runs.append((start, min(length, left)))
            left -= length
        return BlockKeys(runs)

    def common_prefix_len(self, other: BlockKeys) -> int:
        """Number of leading keys equal in ``self`` and ``other``, in time linear in the number of runs."""
        a, b, i, j, off_a, off_b, total = self._runs, other._runs, 0, 0, 0, 0, 0
        while i < len(a) and j < len(b):
            if a[i][0] + off_a != b[j][0] + off_b:
                break
            step = min(a[i][1] - off_a, b[j][1] - off_b)
            total, off_a, off_b = total + step, off_a + step, off_b + step
            if off_a == a[i][1]:
                i, off_a = i + 1, 0
            if off_b == b[j][1]:
                j, off_b = j + 1, 0
        return total

    def __eq__(self, other: object) -> bool:
        if isinstance(other, BlockKeys):
            return self._runs == other._runs
        if isinstance(other, tuple):
            return len(other) == len(self) and tuple(self) == other
        return NotImplemented

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(tuple(self))
        return self._hash

    def __repr__(self) -> str:
        return f"BlockKeys({list(self._runs)!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (BlockKeys, (self._runs,))


NO_KEYS = BlockKeys()


@dataclass(frozen=True, slots=True, kw_only=True)
class Turn:
    """One request. ``block_keys`` name the prompt's full key blocks in order (see ``Workload.key_block_size``)."""

    prompt_tokens: int
    output_tokens: int
    block_keys: BlockKeys
    arrival_s: float | None  # absolute send time (open loop; a closed-loop session's first turn); else None
    think_time_s: float  # closed loop: previous turn's completion -> this send; 0.0 for a first turn
    cached_tokens: int | None  # prefix tokens the recording system found cached, where the trace says
    request_id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Session:
    """A conversation or agent context. Keys of sessions with the same ``key_scope`` share one namespace."""

    session_id: str
    start_s: float
    turns: tuple[Turn, ...]
    parent_session_id: str | None  # the context that started this sub-agent; None for a top-level session
    key_scope: str  # "" where the trace's ids are global (Mooncake); the WEKA session id where they are local


@dataclass(frozen=True)
class Workload:
    """A replayable set of sessions, ordered by start time (ties in trace order)."""

    name: str
    source: str  # the trace's path, or "builtin:generator"
    mode: Mode
    key_block_size: int | None  # tokens per block key: 512 Mooncake, 64 WEKA and the generator, None without keys
    sessions: tuple[Session, ...]

    def __post_init__(self) -> None:
        if self.mode not in ("open", "closed"):
            raise ValueError(f"mode must be 'open' or 'closed', got {self.mode!r}")
        if self.key_block_size is not None and self.key_block_size <= 0:
            raise ValueError(f"key_block_size must be positive or None, got {self.key_block_size}")
        ids = {session.session_id for session in self.sessions}
        if len(ids) != len(self.sessions):
            raise ValueError("session ids must be unique")
        for session in self.sessions:
            _check_session(session, self.mode)

    @property
    def num_requests(self) -> int:
        return sum(len(session.turns) for session in self.sessions)

    @property
    def num_sessions(self) -> int:
        return len(self.sessions)


def _check_session(session: Session, mode: Mode) -> None:
    if not session.turns:
        raise ValueError(f"session {session.session_id!r} has no turns")
    if mode == "open":
        if any(turn.arrival_s is None for turn in session.turns):
            raise ValueError(f"open-loop session {session.session_id!r} has a turn without arrival_s")
        return
    if session.turns[0].arrival_s != session.start_s:
        raise ValueError(f"closed-loop session {session.session_id!r}: first turn must arrive at start_s")
    if any(turn.arrival_s is not None for turn in session.turns[1:]):
        raise ValueError(f"closed-loop session {session.session_id!r}: later turns must have arrival_s None")


def sorted_sessions(sessions: Iterable[Session]) -> tuple[Session, ...]:
    """Sessions by start time; ``sorted`` is stable, so ties keep trace order."""
    return tuple(sorted(sessions, key=lambda session: session.start_s))


def with_arrival(turn: Turn, arrival_s: float | None) -> Turn:
    return dataclasses.replace(turn, arrival_s=arrival_s)


def trace_name(path: Path) -> str:
    """``conversation_trace.jsonl.gz`` -> ``conversation_trace``."""
    return path.name.split(".")[0]


# ---- reading files ---------------------------------------------------------------------------------------------


def is_gzip(path: Path) -> bool:
    """Gzip is detected by its magic bytes, whatever the file is called."""
    try:
        with open(path, "rb") as f:
            return f.read(2) == GZIP_MAGIC
    except OSError as exc:
        raise UserError(f"{path}: cannot open trace: {exc.strerror or exc}") from None


def iter_lines(path: Path) -> Iterator[tuple[int, str]]:
    """``(line_no, line)`` from 1, gzip or not; read errors become a ``UserError`` naming the line."""
    opener = gzip.open if is_gzip(path) else open
    line_no = 0
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                yield line_no, line
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}:{line_no + 1}: cannot read trace: {exc}") from None


def first_line(path: Path) -> str:
    for _, line in iter_lines(path):
        if line.strip():
            return line
    raise UserError(f"{path}: the trace is empty")


# ---- validating trace fields -----------------------------------------------------------------------------------


def fail(where: str, name: str, problem: str) -> NoReturn:
    raise UserError(f"{where}: field {name!r}: {problem}")


def parse_object(line: str, where: str) -> dict[str, Any]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise UserError(f"{where}: not valid JSON: {exc.msg} (column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    return obj


def get_int(obj: dict[str, Any], name: str, where: str, *, optional: bool = False) -> int | None:
    """A non-negative int field (bools rejected)."""
    value = obj.get(name)
    if value is None:
        if optional:
            return None
        fail(where, name, "missing" if name not in obj else "must not be null")
    if type(value) is not int:
        fail(where, name, f"must be an integer, got {value!r}")
    if value < 0:
        fail(where, name, f"must be >= 0, got {value}")
    return value


def get_number(obj: dict[str, Any], name: str, where: str, *, optional: bool = False) -> float | None:
    """A finite, non-negative number field."""
    value = obj.get(name)
    if value is None:
        if optional:
            return None
        fail(where, name, "missing" if name not in obj else "must not be null")
    if type(value) not in (int, float) or not math.isfinite(value):
        fail(where, name, f"must be a finite number, got {value!r}")
    if value < 0:
        fail(where, name, f"must be >= 0, got {value}")
    return float(value)


def get_str(obj: dict[str, Any], name: str, where: str) -> str:
    value = obj.get(name)
    if not isinstance(value, str) or not value:
        fail(where, name, "missing" if name not in obj else f"must be a non-empty string, got {value!r}")
    return value


def within_model_len(workload: Workload, max_model_len: int) -> tuple[Workload, int]:
    """The workload without the requests whose prompt plus output exceed ``max_model_len`` (vLLM answers them
    with an error and never schedules them), and how many were left out. In a closed-loop session the next kept
    turn follows the last kept one; a session whose first turn goes starts with the next, at the same time."""
    sessions, dropped = [], 0
    for session in workload.sessions:
        turns = [t for t in session.turns if t.prompt_tokens + t.output_tokens <= max_model_len]
        dropped += len(session.turns) - len(turns)
        if not turns:
            continue
        if workload.mode == "closed" and turns[0] is not session.turns[0]:
            turns[0] = dataclasses.replace(turns[0], arrival_s=session.start_s, think_time_s=0.0)
        sessions.append(session if len(turns) == len(session.turns) else
                        dataclasses.replace(session, turns=tuple(turns)))
    if not sessions:
        raise UserError(f"--max-model-len {max_model_len}: every request of {workload.name} is longer")
    return dataclasses.replace(workload, sessions=tuple(sessions)), dropped
