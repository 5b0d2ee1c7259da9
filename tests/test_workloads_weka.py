"""WEKA agent-session reader: closed-loop turns, sub-agent placement, Poisson starts, malformed lines."""

from __future__ import annotations

import gzip
import json
import random

import pytest

from moetide.errors import UserError
from moetide.workloads import weka


def header(session, **extra):
    return {"kind": "session", "session": session, "block_size": 64, "hash_id_scope": "local", **extra}


def request(session, ctx, turn, t, size, out, runs, think=0.0, api=1.0):
    return {"kind": "request", "session": session, "ctx": ctx, "turn": turn, "t": t, "in": size, "out": out,
            "api_time": api, "think_time": think, "stop": "tool_use", "hash_runs": runs}


def marker(session, ctx, child, t, duration_ms):
    return {"kind": "subagent_marker", "session": session, "ctx": ctx, "child_ctx": child, "t": t,
            "duration_ms": duration_ms}


LINES = [
    header("s1"),
    request("s1", "main", 0, 0.0, 200, 10, [[1, 3]], api=2.0),
    marker("s1", "main", "main/sa1", 30.0, 25_000),  # a synchronous sub-agent: t is its end
    request("s1", "main/sa1", 0, 0.0, 130, 5, [[40, 2]]),
    request("s1", "main/sa1", 1, 4.0, 140, 5, [[40, 2]], think=3.0),
    marker("s1", "main/sa1", "main/sa1/sa1", 2.5, None),  # a background one: t is its launch
    request("s1", "main/sa1/sa1", 0, 0.0, 64, 1, [[50, 1]]),
    request("s1", "main", 1, 40.0, 260, 20, [[1, 4]], think=38.0),
    request("s1", "main", 2, 70.0, 290, 9, [[1, 4]], think=None, api=3.0),  # think_time null
    header("s2"),
    request("s2", "main", 0, 0.0, 63, 4, []),
]


def write(tmp_path, lines, name="weka.jsonl", compress=False):
    text = "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    path = tmp_path / name
    path.write_bytes(gzip.compress(text.encode()) if compress else text.encode())
    return path


def test_reads_closed_loop_sessions_with_exact_values(tmp_path):
    workload = weka.read(write(tmp_path, LINES), seed=3, session_rate_per_s=0.5)
    assert (workload.mode, workload.key_block_size, workload.num_requests) == ("closed", 64, 7)
    s2_start = random.Random(3).expovariate(0.5)
    by_id = {s.session_id: s for s in workload.sessions}
    assert set(by_id) == {"s1", "s1/main/sa1", "s1/main/sa1/sa1", "s2"}
    main, sub, nested, other = by_id["s1"], by_id["s1/main/sa1"], by_id["s1/main/sa1/sa1"], by_id["s2"]
    assert (main.start_s, sub.start_s, nested.start_s, other.start_s) == (0.0, 5.0, 7.5, s2_start)
    assert (main.parent_session_id, sub.parent_session_id, nested.parent_session_id) == (None, "s1", "s1/main/sa1")
    assert {s.key_scope for s in (main, sub, nested)} == {"s1"} and other.key_scope == "s2"
    assert [t.prompt_tokens for t in main.turns] == [200, 260, 290]
    assert [t.output_tokens for t in main.turns] == [10, 20, 9]
    assert [t.block_keys for t in main.turns] == [(1, 2, 3), (1, 2, 3, 4), (1, 2, 3, 4)]
    assert [t.arrival_s for t in main.turns] == [0.0, None, None]
    assert [t.think_time_s for t in main.turns] == [0.0, 38.0, 29.0]  # 29 = 70 - 40 - 1 (api_time)
    assert [t.request_id for t in sub.turns] == ["s1/main/sa1/0", "s1/main/sa1/1"]
    assert [t.think_time_s for t in sub.turns] == [0.0, 3.0]
    assert other.turns[0].block_keys == () and other.turns[0].arrival_s == s2_start
    assert [s.session_id for s in workload.sessions] == sorted(by_id, key=lambda sid: by_id[sid].start_s)


def test_think_time_fallback_when_null(tmp_path):
    workload = weka.read(write(tmp_path, LINES), seed=0)
    main = workload.sessions[0]
    assert main.turns[2].think_time_s == 70.0 - 40.0 - 1.0  # t - previous t - previous api_time


