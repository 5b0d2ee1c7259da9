"""Chained hashes over tokens and over trace block keys."""

import subprocess
import sys

import pytest

from moetide.core.hashing import extend_salted_hashes, external_block_hashes, hash_token_blocks, scope_hash


def test_token_hashes_chain_and_extend_incrementally():
    tokens = list(range(20))
    full = hash_token_blocks(tokens, 4)
    assert len(full) == 5
    head = hash_token_blocks(tokens[:9], 4)
    assert head == full[:2]
    assert head + hash_token_blocks(tokens, 4, parent_hash=head[-1], start_block=2) == full
    # same block content under another parent is another block
    assert hash_token_blocks([9, 9, 9, 9, 0, 1, 2, 3], 4)[1] != full[0]


def test_hashes_are_stable_across_processes():
    code = (
        "from moetide.core.hashing import external_block_hashes, scope_hash, hash_token_blocks;"
        "print(hash_token_blocks(list(range(8)), 4), external_block_hashes([5, 6], 64, 16, 130, "
        "scope=scope_hash('s1'), salt=3))"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": seed}
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outs) == 1


@pytest.mark.parametrize("block_size", [16, 64, 100, 512, 1024])
def test_equal_key_prefixes_give_equal_pool_prefixes(block_size):
    a = external_block_hashes([1, 2, 3, 4], 256, block_size, 1024, salt=1)
    b = external_block_hashes([1, 2, 3, 9], 256, block_size, 1024, salt=2)
    shared_blocks = (3 * 256) // block_size  # pool blocks entirely inside the three shared keys
    assert a[:shared_blocks] == b[:shared_blocks]
    assert a[shared_blocks:] != b[shared_blocks:] or shared_blocks == len(a)
    assert len(a) == 1024 // block_size


def test_tail_blocks_are_private_to_the_request():
    # 2 keys of 64 tokens, prompt of 160 tokens with 16-token blocks: 8 keyed blocks, 2 tail blocks
    a = external_block_hashes([7, 8], 64, 16, 160, salt=1)
    b = external_block_hashes([7, 8], 64, 16, 160, salt=2)
    assert a[:8] == b[:8] and a[8] != b[8]
    assert external_block_hashes([7, 8], 64, 16, 160, salt=1) == a


def test_scopes_separate_session_local_keys():
    a = external_block_hashes([1, 2], 64, 64, 128, scope=scope_hash("session-a"))
    b = external_block_hashes([1, 2], 64, 64, 128, scope=scope_hash("session-b"))
    assert not set(a) & set(b)


def test_salted_extension_for_generated_blocks():
    hashes = external_block_hashes([1], 64, 16, 70, salt=5)
    extend_salted_hashes(hashes, 7, salt=5)
    assert len(hashes) == 7 and len(set(hashes)) == 7
    again = external_block_hashes([1], 64, 16, 70, salt=5)
    extend_salted_hashes(again, 7, salt=5)
    assert again == hashes


def test_bad_block_sizes_are_rejected():
    with pytest.raises(ValueError, match="block sizes must be positive"):
        external_block_hashes([1], 0, 16, 64)


@pytest.mark.parametrize("block_size", [16, 64, 96, 128])
def test_reusing_a_previous_turns_hashes_changes_nothing(block_size):
    turn1 = external_block_hashes([1, 2, 3], 64, block_size, 64 * 3 + 10, salt=1)
    keys2 = [1, 2, 3, 4, 5]
    shared = (3 * 64) // block_size
    fresh = external_block_hashes(keys2, 64, block_size, 64 * 5 + 7, salt=2)
    reused = external_block_hashes(keys2, 64, block_size, 64 * 5 + 7, salt=2, reuse=turn1[:shared])
    assert reused == fresh and turn1[:shared] == fresh[:shared]
