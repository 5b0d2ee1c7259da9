"""``--policy vamp`` in the engine: the core's VAMP policy priced with the engine's measurements
(``engine.vamp``), and vamp-reclaim's way back (``ExpertLine.reclaim_last`` over ``ArenaLayout``).

The scheduler's clock is a step counter here (``StepClock``), so when the policy reviews its line does not depend on
this machine's speed; what it weighs (measured prefill, copy and step seconds) does, and the tests assert only what
holds at any speed: greedy tokens equal transformers' whatever the line does, the line moves when evicted prefixes
keep coming back, the cap holds, and a reclaimed expert computes exactly as before.
"""

from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from moetide.engine.runner import Engine  # noqa: E402
from moetide.engine.vamp import EngineStepStats  # noqa: E402
from moetide.errors import UserError  # noqa: E402
from engine_parity import MAX_TOKENS, PAGE_BYTES, POLICY_PAGES, TIGHT, check_books, parity_prompts  # noqa: E402


class StepClock:
    """``dt`` seconds more at every read (the engine reads its clock once per step)."""

    def __init__(self, dt: float) -> None:
        self.dt, self.now = dt, 0.0

    def __call__(self) -> float:
        self.now += self.dt
        return self.now


# a cost record of this project's VM's order (`Engine(...).costs` there: 3.1e-6, 6.2e-6, 1.9e-5), with the copy
# at a sixth: the tests' decisions are then the same on any machine, and staging is cheap enough to pay off
COSTS = {"prefill_s_per_token": 3e-6, "copy_s_per_expert": 1e-6, "expert_call_s": 2e-5}


def vamp_engine(checkpoint, arch: str, policy: str = "vamp", clock: StepClock | None = None, costs=COSTS,
                **options) -> Engine:
    options = {**TIGHT, "kv_cache_memory": POLICY_PAGES[arch] * PAGE_BYTES, "max_offload_ratio": 0.5,
               "vamp_horizon_s": 0.05, **options}
    return Engine(checkpoint(arch), policy=policy, clock=clock or StepClock(0.01), costs=costs, **options)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_vamp_moves_the_line_when_evicted_prefixes_return(arch, tiny_checkpoint, hf_reference):
    engine = vamp_engine(tiny_checkpoint, arch)
    policy = engine.scheduler.policy
    assert isinstance(policy.params.steps, EngineStepStats)
    allowed = grown_allowance(policy)
    for _ in range(2):  # the second call's prompts find their prefixes evicted: ghost hits
        result = engine.generate(parity_prompts(), MAX_TOKENS)
        assert [o.token_ids for o in result.outputs] == hf_reference(arch)
        check_books(engine)
    # evicted prefixes came back (ghost hits) and were worth more than the coldest experts' priced staging
    assert max(allowed) > 0
    assert engine.parts.expert_line.num_new_blocks > 0  # the line moved: KV blocks came from expert pages
    assert engine.residency.offloaded_ratio <= 0.5
    assert result.stats.prefix_evictions > 0


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_a_rerun_with_the_recorded_costs_makes_the_same_decisions(arch, tiny_checkpoint):
    """Decisions follow the input and the cost record, not the machine's speed: a second engine given the
    first one's ``costs`` reviews, offloads, gives back and schedules exactly as the first."""
    def run(costs):
        engine = vamp_engine(tiny_checkpoint, arch, costs=costs)
        allowed = grown_allowance(engine.scheduler.policy)
        outputs = [[o.token_ids for o in engine.generate(parity_prompts(), MAX_TOKENS).outputs] for _ in range(2)]
        line = engine.parts.expert_line
        return engine.costs, (allowed, outputs, line.num_new_blocks, line.num_reclaims,
                              engine.scheduler.num_preemptions, engine.scheduler.num_evicted_blocks)

    costs, first = run(None)  # measured on this machine, whatever its load
    _, second = run(costs.as_dict())
    assert second == first


def grown_allowance(policy) -> list[int]:
    """Record the policy's allowed line after every review (the measured path, not the admission fallback)."""
    seen: list[int] = []
    review = policy._review

    def recording(line, now_s):
        review(line, now_s)
        seen.append(policy._allowed)

    policy._review = recording
    return seen


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_reclaim_gives_experts_back_and_they_compute_as_before(device, tiny_checkpoint, hf_reference):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (torch.cuda.is_available() is False)")
    arch = "qwen3_moe"
    clock = StepClock(0.01)
    engine = vamp_engine(tiny_checkpoint, arch, policy="vamp-reclaim", clock=clock, device=device)
    reclaims = 0
    pool = engine.scheduler.kv.pool
    for _ in range(3):
        result = engine.generate(parity_prompts(), MAX_TOKENS)
        assert [o.token_ids for o in result.outputs] == hf_reference(arch)
        check_books(engine)
        reclaims += result.stats.expert_reclaims
        # between bursts the prefix cache is dropped and one short request runs: the pool has room to spare
        # for longer than the hold, so regions the line no longer allows go back
        pool.evict(pool.num_cached_free_blocks)
        light = engine.generate([parity_prompts()[0][:4]], 24)
        reclaims += light.stats.expert_reclaims
    assert reclaims > 0 and engine.parts.expert_line.num_reclaims == reclaims
    storage, host = engine.storage, engine.parts.experts.stager.host
    for m, e in itertools.product(range(host.shape[0]), range(host.shape[1])):
        if engine.residency.is_resident(m, e):  # reclaimed ones included: their pages hold their weights again
            assert torch.equal(storage.expert_flat(m, e).cpu(), host[m, e])


