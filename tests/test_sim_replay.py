"""Replay: accounting, closed-loop timing, determinism, metrics definitions."""

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moetide.core.blocks import BlockPool
from moetide.core.kv_manager import KVCacheManager
from moetide.core.pressure import get_policy
from moetide.core.scheduler import Scheduler, SchedulerConfig
from moetide.sim.metrics import percentile, summary, weighted_summary
from moetide.sim.replay import Replay
from moetide.sim.setup import ReplayConfig, run_replay
from moetide.workloads import BlockKeys, Session, Turn, Workload, generate_agent_sessions


def turn(rid, prompt, out, keys=(), arrival=None, think=0.0):
    return Turn(prompt_tokens=prompt, output_tokens=out, block_keys=BlockKeys.from_keys(keys), arrival_s=arrival,
                think_time_s=think, cached_tokens=None, request_id=rid)


def replay(workload, num_blocks=64, step_s=0.01, block_size=16, **sched):
    pool = BlockPool(range(num_blocks))
    scheduler = Scheduler(SchedulerConfig(**sched), KVCacheManager(pool, block_size), get_policy("vllm"))
    metrics = Replay(workload, scheduler, lambda *shape: step_s).run()
    scheduler.kv.check_invariants()
    assert pool.num_used_blocks == 0
    return metrics


def test_open_loop_single_request_timing():
    session = Session(session_id="s", start_s=1.0, turns=(turn("r", 40, 3, arrival=1.0),), parent_session_id=None,
                      key_scope="")
    wl = Workload("t", "test", "open", None, (session,))
    m = replay(wl, step_s=0.01).to_dict()
    # step 1 prefills 40 tokens and emits token 1 at t=1.01; two decode steps emit tokens 2 and 3
    assert m["ttft_s"]["mean"] == pytest.approx(0.01)
    assert m["tpot_s"]["mean"] == pytest.approx(0.01)
    assert m["e2e_s"]["mean"] == pytest.approx(0.03)
    assert m["completed"] == 1 and m["output_tokens"] == 3 and m["steps"] == 3


def test_closed_loop_next_turn_waits_for_completion_plus_think_time_and_hits_the_prefix():
    turns = (turn("t0", 128, 2, keys=[1, 2], arrival=0.0), turn("t1", 200, 2, keys=[1, 2, 3], think=5.0))
    wl = Workload("t", "test", "closed", 64, (Session(session_id="s", start_s=0.0, turns=turns,
                                                      parent_session_id=None, key_scope="s"),))
    metrics = replay(wl)
    m = metrics.to_dict()
    assert m["completed"] == 2
    # turn 1 ends at 0.02 s; turn 2 is sent at 5.02 s and finishes two steps later
    assert metrics.last_finish_s == pytest.approx(5.04)
    # the second prompt's first 128 tokens (8 blocks of 16) hit turn 1's cached blocks
    assert m["prefix_hit_rate"] == pytest.approx(128 / (128 + 200))


def test_request_larger_than_the_pool_is_counted_failed_and_the_session_goes_on():
    turns = (turn("big", 2000, 2, arrival=0.0), turn("small", 20, 2, think=1.0))
    wl = Workload("t", "test", "closed", None, (Session(session_id="s", start_s=0.0, turns=turns,
                                                        parent_session_id=None, key_scope=""),))
    m = replay(wl, num_blocks=8).to_dict()
    assert (m["completed"], m["failed"]) == (1, 1)


def test_percentiles_interpolate_like_numpy():
    values = [1.0, 2.0, 3.0, 4.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 90) == pytest.approx(3.7)
    assert summary([]) == {"mean": None, "p50": None, "p90": None, "p99": None}
    assert math.isnan(percentile([], 50))


def test_same_seed_same_bytes_and_no_request_lost():
    wl = generate_agent_sessions(3, num_sessions=6)
    config = ReplayConfig(model="qwen3-30b-a3b", gpu="h100", kv_cache_memory=2 * 2**30)
    first, _ = run_replay(wl, config)
    second, _ = run_replay(generate_agent_sessions(3, num_sessions=6), config)
    assert json.dumps(first) == json.dumps(second)
    metrics = first["metrics"]
    assert metrics["completed"] + metrics["failed"] == wl.num_requests
    assert metrics["preemptions"] > 0 or metrics["evicted_blocks"] > 0  # 2 GiB is tight for these sessions


