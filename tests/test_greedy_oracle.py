"""The near-tie oracle the vLLM plugin's token tests use (``tests/greedy.py``), with scores made up here."""

from __future__ import annotations

import pytest
from greedy import TIE_NATS, check_greedy


def scorer(gaps: dict[tuple[int, int], float]):
    """Stock vLLM's scores as a table: the token at (sequence, position) is ``gap`` nats below the best, which is
    token 0 (the token itself where no gap is given)."""
    calls = []

    def score(pairs):
        calls.append(pairs)
        return [[(-5.0 - gaps.get((s, t), 0.0), -5.0, 0 if (s, t) in gaps else token)
                 for t, token in enumerate(continuation)] for s, (_, continuation) in enumerate(pairs)]

    return score, calls


def test_equal_sequences_need_no_scoring():
    score, calls = scorer({})
    report = check_greedy([[1, 2], [3]], [[1, 2], [3]], [[9], [9]], score)
    assert report == {"sequences": 2, "equal": 2, "near_ties": 0, "max_gap": 0.0} and not calls


def test_a_sequence_that_parts_at_a_near_tie_passes():
    score, calls = scorer({(0, 1): TIE_NATS / 2})
    report = check_greedy([[1, 2], [3, 4]], [[1, 5], [3, 4]], [[9], [8]], score)
    assert calls == [[([9], [1, 2])]]  # only the differing sequence, with its own prompt
    assert report["near_ties"] == 1 and report["max_gap"] == pytest.approx(TIE_NATS / 2)


def test_a_token_far_below_stock_vllms_choice_fails():
    score, _ = scorer({(0, 1): TIE_NATS / 2, (0, 2): 0.5})
    with pytest.raises(AssertionError, match="sequence 0 token 2: 7 is 0.5000 nats below stock vLLM's choice 0"):
        check_greedy([[1, 2, 7]], [[1, 5, 6]], [[9]], score)
