"""The built-in agent-session generator: determinism, prefix-extending keys, shared system prompt, validation."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moetide.workloads import GeneratorConfig, LogNormal, generate_agent_sessions


def test_same_seed_same_workload_other_seed_another():
    assert generate_agent_sessions(11) == generate_agent_sessions(11)
    assert generate_agent_sessions(11) != generate_agent_sessions(12)


def test_default_job_is_modest_and_closed_loop():
    workload = generate_agent_sessions(0)
    assert (workload.name, workload.source, workload.mode, workload.key_block_size) == (
        "agent_sessions", "builtin:generator", "closed", 64)
    assert workload.num_sessions == 64
    assert 500 < workload.num_requests < 3000
    starts = [s.start_s for s in workload.sessions]
    assert starts[0] == 0.0 and starts == sorted(starts) and starts[-1] < 64 / 0.2 * 2
    for session in workload.sessions:
        assert session.turns[0].arrival_s == session.start_s and session.turns[0].think_time_s == 0.0
        assert all(t.arrival_s is None and t.think_time_s >= 0 for t in session.turns[1:])
        assert session.parent_session_id is None and session.key_scope == ""


def check_agent_shape(workload, config):
    num_shared = config.system_prompt_tokens // config.key_block_size
    shared_prefix = tuple(range(num_shared))
    session_keys = []
    for session in workload.sessions:
        turns = session.turns
        assert 1 <= len(turns) <= config.turns_per_session.high
        for turn in turns:
            assert len(turn.block_keys) == turn.prompt_tokens // config.key_block_size
            assert turn.prompt_tokens <= config.max_prompt_tokens
            assert turn.block_keys[:num_shared] == shared_prefix[: len(turn.block_keys)]
        for previous, turn in zip(turns, turns[1:]):
            assert turn.prompt_tokens >= previous.prompt_tokens + previous.output_tokens
            assert turn.block_keys.common_prefix_len(previous.block_keys) == len(previous.block_keys)
        session_keys.append(set(turns[-1].block_keys[num_shared:]))
    for i, keys in enumerate(session_keys):  # task prefixes and everything after are private to a session
        assert all(keys.isdisjoint(other) for other in session_keys[i + 1 :])


def test_turns_extend_the_previous_prompt_and_share_the_system_prompt():
    config = GeneratorConfig()
    check_agent_shape(generate_agent_sessions(3, config=config), config)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    block_size=st.sampled_from([16, 64, 100]),
    system=st.integers(0, 5000),
    max_prompt=st.integers(40_000, 80_000),
)
def test_agent_shape_holds_for_any_config(seed, block_size, system, max_prompt):
    config = GeneratorConfig(num_sessions=6, key_block_size=block_size, system_prompt_tokens=system,
                             max_prompt_tokens=max_prompt)
    check_agent_shape(generate_agent_sessions(seed, config=config), config)


def test_sessions_stop_before_a_prompt_exceeds_the_cap():
    config = GeneratorConfig(
        num_sessions=3,
        task_prompt_tokens=LogNormal(1000, 0.0, 1000, 1000),
        turns_per_session=LogNormal(50, 0.0, 50, 50),
        new_tokens_per_turn=LogNormal(900, 0.0, 900, 900),
        output_tokens=LogNormal(100, 0.0, 100, 100),
        system_prompt_tokens=0,
        max_prompt_tokens=5000,
    )
    workload = generate_agent_sessions(0, config=config)
    assert [t.prompt_tokens for t in workload.sessions[0].turns] == [1000, 2000, 3000, 4000, 5000]
    assert workload.num_requests == 15


def test_num_sessions_argument_overrides_the_config():
    assert generate_agent_sessions(1, 5).num_sessions == 5
    config = GeneratorConfig(num_sessions=9)
    assert generate_agent_sessions(1, config=config).sessions[:5] == generate_agent_sessions(1, 5).sessions


def test_lognormal_is_clipped_and_deterministic():
    dist = LogNormal(10.0, 2.0, 1.0, 50.0)
    draws = [dist.sample(random.Random(4)) for _ in range(2)]
    assert draws[0] == draws[1]
    rng = random.Random(0)
    samples = [dist.sample(rng) for _ in range(2000)]
    assert min(samples) == 1.0 and max(samples) == 50.0
    assert 8 < sorted(samples)[1000] < 12


@pytest.mark.parametrize(
    "change, problem",
    [
        ({"num_sessions": 0}, "num_sessions"),
        ({"key_block_size": 0}, "key_block_size"),
        ({"system_prompt_tokens": -1}, "system_prompt_tokens"),
        ({"session_rate_per_s": 0.0}, "session_rate_per_s"),
        ({"session_rate_per_s": float("nan")}, "session_rate_per_s"),
        ({"turns_per_session": LogNormal(1, 0, 0, 2)}, "turns_per_session.low"),
        ({"output_tokens": LogNormal(1, 0, 0, 2)}, "output_tokens.low"),
        ({"max_prompt_tokens": 20_000}, "a first prompt would not fit"),
    ],
)
def test_config_validation_names_the_field(change, problem):
    with pytest.raises(ValueError, match=problem):
        dataclasses.replace(GeneratorConfig(), **change)


@pytest.mark.parametrize("args", [(0, 1, 0, 5), (5, 1, 6, 7), (5, -1, 0, 7), (5, float("inf"), 0, 7)])
def test_lognormal_validation(args):
    with pytest.raises(ValueError, match="LogNormal"):
        LogNormal(*args)