def test_hybrid_model_runs_under_vamp(tiny_checkpoint, hf_reference):
    """Qwen3-Next caches no prefixes (so no ghost hits): vamp preempts like vllm and still matches."""
    engine = vamp_engine(tiny_checkpoint, "qwen3_next")
    result = engine.generate(parity_prompts(), MAX_TOKENS)
    assert [o.token_ids for o in result.outputs] == hf_reference("qwen3_next")
    assert result.stats.preemptions > 0
    check_books(engine)


def test_staging_share_is_measured_touches_times_one_copy(tiny_checkpoint):
    engine = vamp_engine(tiny_checkpoint, "mixtral")
    engine.generate(parity_prompts()[:4], 8)
    steps = engine.scheduler.policy.params.steps
    cap = engine.residency.max_num_offloaded
    shares = [steps.staging_share(n) for n in range(cap + 1)]
    assert shares[0] == 0.0 and all(b >= a for a, b in zip(shares, shares[1:])) and shares[-1] > 0
    rates = engine.parts.experts.touches.rates()
    assert all(0.0 <= r <= 1.0 for row in rates for r in row)
    steps.copy_s_per_expert *= 2  # twice the copy: about twice the share (the base step loses its staging)
    assert steps.staging_share(cap) >= 2 * shares[-1]
    assert steps.prefill_s_per_token > 0


def test_experts_computed_on_the_host_are_priced_by_their_measured_host_time(tiny_checkpoint):
    """With cold experts computed from their host copies, a touch of at most ``cold_expert_max_rows`` rows costs
    that computation (a + b·rows, measured at build), not a copy: with the host time set to zero, only the larger
    touches are left to price, and with a copy made free, only the host time is."""
    engine = vamp_engine(tiny_checkpoint, "mixtral", cold_experts="cpu", cold_expert_max_rows=2, costs=None)
    engine.generate(parity_prompts()[:4], 8)
    steps = engine.scheduler.policy.params.steps
    assert steps.host_s_per_expert > 0 and steps.host_s_per_row >= 0
    cap = engine.residency.max_num_offloaded
    touches = engine.parts.experts.touches
    rates, (host, rows) = touches.rates(), touches.host_rates()
    assert all(0.0 <= h <= r for hr, rr in zip(host, rates) for h, r in zip(hr, rr))
    assert any(h > 0 for row in host for h in row)  # decode steps touch experts with a row or two
    assert any(h < r for hr, rr in zip(host, rates) for h, r in zip(hr, rr))  # prefill steps with more
    a, b, copy = steps.host_s_per_expert, steps.host_s_per_row, steps.copy_s_per_expert
    full = steps.staging_share(cap)
    steps.host_s_per_expert = steps.host_s_per_row = 0.0
    copies_only = steps.staging_share(cap)
    steps.host_s_per_expert, steps.host_s_per_row, steps.copy_s_per_expert = a, b, 0.0
    host_only = steps.staging_share(cap)
    assert copies_only < full and 0 < host_only < full
    assert copies_only + host_only == pytest.approx(full, rel=0.05)  # the base step differs a little


def test_vamp_needs_room_to_offload(tiny_checkpoint):
    with pytest.raises(UserError, match="give it room with --max-offload-ratio"):
        vamp_engine(tiny_checkpoint, "mixtral", max_offload_ratio=0.0)


def test_reclaim_room_counts_device_blocks_only(tiny_checkpoint):
    """With host KV in the same pool, vamp-reclaim's watermark looks at the arena's blocks: a roomy host tier is
    no reason to give device KV back to the experts."""
    engine = vamp_engine(tiny_checkpoint, "mixtral", policy="vamp-reclaim", kv_host_memory=1 * 2**20)
    pool, arena = engine.scheduler.kv.pool, engine.storage.arena
    free, total = engine.parts.expert_line.kv_room(pool)
    assert total == len(arena.kv_block_ids()) < pool.num_blocks
    assert free == total  # nothing allocated yet
