"""Format sniffing, ``load_workload`` and the subsets (time window, sessions, max_requests) on small traces."""

from __future__ import annotations

import gzip
import json

import pytest

from moetide.errors import UserError
from moetide.workloads import READERS, generate_agent_sessions, load_workload, select, sniff_format


def write(tmp_path, name, lines, compress=False):
    text = "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    path = tmp_path / name
    path.write_bytes(gzip.compress(text.encode()) if compress else text.encode())
    return path


def mooncake_line(timestamp_ms, **extra):
    return {"timestamp": timestamp_ms, "input_length": 600, "output_length": 2, "hash_ids": [1, 2], **extra}


def weka_session(session, num_turns, subagent=False):
    lines = [{"kind": "session", "session": session, "block_size": 64, "hash_id_scope": "local"}]
    for turn in range(num_turns):
        lines.append({"kind": "request", "session": session, "ctx": "main", "turn": turn, "t": 10.0 * turn,
                      "in": 64, "out": 1, "api_time": 1.0, "think_time": 9.0 if turn else 0.0, "hash_runs": [[0, 1]]})
    if subagent:
        lines.append({"kind": "subagent_marker", "session": session, "ctx": "main", "child_ctx": "main/sa1",
                      "t": 3.0, "duration_ms": 1000})
        lines.append({"kind": "request", "session": session, "ctx": "main/sa1", "turn": 0, "t": 0.0, "in": 64,
                      "out": 1, "api_time": 1.0, "think_time": 0.0, "hash_runs": [[5, 1]]})
    return lines


@pytest.fixture
def traces(tmp_path):
    mooncake = write(tmp_path, "m.jsonl", [mooncake_line(1000 * i) for i in range(10)], compress=True)
    weka = write(tmp_path, "w.jsonl.gz", weka_session("a", 3, subagent=True) + weka_session("b", 2)
                 + weka_session("c", 4))
    azure = tmp_path / "a.csv"
    azure.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9,10,1\n2023-11-16 18:17:05.9,7,2\n")
    return {"mooncake": mooncake, "weka": weka, "azure": azure}


def test_formats_are_sniffed_from_the_first_line(traces, tmp_path):
    assert set(READERS) == {"mooncake", "weka", "azure"}
    for fmt, path in traces.items():
        assert sniff_format(path) == fmt
        assert load_workload(path, seed=0) == READERS[fmt].read(path, seed=0)
    unknown = write(tmp_path, "x.jsonl", [{"prompt": "hi"}])
    with pytest.raises(UserError, match=r"x.jsonl: cannot tell the trace format .* --format, one of mooncake, weka"):
        load_workload(unknown, seed=0)
    with pytest.raises(UserError, match="unknown trace format 'sharegpt'"):
        load_workload(unknown, "sharegpt", seed=0)
    with pytest.raises(UserError, match="cannot open trace"):
        load_workload(tmp_path / "absent.jsonl", seed=0)


def test_explicit_format_overrides_sniffing(traces):
    with pytest.raises(UserError, match=r"m.jsonl:1: field 'kind'"):
        load_workload(traces["mooncake"], "weka", seed=0)


def test_open_loop_max_requests_takes_the_first_arrivals(traces):
    workload = load_workload(traces["mooncake"], seed=0, max_requests=4)
    assert [s.turns[0].arrival_s for s in workload.sessions] == [0.0, 1.0, 2.0, 3.0]


def test_open_loop_time_window_filters_turns_and_shifts_to_zero(traces):
    workload = load_workload(traces["mooncake"], seed=0, time_window=(2.5, 6.0))
    assert [s.session_id for s in workload.sessions] == ["L4", "L5", "L6"]
    assert [s.start_s for s in workload.sessions] == [0.5, 1.5, 2.5]
    workload = load_workload(traces["mooncake"], seed=0, time_window=(2.0, 100.0), sessions=2, max_requests=1)
    assert [s.session_id for s in workload.sessions] == ["L3"]


def test_open_loop_sessions_are_cut_turn_by_turn(tmp_path):
    path = write(tmp_path, "s.jsonl", [mooncake_line(0, session_id="x"), mooncake_line(1000, session_id="y"),
                                      mooncake_line(2000, session_id="x"), mooncake_line(3000, session_id="x")])
    workload = load_workload(path, seed=0, max_requests=3)
    assert [(s.session_id, [t.arrival_s for t in s.turns]) for s in workload.sessions] == [
        ("x", [0.0, 2.0]),
        ("y", [1.0]),
    ]
    shifted = load_workload(path, seed=0, time_window=(1.5, 10.0))
    assert [(s.session_id, s.start_s, len(s.turns)) for s in shifted.sessions] == [("x", 0.5, 2)]


def test_closed_loop_subsets_keep_whole_families(traces):
    full = load_workload(traces["weka"], seed=4)
    assert [s.session_id for s in full.sessions if s.parent_session_id is None] == ["a", "b", "c"]
    assert load_workload(traces["weka"], seed=4, sessions=1).num_requests == 4  # a: 3 main turns + 1 sub-agent
    assert [s.session_id for s in load_workload(traces["weka"], seed=4, max_requests=5).sessions] == [
        "a", "a/main/sa1", "b"]  # whole families until at least 5 requests: 4 + 2
    assert load_workload(traces["weka"], seed=4, max_requests=4).num_requests == 4
    starts = {s.session_id: s.start_s for s in full.sessions}
    window = load_workload(traces["weka"], seed=4, time_window=(0.0, starts["c"]))
    assert {s.session_id for s in window.sessions} == {"a", "a/main/sa1", "b"}
    late = load_workload(traces["weka"], seed=4, time_window=(starts["b"], starts["c"] + 1e-9))
    assert [(s.session_id, s.start_s, s.turns[0].arrival_s) for s in late.sessions] == [
        ("b", 0.0, 0.0), ("c", starts["c"] - starts["b"], starts["c"] - starts["b"])]
    assert late.sessions[1].turns[1:] == full.sessions[-1].turns[1:]


def test_a_subset_of_a_generated_workload_is_a_prefix_of_it():
    workload = generate_agent_sessions(seed=5, num_sessions=12)
    subset = select(workload, sessions=5)
    assert subset.sessions == workload.sessions[:5]
    assert select(workload) == workload


@pytest.mark.parametrize(
    "kwargs, problem",
    [
        ({"max_requests": 0}, "max_requests must be a whole number >= 1"),
        ({"sessions": 1.5}, "sessions must be a whole number >= 1"),
        ({"time_window": (5.0, 5.0)}, "time_window needs 0 <= start_s < end_s"),
        ({"time_window": (-1.0, 5.0)}, "time_window needs"),
        ({"time_window": "soon"}, "time_window must be"),
        ({"time_window": (100.0, 200.0)}, "selects no requests"),
    ],
)
def test_bad_subsets_are_user_errors(traces, kwargs, problem):
    with pytest.raises(UserError, match=problem):
        load_workload(traces["mooncake"], seed=0, **kwargs)
