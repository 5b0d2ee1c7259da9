"""The readers on the recorded traces in ../shared/traces (skipped where that folder is absent)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from moetide.workloads import load_workload, sniff_format

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"
MOONCAKE_CONV = TRACES / "mooncake" / "conversation_trace.jsonl.gz"
MOONCAKE_SYNTH = TRACES / "mooncake" / "synthetic_trace.jsonl.gz"
WEKA = TRACES / "weka_claude_code" / "weka_cc_traces_compact.jsonl.gz"
AZURE_CODE = TRACES / "azure_2023" / "AzureLLMInferenceTrace_code.csv.gz"
AZURE_CONV = TRACES / "azure_2023" / "AzureLLMInferenceTrace_conv.csv.gz"


def need(path: Path) -> Path:
    if not path.is_file():
        pytest.skip(f"recorded trace {path} is absent (the traces live in ../shared/traces beside the project)")
    return path


def load_timed(path: Path, **kwargs):
    started = time.perf_counter()
    workload = load_workload(need(path), seed=0, **kwargs)
    # loose: catches a reader that expands keys into tuples (minutes, gigabytes), not machine speed
    assert time.perf_counter() - started < 30
    return workload


@pytest.fixture(scope="module")
def weka():
    return load_timed(WEKA)


@pytest.mark.parametrize(
    "path, fmt, num_requests, key_block_size, last_arrival_s",
    [
        (MOONCAKE_CONV, "mooncake", 12_031, 512, 3536.999),
        (MOONCAKE_SYNTH, "mooncake", 3_993, 512, 1022.025),
        (AZURE_CODE, "azure", 8_819, None, 3435.948056),
        (AZURE_CONV, "azure", 19_366, None, 3501.721937),
    ],
)
def test_open_loop_traces_have_their_published_counts(path, fmt, num_requests, key_block_size, last_arrival_s):
    assert sniff_format(need(path)) == fmt
    workload = load_timed(path)
    assert (workload.mode, workload.key_block_size) == ("open", key_block_size)
    assert workload.num_requests == workload.num_sessions == num_requests
    arrivals = [s.turns[0].arrival_s for s in workload.sessions]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals) and arrivals[-1] == pytest.approx(last_arrival_s)
    if key_block_size:
        assert all(len(t.block_keys) == t.prompt_tokens // key_block_size for s in workload.sessions for t in s.turns)


def test_mooncake_conversation_first_lines_exactly():
    workload = load_timed(MOONCAKE_CONV)
    first = workload.sessions[0].turns[0]
    assert (first.prompt_tokens, first.output_tokens, first.arrival_s) == (6758, 500, 0.0)
    assert first.block_keys == tuple(range(13))  # 14 hash ids, the 14th a partial block
    assert workload.sessions[1].turns[0].block_keys[:2] == (0, 14)


def test_weka_counts_and_structure(weka):
    roots = [s for s in weka.sessions if s.parent_session_id is None]
    subagents = [s for s in weka.sessions if s.parent_session_id is not None]
    assert (len(roots), len(subagents), weka.num_requests) == (710, 63, 49_334)
    assert (weka.mode, weka.key_block_size) == ("closed", 64)
    assert all(s.key_scope == s.session_id.split("/")[0] for s in weka.sessions)
    by_id = {s.session_id: s for s in weka.sessions}
    first = by_id["trace_0001"].turns
    assert (first[0].prompt_tokens, first[0].output_tokens, first[0].block_keys) == (71175, 169, tuple(range(1, 1113)))
    assert (first[1].think_time_s, first[1].arrival_s, first[1].request_id) == (12.0, None, "trace_0001/main/1")
    sub = by_id["trace_0003/main/sa1"]
    assert sub.parent_session_id == "trace_0003"
    assert sub.start_s - by_id["trace_0003"].start_s == pytest.approx(134.227 - 126.015)


def test_weka_subagents_share_no_block_with_their_main_context(weka):
    main_runs = {}
    for session in weka.sessions:
        if session.parent_session_id is None:
            main_runs[session.session_id] = {run for turn in session.turns for run in turn.block_keys.runs}
    for session in weka.sessions:
        if session.parent_session_id is not None:
            runs = {run for turn in session.turns for run in turn.block_keys.runs}
            assert not any(
                a < b + m and b < a + n for a, n in runs for b, m in main_runs[session.key_scope]
            ), session.session_id


def test_weka_same_seed_same_workload_and_subsets(weka):
    again = load_timed(WEKA)
    assert again == weka
    subset = load_timed(WEKA, sessions=10)
    assert sum(s.parent_session_id is None for s in subset.sessions) == 10
    by_id = {s.session_id: s for s in weka.sessions}
    assert all(by_id[s.session_id] == s for s in subset.sessions)
