"""BlockKeys against a plain-tuple model, the Workload invariants, and gzip detection by magic bytes."""

from __future__ import annotations

import gzip
import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moetide.errors import UserError
from moetide.workloads.base import NO_KEYS, BlockKeys, Session, Turn, Workload, iter_lines

runs_strategy = st.lists(st.tuples(st.integers(0, 50), st.integers(0, 6)), max_size=8)


def expand(runs):
    return tuple(key for start, length in runs for key in range(start, start + length))


@given(runs_strategy)
def test_block_keys_behave_like_the_tuple_of_their_keys(runs):
    keys, model = BlockKeys(runs), expand(runs)
    assert len(keys) == len(model)
    assert tuple(keys) == model
    assert keys == model and model == keys
    assert hash(keys) == hash(model)
    assert keys == BlockKeys.from_keys(model)
    assert all(keys[i] == model[i] for i in range(-len(model), len(model)))


@given(runs_strategy, st.integers(-12, 40), st.integers(-12, 40), st.sampled_from([None, 1, 2, -1]))
def test_block_keys_slices_are_tuples_equal_to_the_model(runs, lo, hi, step):
    keys, model = BlockKeys(runs), expand(runs)
    assert keys[lo:hi:step] == model[lo:hi:step]
    assert type(keys[lo:hi]) is tuple


@given(runs_strategy, runs_strategy, st.integers(0, 40))
def test_common_prefix_len_and_prefix_match_the_model(runs_a, runs_b, n):
    a, b = BlockKeys(runs_a), BlockKeys(runs_b)
    model_a, model_b = expand(runs_a), expand(runs_b)
    expected = 0
    while expected < min(len(model_a), len(model_b)) and model_a[expected] == model_b[expected]:
        expected += 1
    assert a.common_prefix_len(b) == expected == b.common_prefix_len(a)
    assert a.prefix(n) == model_a[:n]


def test_block_keys_normalise_runs_and_reject_bad_ones():
    keys = BlockKeys([(5, 2), (7, 3), (20, 0), (1, 1)])
    assert keys.runs == ((5, 5), (1, 1))
    assert 9 in keys and 10 not in keys and 1 in keys
    with pytest.raises(IndexError):
        keys[6]
    with pytest.raises(ValueError, match="run length"):
        BlockKeys([(0, -1)])
    assert len(NO_KEYS) == 0 and NO_KEYS == ()
    assert pickle.loads(pickle.dumps(keys)) == keys


def turn(arrival_s, request_id="r"):
    return Turn(
        prompt_tokens=10,
        output_tokens=2,
        block_keys=NO_KEYS,
        arrival_s=arrival_s,
        think_time_s=0.0,
        cached_tokens=None,
        request_id=request_id,
    )


def session(session_id, start_s, *arrivals):
    turns = tuple(turn(a, f"{session_id}/{i}") for i, a in enumerate(arrivals))
    return Session(session_id=session_id, start_s=start_s, turns=turns, parent_session_id=None, key_scope="")


def test_workload_counts_and_checks_its_mode():
    workload = Workload("w", "x", "closed", 64, (session("a", 1.0, 1.0, None), session("b", 2.0, 2.0)))
    assert (workload.num_sessions, workload.num_requests) == (2, 3)
    with pytest.raises(ValueError, match="later turns"):
        Workload("w", "x", "closed", 64, (session("a", 1.0, 1.0, 5.0),))
    with pytest.raises(ValueError, match="first turn"):
        Workload("w", "x", "closed", 64, (session("a", 1.0, 0.0),))
    with pytest.raises(ValueError, match="without arrival_s"):
        Workload("w", "x", "open", 64, (session("a", 1.0, 1.0, None),))
    with pytest.raises(ValueError, match="unique"):
        Workload("w", "x", "open", None, (session("a", 1.0, 1.0), session("a", 2.0, 2.0)))
    with pytest.raises(ValueError, match="mode"):
        Workload("w", "x", "replay", None, ())
    with pytest.raises(ValueError, match="key_block_size"):
        Workload("w", "x", "open", 0, ())


def test_gzip_is_detected_by_magic_bytes_not_suffix(tmp_path):
    packed = tmp_path / "trace.txt"  # gzip without the suffix
    packed.write_bytes(gzip.compress(b"one\ntwo\n"))
    plain = tmp_path / "trace.jsonl.gz"  # plain text with a gzip suffix
    plain.write_text("one\ntwo\n")
    assert [line for _, line in iter_lines(packed)] == ["one\n", "two\n"]
    assert [line for _, line in iter_lines(plain)] == ["one\n", "two\n"]


def test_unreadable_files_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="cannot open trace"):
        list(iter_lines(tmp_path / "missing.jsonl"))
    broken = tmp_path / "broken.gz"
    data = gzip.compress("".join(f"line {i}\n" for i in range(2000)).encode())
    broken.write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match=r"broken.gz:\d+: cannot read trace"):
        list(iter_lines(broken))