def test_same_seed_same_workload_and_seed_moves_only_starts(tmp_path):
    path = write(tmp_path, LINES, compress=True)
    a, b, c = weka.read(path, seed=7), weka.read(path, seed=7), weka.read(path, seed=8)
    assert a == b
    assert a != c
    assert [s.turns[1:] for s in a.sessions] == [s.turns[1:] for s in c.sessions]


def test_default_rate_spaces_sessions_about_a_minute_apart(tmp_path):
    lines = []
    for index in range(400):
        lines += [header(f"t{index}"), request(f"t{index}", "main", 0, 0.0, 64, 1, [[0, 1]])]
    workload = weka.read(write(tmp_path, lines), seed=1)
    mean_gap = workload.sessions[-1].start_s / (len(workload.sessions) - 1)
    assert 50 < mean_gap < 70 and weka.DEFAULT_SESSION_RATE_PER_S == 1 / 60


@pytest.mark.parametrize(
    "bad, problem",
    [
        ("{", "not valid JSON"),
        ({"kind": "note", "session": "s1"}, "field 'kind'"),
        (request("zz", "main", 0, 0.0, 64, 1, [[0, 1]]), "field 'session'"),
        (request("s1", "side", 3, 0.0, 64, 1, [[0, 1]]), "field 'ctx'"),
        (request("s1", "main", 3, -1.0, 64, 1, [[0, 1]]), "field 't'"),
        (request("s1", "main", 3, 0.0, 64, 1, [[0, 2]]), "field 'hash_runs'"),
        (request("s1", "main", 3, 0.0, 64, 1, [[0, "1"]]), "field 'hash_runs'"),
        (request("s1", "main", 3, 0.0, 64, 1, [[0, 0], [0, 1]]), "field 'hash_runs'"),
        (request("s1", "main", 3, 0.0, 64, -1, [[0, 1]]), "field 'out'"),
        (request("s1", "main", 3, 0.0, 64, 1, [[0, 1]], think="x"), "field 'think_time'"),
        (header("s1"), "field 'session'"),
        (header("s9", block_size=16), "field 'block_size'"),
        (header("s9", hash_id_scope="team"), "field 'hash_id_scope'"),
        (marker("s1", "main", "main/sa1/sa2", 1.0, 5), "field 'child_ctx'"),
        (marker("s1", "main", "main/sa1", 1.0, 5), "field 'child_ctx'"),
        (marker("s1", "main", "main/sa9", 1.0, -5), "field 'duration_ms'"),
    ],
)
def test_a_malformed_line_names_path_line_and_field(tmp_path, bad, problem):
    path = write(tmp_path, [*LINES[:9], bad, *LINES[9:]])
    with pytest.raises(UserError) as info:
        weka.read(path, seed=0)
    assert str(info.value).startswith(f"{path}:10: ")
    assert problem in str(info.value)


def test_inconsistent_sessions_are_user_errors(tmp_path):
    gap = [header("s1"), request("s1", "main", 0, 0.0, 64, 1, [[0, 1]]), request("s1", "main", 2, 5.0, 64, 1,
                                                                                  [[0, 1]])]
    with pytest.raises(UserError, match=r"weka.jsonl:3: field 'turn'"):
        weka.read(write(tmp_path, gap), seed=0)
    orphan = [header("s1"), request("s1", "main", 0, 0.0, 64, 1, [[0, 1]]), request("s1", "main/sa1", 0, 0.0, 64,
                                                                                    1, [[0, 1]])]
    with pytest.raises(UserError, match=r"weka.jsonl:3: sub-agent ctx 'main/sa1' has no subagent_marker"):
        weka.read(write(tmp_path, orphan), seed=0)
    with pytest.raises(UserError, match="no 'main' requests"):
        weka.read(write(tmp_path, [header("s1"), marker("s1", "main", "main/sa1", 1.0, 5), orphan[2]]), seed=0)
    with pytest.raises(UserError, match="no requests"):
        weka.read(write(tmp_path, [header("s1")]), seed=0)
    with pytest.raises(UserError, match="session_rate_per_s"):
        weka.read(write(tmp_path, LINES), seed=0, session_rate_per_s=0.0)