def test_more_memory_never_hurts_the_hit_rate():
    """Also a regression: at 4 GiB a step that only preempted (the last runner preempted itself) was taken
    for a stall."""
    wl = generate_agent_sessions(1, num_sessions=6)
    tight, _ = run_replay(wl, ReplayConfig(kv_cache_memory=4 * 2**30))
    roomy, _ = run_replay(wl, ReplayConfig(kv_cache_memory=8 * 2**30))
    assert roomy["metrics"]["prefix_hit_rate"] > tight["metrics"]["prefix_hit_rate"]
    assert roomy["metrics"]["ttft_s"]["p90"] < tight["metrics"]["ttft_s"]["p90"]


def long_prompt_sessions(num_sessions=8, turns=3, base=6000, key_block=64):
    """Agent-like sessions whose turns grow by ``base`` tokens: long chunked prefills next to decoding requests."""
    sessions = []
    for s in range(num_sessions):
        turns_ = []
        for t in range(turns):
            prompt = base * (t + 1) + 37 * s
            keys = [s * 1000 + i for i in range(prompt // key_block)]
            turns_.append(turn(f"s{s}t{t}", prompt, 150 + 10 * s, keys, arrival=0.3 * s if t == 0 else None, think=0.5))
        sessions.append(Session(session_id=f"s{s}", start_s=0.3 * s, turns=tuple(turns_), parent_session_id=None,
                                key_scope=f"s{s}"))
    return Workload("long", "test", "closed", key_block, tuple(sessions))


@pytest.mark.parametrize("workload,budget_gib,policy,token_budget,block_size", [
    ("generator", 3.0, "vllm", 8192, 16), ("generator", 16.0, "vllm", 8192, 16),
    ("generator", 3.0, "vamp-reclaim", 8192, 16),
    # long chunked prefills beside decodes, with eviction and preemption: prefill runs (core.runs) are taken
    ("long", 2.0, "vllm", 512, 64), ("long", 4.0, "vllm", 1024, 128), ("long", 3.0, "static-offload", 512, 64),
    ("long", 8.0, "vllm", 2048, 16),
])
def test_fast_paths_are_exact(workload, budget_gib, policy, token_budget, block_size, monkeypatch):
    """Runs of identical decode steps, and runs of one full-chunk prefill beside decodes (core.runs), are skipped
    without per-step scheduling: every metric and every book must be the same as stepping one by one."""
    from moetide.core import runs
    from moetide.sim.setup import build_replay

    taken = []
    real_finish = runs.finish
    monkeypatch.setattr(runs, "finish", lambda sched, run, k: (taken.append(k), real_finish(sched, run, k)))
    results = []
    for fast in (False, True):
        wl = generate_agent_sessions(2, num_sessions=5) if workload == "generator" else long_prompt_sessions()
        built = build_replay(wl, ReplayConfig(kv_cache_memory=int(budget_gib * 2**30), policy=policy,
                                              block_size=block_size,
                                              max_num_batched_tokens=token_budget))
        built.replay.fast_forward = fast
        metrics = built.replay.run()
        pool = built.replay.scheduler.kv.pool
        pool.check_invariants()
        results.append((metrics.to_dict(), list(metrics.ttft), list(metrics.itl), list(metrics.itl_weight),
                        metrics.kv_usage, pool.num_evicted_blocks, pool.cached_free_block_ids()))
    assert results[0] == results[1]
    assert results[0][0]["steps"] > (1000 if workload == "generator" else 500)
    if workload == "long":
        assert sum(taken) >= 20  # prefill runs were taken


def test_ttft_counts_from_the_send_time_not_the_next_step():
    """Regression: a request sent during a step was timed from that step's end, shortening its TTFT."""
    sessions = (
        Session(session_id="a", start_s=0.0, turns=(turn("a", 40, 1, arrival=0.0),), parent_session_id=None,
                key_scope=""),
        Session(session_id="b", start_s=0.5, turns=(turn("b", 40, 1, arrival=0.5),), parent_session_id=None,
                key_scope=""),
    )
    metrics = replay(Workload("t", "test", "open", None, sessions), step_s=1.0)
    # a runs 0 -> 1 s; b, sent at 0.5 s, is scheduled at 1 s and emits at 2 s: TTFT 1.5 s, not 1.0 s
    assert sorted(metrics.ttft) == [1.0, 1.5]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(1e-6, 1e3, allow_nan=False), st.integers(1, 40)), min_size=1, max_size=60))
