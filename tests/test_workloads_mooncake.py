"""Mooncake JSONL reader: exact parsed values, session grouping, and one clear error per malformed line."""

from __future__ import annotations

import gzip
import json

import pytest

from moetide.errors import UserError
from moetide.workloads import mooncake
from moetide.workloads.base import BlockKeys

LINES = [
    {"timestamp": 1000, "input_length": 1100, "output_length": 7, "hash_ids": [0, 1, 2]},
    {"timestamp": 1000, "input_length": 1024, "output_length": 3, "hash_ids": [0, 1]},
    {"timestamp": 4500, "input_length": 300, "output_length": 1, "hash_ids": [9]},
]


def write(tmp_path, lines, name="trace.jsonl", compress=False):
    text = "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    path = tmp_path / name
    path.write_bytes(gzip.compress(text.encode()) if compress else text.encode())
    return path


def test_reads_exact_values_and_keeps_only_full_blocks(tmp_path):
    workload = mooncake.read(write(tmp_path, LINES))
    assert (workload.name, workload.mode, workload.key_block_size) == ("trace", "open", 512)
    assert [s.session_id for s in workload.sessions] == ["L1", "L2", "L3"]
    first, second, third = (s.turns[0] for s in workload.sessions)
    assert (first.prompt_tokens, first.output_tokens, first.arrival_s) == (1100, 7, 0.0)
    assert first.block_keys == (0, 1)  # 1100 tokens: two full 512-token blocks, the partial third dropped
    assert second.block_keys == (0, 1)  # exactly two full blocks
    assert third.block_keys == () and third.arrival_s == 3.5
    assert all(s.key_scope == "" and s.parent_session_id is None for s in workload.sessions)
    assert (first.think_time_s, first.cached_tokens, first.request_id) == (0.0, None, "L1")
    assert isinstance(first.block_keys, BlockKeys)


def test_gzip_content_under_any_name_reads_the_same(tmp_path):
    plain = mooncake.read(write(tmp_path, LINES))
    packed = mooncake.read(write(tmp_path, LINES, name="packed.data", compress=True))
    assert packed.sessions == plain.sessions


def test_session_ids_group_turns_in_arrival_order(tmp_path):
    lines = [
        {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2], "session_id": "a", "turn": 0},
        {"timestamp": 500, "input_length": 10, "output_length": 5, "hash_ids": [7]},
        {"timestamp": 2000, "input_length": 1200, "output_length": 5, "hash_ids": [1, 3, 4], "session_id": "a",
         "turn": 1, "cached_tokens": 512},
    ]
    workload = mooncake.read(write(tmp_path, lines))
    assert [s.session_id for s in workload.sessions] == ["a", "L2"]
    session = workload.sessions[0]
    assert [t.arrival_s for t in session.turns] == [0.0, 2.0]
    assert [t.block_keys for t in session.turns] == [(1,), (1, 3)]
    assert [t.cached_tokens for t in session.turns] == [None, 512]
    assert workload.num_requests == 3


@pytest.mark.parametrize(
    "line, field",
    [
        ('{"timestamp": 0, "input_length": 10', "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ({"input_length": 10, "output_length": 1, "hash_ids": [1]}, "field 'timestamp': missing"),
        ({"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [1]}, "field 'timestamp'"),
        ({"timestamp": 0, "input_length": -10, "output_length": 1, "hash_ids": [1]}, "field 'input_length'"),
        ({"timestamp": 0, "input_length": "10", "output_length": 1, "hash_ids": [1]}, "field 'input_length'"),
        ({"timestamp": 0, "input_length": 10, "output_length": 1.5, "hash_ids": [1]}, "field 'output_length'"),
        ({"timestamp": 0, "input_length": 10, "output_length": True, "hash_ids": [1]}, "field 'output_length'"),
        ({"timestamp": 0, "input_length": 10, "output_length": 1}, "field 'hash_ids': missing"),
        ({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": "1"}, "field 'hash_ids'"),
        ({"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}, "expected ceil"),
        ({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [-1]}, "field 'hash_ids'"),
        ({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1], "turn": -2}, "field 'turn'"),
        ({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1], "cached_tokens": 11},
         "field 'cached_tokens'"),
        ({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1], "session_id": [1]},
         "field 'session_id'"),
        ('{"timestamp": NaN, "input_length": 10, "output_length": 1, "hash_ids": [1]}', "field 'timestamp'"),
    ],
)
def test_a_malformed_line_names_path_line_and_field(tmp_path, line, field):
    path = write(tmp_path, [LINES[0], line, LINES[1]])
    with pytest.raises(UserError) as info:
        mooncake.read(path)
    message = str(info.value)
    assert message.startswith(f"{path}:2: ")
    assert field in message


def test_blank_lines_are_skipped_but_counted(tmp_path):
    path = write(tmp_path, [LINES[0], "", '{"timestamp": 0}'])
    with pytest.raises(UserError, match=r"trace.jsonl:3: field 'input_length'"):
        mooncake.read(path)


def test_empty_trace_and_session_rate_are_refused(tmp_path):
    with pytest.raises(UserError, match="no requests"):
        mooncake.read(write(tmp_path, ["", "  "]))
    with pytest.raises(UserError, match="session_rate_per_s"):
        mooncake.read(write(tmp_path, LINES), session_rate_per_s=1.0)
