"""WEKA's Claude Code agent traces (kv-cache-tester, compact JSONL): closed-loop sessions with sub-agents.

Lines are ``session`` headers, ``request``s and ``subagent_marker``s (format: the trace folder's SOURCE.txt).
Block ids name 64-token blocks and are session-local (``hash_id_scope: "local"``), shared by all contexts of a
session, so every context's ``key_scope`` is its WEKA session id. Sub-agents never reuse the main context's
blocks (no block of the 63 sub-agent contexts appears in its main context), but sibling sub-agents share their
own system prompt and tools (67% of their first prompts' blocks appear in an earlier sibling).

The trace records no absolute start times, so sessions start as a Poisson process (rate ``session_rate_per_s``,
``random.Random(seed)``; the first at 0, then exponential gaps, in file order). Inside a context, turn ``i``
follows turn ``i-1``'s completion by its recorded ``think_time`` (where that is null: ``t`` minus the previous
turn's ``t`` and ``api_time``). Each sub-agent context ``main/saN`` (or nested ``main/saN/saM``) becomes a child
``Session`` starting at its parent's start + ``marker.t - duration_ms / 1000``: the marker is written when the
Task tool returns, so ``t`` is the sub-agent's end for a synchronous sub-agent (with that correction, 57 of the
59 timed starts land 0.1-1.1 s after the launching parent turn completes) and its launch for a background one
(``duration_ms`` null). The sub-agent's own requests restart their ``t`` at 0, so their ``t`` cannot place it.
The parent's later think times already include the time it waited for a synchronous sub-agent.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
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
    get_str,
    iter_lines,
    parse_object,
    sorted_sessions,
    trace_name,
)

KEY_BLOCK_SIZE = 64  # tokens per hash id (each session line's block_size)
# One session a minute: with the measured mean of 618 s of API time per session (sub-agents included), about
# ten requests are in flight on average at the recorded service speed; the 710 sessions arrive over ~12 h.
DEFAULT_SESSION_RATE_PER_S = 1 / 60
_CTX = re.compile(r"main(/[^/]+)*")


def sniff(line: str) -> bool:
    """A JSON object whose ``kind`` is one of WEKA's line kinds."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError:
        return False
    return isinstance(obj, dict) and obj.get("kind") in ("session", "request", "subagent_marker")


@dataclass(slots=True)
class _Request:
    turn_index: int
    t_s: float
    api_time_s: float | None
    think_time_s: float | None
    prompt_tokens: int
    output_tokens: int
    block_keys: BlockKeys
    where: str


