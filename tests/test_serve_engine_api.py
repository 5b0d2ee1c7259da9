"""The engine's incremental API that the server drives: requests join and leave between steps, an abort frees a
request's blocks wherever it is (running, waiting, preempted), and ``generate`` is the same loop."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from moetide.engine.runner import Engine  # noqa: E402
from moetide.engine.sampling import SamplingParams  # noqa: E402

PROMPTS = [[5, 6, 7, 8] * 5, [9, 10, 11], [12] * 30]


def check_pool(engine: Engine) -> None:
    kv = engine.scheduler.kv
    kv.pool.check_invariants()
    kv.check_invariants()


def drive(engine: Engine, until=None) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests() and not (until and until(tokens)):
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        check_pool(engine)
    return tokens


def test_requests_that_join_between_steps_get_what_generate_gives(tiny_checkpoint):
    model = tiny_checkpoint("qwen3_moe")
    engine = Engine(model, kv_cache_memory=64 * 2**20, ignore_eos=True)
    expected = [o.token_ids for o in engine.generate(PROMPTS, 8).outputs]
    engine = Engine(model, kv_cache_memory=64 * 2**20, ignore_eos=True)
    first = engine.add_request(PROMPTS[0], SamplingParams(8))
    tokens = drive(engine, until=lambda t: len(t.get(first, ())) >= 3)  # the others join mid-decode
    late = [engine.add_request(p, SamplingParams(8)) for p in PROMPTS[1:]]
    for request_id, new in drive(engine).items():
        tokens.setdefault(request_id, []).extend(new)
    assert [tokens[r] for r in (first, *late)] == expected


def test_an_abort_frees_the_blocks_of_a_running_and_of_a_waiting_request(tiny_checkpoint):
    engine = Engine(tiny_checkpoint("qwen3_moe"), kv_cache_memory=64 * 2**20, ignore_eos=True, max_num_seqs=1)
    running = engine.add_request(PROMPTS[2], SamplingParams(50))
    waiting = engine.add_request(PROMPTS[0], SamplingParams(50))
    drive(engine, until=lambda t: len(t.get(running, ())) >= 2)
    kv = engine.scheduler.kv
    assert kv.num_held_blocks(running) == 2 and kv.num_held_blocks(waiting) == 0
    free_before = kv.pool.num_free_blocks
    assert engine.abort_request(waiting) and engine.abort_request(running)
    assert kv.pool.num_free_blocks == free_before + 2 and kv.request_ids == []
    assert not engine.has_unfinished_requests() and not engine.abort_request(running)
    check_pool(engine)
    again = engine.add_request(PROMPTS[2], SamplingParams(4))
    assert drive(engine)[again]  # the engine goes on after aborts; its prefix is found cached
    assert engine.metrics().prefix_hit_tokens == 16


def test_an_abort_of_a_preempted_request_leaves_the_pool_whole(tiny_checkpoint):
    engine = Engine(tiny_checkpoint("qwen3_moe"), kv_cache_memory=int(0.05 * 2**20), ignore_eos=True)
    ids = [engine.add_request(p, SamplingParams(40)) for p in PROMPTS]
    drive(engine, until=lambda t: engine.scheduler.num_preemptions > 0)
    assert engine.scheduler.num_preemptions > 0
    preempted = [r.request_id for r in engine.scheduler.waiting if r.num_preemptions]
    assert preempted and engine.abort_request(preempted[0])
    check_pool(engine)
    finished = drive(engine)
    assert preempted[0] not in finished or len(finished[preempted[0]]) < 40
    assert set(ids) - {preempted[0]} <= set(finished) and engine.scheduler.kv.request_ids == []


def test_sampling_params_are_checked_and_a_stop_token_ends_a_request(tiny_checkpoint):
    for bad in (dict(max_tokens=0), dict(max_tokens=4, temperature=-1), dict(max_tokens=4, top_p=0)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    engine = Engine(tiny_checkpoint("qwen3_moe"), kv_cache_memory=64 * 2**20, ignore_eos=True)
    [free_run] = [o.token_ids for o in engine.generate([PROMPTS[0]], 6).outputs]
    stop_at = free_run[2]
    request_id = engine.add_request(PROMPTS[0], SamplingParams(6, stop_token_ids=frozenset({stop_at})))
    outs = [o for o in _all_outputs(engine) if o.request_id == request_id]
    assert [t for o in outs for t in o.new_token_ids] == free_run[: free_run.index(stop_at) + 1]
    assert outs[-1].finish_reason == "stop"


def _all_outputs(engine: Engine):
    while engine.has_unfinished_requests():
        yield from engine.step()
