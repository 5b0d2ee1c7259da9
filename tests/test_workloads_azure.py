"""Azure CSV reader: timestamps to relative seconds, one keyless turn per row, malformed rows."""

from __future__ import annotations

import gzip

import pytest

from moetide.errors import UserError
from moetide.workloads import azure

ROWS = [
    "TIMESTAMP,ContextTokens,GeneratedTokens",
    "2023-11-16 18:17:03.9799600,4808,10",
    "2023-11-16 18:17:04.0319600,3180,8",
    "2023-11-16 18:18:03.9799600,110,27",
    "2023-11-17 00:00:00,5,1",
]


def write(tmp_path, rows, name="azure.csv", compress=False):
    data = ("\n".join(rows) + "\n").encode()
    path = tmp_path / name
    path.write_bytes(gzip.compress(data) if compress else data)
    return path


def test_reads_exact_values(tmp_path):
    workload = azure.read(write(tmp_path, ROWS))
    assert (workload.name, workload.mode, workload.key_block_size, workload.num_requests) == ("azure", "open", None, 4)
    turns = [s.turns[0] for s in workload.sessions]
    assert [t.prompt_tokens for t in turns] == [4808, 3180, 110, 5]
    assert [t.output_tokens for t in turns] == [10, 8, 27, 1]
    assert [t.arrival_s for t in turns] == pytest.approx([0.0, 0.052, 60.0, 5 * 3600 + 42 * 60 + 56.02004])
    assert [s.start_s for s in workload.sessions] == [t.arrival_s for t in turns]
    assert all(t.block_keys == () and t.cached_tokens is None for t in turns)
    assert [t.request_id for t in turns] == ["L2", "L3", "L4", "L5"]


def test_columns_are_found_by_name_and_gzip_by_content(tmp_path):
    rows = ["GeneratedTokens, TIMESTAMP ,ContextTokens", "3,2023-11-16 18:17:03.5,100", "4,2023-11-16T18:17:04+00:00,9"]
    with pytest.raises(UserError, match="UTC offset"):
        azure.read(write(tmp_path, rows, name="plain.txt", compress=True))
    rows[2] = "4,2023-11-16T18:17:04,9"
    workload = azure.read(write(tmp_path, rows, name="plain.txt", compress=True))
    assert [(s.turns[0].prompt_tokens, s.turns[0].output_tokens, s.start_s) for s in workload.sessions] == [
        (100, 3, 0.0),
        (9, 4, 0.5),
    ]


@pytest.mark.parametrize(
    "row, problem",
    [
        ("yesterday,10,2", "field 'TIMESTAMP'"),
        ("2023-11-16 18:17:05,-10,2", "field 'ContextTokens'"),
        ("2023-11-16 18:17:05,10,2.5", "field 'GeneratedTokens'"),
        ("2023-11-16 18:17:05,10", "expected 3 columns"),
    ],
)
def test_a_malformed_row_names_path_line_and_field(tmp_path, row, problem):
    path = write(tmp_path, [*ROWS[:2], row, *ROWS[2:]])
    with pytest.raises(UserError) as info:
        azure.read(path)
    assert str(info.value).startswith(f"{path}:3: ") and problem in str(info.value)


def test_header_and_empty_files(tmp_path):
    with pytest.raises(UserError, match=r"azure.csv:1: CSV header lacks column\(s\) GeneratedTokens"):
        azure.read(write(tmp_path, ["TIMESTAMP,ContextTokens", "x,1"]))
    with pytest.raises(UserError, match="no requests"):
        azure.read(write(tmp_path, ROWS[:1]))
    with pytest.raises(UserError, match="session_rate_per_s"):
        azure.read(write(tmp_path, ROWS), session_rate_per_s=2.0)