@dataclass
class _Trace:
    """What the lines say, before start times are drawn."""

    path: Path
    block_size: int | None = None
    scopes: dict[str, str] = field(default_factory=dict)  # session -> key scope, in file order
    ctxs: dict[str, dict[str, list[_Request]]] = field(default_factory=dict)  # session -> ctx -> requests
    offsets: dict[tuple[str, str], float] = field(default_factory=dict)  # (session, child ctx) -> start offset

    def on_session(self, obj: dict[str, Any], where: str) -> None:
        session = get_str(obj, "session", where)
        if session in self.scopes:
            fail(where, "session", f"{session!r} has a second session line")
        block_size = get_int(obj, "block_size", where)
        if block_size == 0 or self.block_size not in (None, block_size):
            fail(where, "block_size", f"must be one positive size for the whole file, got {block_size}")
        self.block_size = block_size
        scope = obj.get("hash_id_scope", "local")
        if scope not in ("local", "global"):
            fail(where, "hash_id_scope", f"must be 'local' or 'global', got {scope!r}")
        self.scopes[session] = session if scope == "local" else ""
        self.ctxs[session] = {}

    def on_request(self, obj: dict[str, Any], where: str) -> None:
        session, ctx = self._session(obj, where), _ctx(obj, "ctx", where)
        prompt_tokens = get_int(obj, "in", where)
        request = _Request(
            turn_index=get_int(obj, "turn", where),
            t_s=get_number(obj, "t", where),
            api_time_s=get_number(obj, "api_time", where, optional=True),
            think_time_s=get_number(obj, "think_time", where, optional=True),
            prompt_tokens=prompt_tokens,
            output_tokens=get_int(obj, "out", where),
            block_keys=_keys(obj.get("hash_runs"), prompt_tokens // self.block_size, where),
            where=where,
        )
        self.ctxs[session].setdefault(ctx, []).append(request)

    def on_marker(self, obj: dict[str, Any], where: str) -> None:
        session, parent, child = self._session(obj, where), _ctx(obj, "ctx", where), _ctx(obj, "child_ctx", where)
        if child.rpartition("/")[0] != parent:
            fail(where, "child_ctx", f"{child!r} is not a direct child of ctx {parent!r}")
        if (session, child) in self.offsets:
            fail(where, "child_ctx", f"{child!r} has a second subagent_marker")
        t_s = get_number(obj, "t", where)
        duration_ms = get_int(obj, "duration_ms", where, optional=True)
        self.offsets[(session, child)] = max(0.0, t_s - (duration_ms or 0) / 1000.0)

    def _session(self, obj: dict[str, Any], where: str) -> str:
        session = get_str(obj, "session", where)
        if session not in self.scopes:
            fail(where, "session", f"{session!r} has no session line before this one")
        return session


def _ctx(obj: dict[str, Any], name: str, where: str) -> str:
    ctx = get_str(obj, name, where)
    if not _CTX.fullmatch(ctx):
        fail(where, name, f"must be 'main' or 'main/<sub-agent>[/...]', got {ctx!r}")
    return ctx


def _keys(hash_runs: Any, num_blocks: int, where: str) -> BlockKeys:
    if not isinstance(hash_runs, list):
        fail(where, "hash_runs", f"must be a list of [start, length] pairs, got {hash_runs!r}")
    total = 0
    for run in hash_runs:
        if not (type(run) is list and len(run) == 2 and type(run[0]) is int and type(run[1]) is int):
            fail(where, "hash_runs", f"each run must be [start, length] integers, got {run!r}")
        if run[0] < 0 or run[1] < 1:
            fail(where, "hash_runs", f"run {run!r} needs start >= 0 and length >= 1")
        total += run[1]
    if total != num_blocks:
        fail(where, "hash_runs", f"covers {total} blocks, expected floor(in / block_size) = {num_blocks}")
    return BlockKeys(hash_runs)


def read(path: Path, *, seed: int = 0, session_rate_per_s: float | None = None) -> Workload:
    """Read a WEKA trace; sessions start as a Poisson process at ``session_rate_per_s`` (seeded)."""
    rate = DEFAULT_SESSION_RATE_PER_S if session_rate_per_s is None else session_rate_per_s
    if not rate > 0:
        raise UserError(f"session_rate_per_s must be > 0, got {session_rate_per_s}")
    trace = _parse(path)
    rng = random.Random(seed)
    sessions: list[Session] = []
    start_s = 0.0
    for index, session in enumerate(s for s, ctxs in trace.ctxs.items() if ctxs):
        start_s += rng.expovariate(rate) if index else 0.0
        sessions.extend(_family(trace, session, start_s))
    if not sessions:
        raise UserError(f"{path}: the trace has no requests")
    return Workload(
        name=trace_name(path),
        source=str(path),
        mode="closed",
        key_block_size=trace.block_size,
        sessions=sorted_sessions(sessions),
    )


def _parse(path: Path) -> _Trace:
    trace = _Trace(path)
    handlers = {"session": trace.on_session, "request": trace.on_request, "subagent_marker": trace.on_marker}
    for line_no, line in iter_lines(path):
        if not line.strip():
            continue
        where = f"{path}:{line_no}"
        obj = parse_object(line, where)
        handler = handlers.get(obj.get("kind"))
        if handler is None:
            fail(where, "kind", f"must be one of {sorted(handlers)}, got {obj.get('kind')!r}")
        handler(obj, where)
    return trace


def _family(trace: _Trace, session: str, start_s: float) -> list[Session]:
    """The main context and its sub-agents, each placed in time from its parent's start."""
    ctxs = trace.ctxs[session]
    if "main" not in ctxs:
        raise UserError(f"{trace.path}: session {session!r} has sub-agent requests but no 'main' requests")
    starts = {"main": start_s}
    out = []
    for ctx in sorted(ctxs, key=lambda name: name.count("/")):
        parent = ctx.rpartition("/")[0] or None
        if parent is not None:
            if (session, ctx) not in trace.offsets or parent not in starts:
                where = ctxs[ctx][0].where
                raise UserError(f"{where}: sub-agent ctx {ctx!r} has no subagent_marker or no parent requests")
            starts[ctx] = starts[parent] + trace.offsets[(session, ctx)]
        out.append(
            Session(
                session_id=session if parent is None else f"{session}/{ctx}",
                start_s=starts[ctx],
                turns=_turns(session, ctx, ctxs[ctx], starts[ctx]),
                parent_session_id=None if parent is None else (session if parent == "main" else f"{session}/{parent}"),
                key_scope=trace.scopes[session],
            )
        )
    return out


def _turns(session: str, ctx: str, requests: list[_Request], start_s: float) -> tuple[Turn, ...]:
    requests.sort(key=lambda request: request.turn_index)
    turns = []
    for index, request in enumerate(requests):
        if request.turn_index != index:
            fail(request.where, "turn", _turn_gap(ctx, requests[index - 1] if index else None, request, index))
        turns.append(
            Turn(
                prompt_tokens=request.prompt_tokens,
                output_tokens=request.output_tokens,
                block_keys=request.block_keys,
                arrival_s=start_s if index == 0 else None,
                think_time_s=0.0 if index == 0 else _think_time(requests[index - 1], request),
                cached_tokens=None,
                request_id=f"{session}/{ctx}/{index}",
            )
        )
    return tuple(turns)


def _turn_gap(ctx: str, previous: _Request | None, request: _Request, expected: int) -> str:
    """What is wrong with a ctx's turn numbers, naming the neighbouring line: the gap lies between the two."""
    if previous is None:
        return f"ctx {ctx!r} starts at turn {request.turn_index}; its first turn must be 0"
    line = previous.where.rpartition(":")[2]
    if request.turn_index == previous.turn_index:
        return f"ctx {ctx!r} has turn {request.turn_index} twice (line {line} and this one)"
    return (f"ctx {ctx!r} goes from turn {previous.turn_index} (line {line}) to {request.turn_index}: turn "
            f"{expected} is missing")


def _think_time(previous: _Request, request: _Request) -> float:
    if request.think_time_s is not None:
        return request.think_time_s
    return max(0.0, request.t_s - previous.t_s - (previous.api_time_s or 0.0))
