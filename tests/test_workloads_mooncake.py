"""Mooncake JSONL reader: exact parsed values, session grouping, and one clear error per malformed line."""

from __future__ import annotations

import gzip
import json
import re

import pytest

from moetide.cli import main
from moetide.core.hashing import external_block_hashes
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
        ({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [-1]}, "field 'hash_ids'"),
        ({"timestamp": 0, "input_length": 1100, "output_length": 1, "hash_ids": [1, "2"]}, "field 'hash_ids'"),
        ({"timestamp": 0, "input_length": 1100, "output_length": 1, "hash_ids": [1, 2.0]}, "field 'hash_ids'"),
        ({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [True]}, "field 'hash_ids'"),
        # an extra id, ignored for keys, is still validated
        ({"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2, None]}, "field 'hash_ids'"),
        ({"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": None}, "field 'hash_ids'"),
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


# ---- third-party files: any number of hash_ids -------------------------------------------------------------------

# (input_length, hash_ids, expected block_keys); full blocks = input_length // 512, ceil = the partial one too
THIRD_PARTY = [
    (1100, [0, 1], (0, 1)),  # floor: full blocks only, silent
    (1024, [0, 1, 2, 3], (0, 1)),  # more than ceil = 2: the extras are ignored
    (2100, [0, 5], (0, 5)),  # fewer than its 4 full blocks: blocks 2 and 3 are private
    (4096, [0, 1, 2], (0, 1, 2)),  # fewer than 8
    (300, [], ()),  # floor = 0, silent
    (0, [7], ()),  # more than ceil = 0
    (1600, [0, 1, 2, 9], (0, 1, 2)),  # ceil (Mooncake's own rule), silent: the partial block's id dropped
]


def third_party_lines(rows):
    return [{"timestamp": 100 * i, "input_length": n, "output_length": 2, "hash_ids": ids}
            for i, (n, ids, _) in enumerate(rows)]


def test_third_party_ids_key_the_leading_full_blocks(tmp_path, capsys):
    path = write(tmp_path, third_party_lines(THIRD_PARTY))
    workload = mooncake.read(path)
    turns = [s.turns[0] for s in workload.sessions]
    assert [t.request_id for t in turns] == [f"L{i}" for i in range(1, 8)]
    assert [t.block_keys for t in turns] == [keys for _, _, keys in THIRD_PARTY]
    assert [t.prompt_tokens for t in turns] == [n for n, _, _ in THIRD_PARTY]
    assert capsys.readouterr().err == (
        f"warning: {path}: 2 of 7 lines have fewer hash_ids than full 512-token blocks (their last blocks are "
        "private); 2 have more than ceil(input_length/512) (the extra ids are ignored)\n"
    )


def test_the_warning_is_one_line_per_file_with_thousands_separators(tmp_path, capsys):
    rows = [(4096, [1], None)] * 1170 + [(1024, [1, 2, 3], None)] * 429 + [(1024, [1, 2], None)] * 410
    path = write(tmp_path, third_party_lines(rows))
    assert mooncake.read(path).num_requests == 2009
    err = capsys.readouterr().err
    assert err == (
        f"warning: {path}: 1,170 of 2,009 lines have fewer hash_ids than full 512-token blocks (their last blocks "
        "are private); 429 have more than ceil(input_length/512) (the extra ids are ignored)\n"
    )


def test_only_extra_ids_warns_with_the_line_count_on_that_part(tmp_path, capsys):
    path = write(tmp_path, third_party_lines([(1024, [1, 2, 3], None), (1024, [1, 2], None)]))
    mooncake.read(path)
    assert capsys.readouterr().err == (
        f"warning: {path}: 1 of 2 lines have more than ceil(input_length/512) (the extra ids are ignored)\n"
    )


def test_ceil_and_floor_files_read_silently(tmp_path, capsys):
    mooncake.read(write(tmp_path, LINES))  # Mooncake's own rule: ceil
    floor = [dict(line, hash_ids=line["hash_ids"][: line["input_length"] // 512]) for line in LINES]
    assert [s.turns[0].block_keys for s in mooncake.read(write(tmp_path, floor, name="floor.jsonl")).sessions] == [
        (0, 1), (0, 1), ()]
    assert capsys.readouterr().err == ""


def test_a_malformed_line_in_a_third_party_file_still_stops_the_read_without_a_warning(tmp_path, capsys):
    lines = third_party_lines(THIRD_PARTY)
    lines[3]["hash_ids"] = [0, "1"]
    path = write(tmp_path, lines)
    message = f"{path}:4: field 'hash_ids': ids must be integers >= 0, got '1'"
    with pytest.raises(UserError, match=f"^{re.escape(message)}$"):
        mooncake.read(path)
    assert capsys.readouterr().err == ""


def test_blocks_without_an_id_are_private_to_their_request(tmp_path):
    """Two 2048-token prompts whose only id is the first block's: they share that block, and nothing after it,
    however the replay's block size cuts them (the replay gives every sent request its own salt)."""
    path = write(tmp_path, third_party_lines([(2048, [5], None), (2048, [5], None)]))
    keys = [s.turns[0].block_keys for s in mooncake.read(path).sessions]
    assert keys == [(5,), (5,)]
    for block_size in (16, 512, 1024):
        a, b = (external_block_hashes(k, 512, block_size, 2048, salt=salt) for k, salt in zip(keys, (1, 2)))
        shared = 512 // block_size
        assert a[:shared] == b[:shared]
        assert not set(a[shared:]) & set(b)


def test_cli_replays_a_third_party_file_and_stops_on_a_malformed_one(tmp_path, capsys):
    # three 2048-token prompts, 100 s apart, each keyed by its first block only: the 2nd and 3rd hit 512 tokens
    path = write(tmp_path, [dict(line, timestamp=100_000 * i)
                            for i, line in enumerate(third_party_lines([(2048, [5], None)] * 3))])
    out = tmp_path / "out.json"
    assert main(["replay", str(path), "--model", "qwen3-30b-a3b", "--gpu", "h100", "--json", str(out)]) == 0
    metrics = json.loads(out.read_text())["metrics"]
    assert (metrics["completed"], metrics["failed"]) == (3, 0)
    assert metrics["prefix_hit_rate"] == pytest.approx(2 * 512 / (3 * 2048))
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert warnings == [f"warning: {path}: 3 of 3 lines have fewer hash_ids than full 512-token blocks "
                        "(their last blocks are private)"]

    bad = write(tmp_path, [*third_party_lines([(2048, [5], None)]), {"timestamp": 1, "input_length": 2048,
                "output_length": 2, "hash_ids": [5, "6"]}], name="bad.jsonl")
    assert main(["replay", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{bad}:2: field 'hash_ids'" in err and len(err.splitlines()) == 1 and "warning" not in err