def test_weighted_summary_equals_the_expanded_summary_exactly(pairs):
    """ITL is stored as (gap, how many requests had it); its summary must equal the per-token one."""
    values = [v for v, _ in pairs]
    weights = [w for _, w in pairs]
    expanded = [v for v, w in pairs for _ in range(w)]
    weighted, plain = weighted_summary(values, weights), summary(expanded)
    assert weighted["mean"] == pytest.approx(plain.pop("mean"), rel=1e-12)
    assert {k: v for k, v in weighted.items() if k != "mean"} == plain  # percentiles bit for bit


def test_batch_limits_default_to_vllm_serving_defaults_per_gpu():
    """vLLM 0.32's EngineArgs.get_batch_defaults for its OpenAI server: larger batches from 70 GiB, but not on A100."""
    from moetide.sim.setup import build_replay
    from moetide.sim.vllm_defaults import vllm_serving_defaults
    from moetide.specs import get_gpu

    assert vllm_serving_defaults(get_gpu("h100")) == (8192, 1024)
    assert vllm_serving_defaults(get_gpu("h200")) == (8192, 1024)
    assert vllm_serving_defaults(get_gpu("a100-80gb")) == (2048, 256)
    assert vllm_serving_defaults(get_gpu("v100-32gb")) == (2048, 256)
    built = build_replay(generate_agent_sessions(1, num_sessions=1), ReplayConfig(gpu="a100-80gb"))
    assert (built.config.max_num_batched_tokens, built.config.max_num_seqs) == (2048, 256)
    built = build_replay(generate_agent_sessions(1, num_sessions=1), ReplayConfig(max_num_seqs=8))
    assert (built.config.max_num_batched_tokens, built.config.max_num_seqs) == (8192, 8)


def test_first_chunk_admission_preempts_more_than_full_sequence_admission():
    """--no-scheduler-reserve-full-isl (older vLLM) admits on the first chunk: under pressure later chunks and
    decodes preempt what was admitted too early."""
    from moetide.sim.setup import build_replay

    preemptions = {}
    for full in (True, False):
        built = build_replay(generate_agent_sessions(2, num_sessions=5),
                             ReplayConfig(kv_cache_memory=3 * 2**30, scheduler_reserve_full_isl=full))
        preemptions[full] = built.replay.run().preemptions
    assert preemptions[False] > 20 and preemptions[True] < preemptions[False] // 4  # measured: 71 and 0


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("policy", ["vllm", "vamp", "static-offload"])
def test_shallow_models_replay_under_every_offloading_policy(tmp_path, layers, policy):
    """A one- or two-layer config.json (what make-test-model writes) replays: the staging room is sized by the
    layers the model has, never more buffers than layers. (A small KV budget: at the H100's whole free memory a
    model this small would get tens of millions of blocks.)"""
    config = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 512,
              "hidden_size": 64, "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "intermediate_size": 64, "moe_intermediate_size": 32, "num_experts": 4,
              "num_experts_per_tok": 2, "max_position_embeddings": 4096, "torch_dtype": "float32",
              "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    turns = (turn("t0", 300, 4, keys=[1, 2], arrival=0.0), turn("t1", 400, 4, keys=[1, 2, 3], think=1.0))
    workload = Workload("t", "test", "closed", 64, (Session(session_id="s", start_s=0.0, turns=turns,
                                                            parent_session_id=None, key_scope="s"),))
    doc, _ = run_replay(workload, ReplayConfig(model=str(path), gpu="h100", policy=policy,
                                               kv_cache_memory=int(0.01 * 2**30)))
    assert doc["metrics"]["completed"] == 2
