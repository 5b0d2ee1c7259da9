"""The replay and the engine make the same decisions on the same input, for every registered pressure policy.

Why this exists: DESIGN.md's one rule is that both drivers run one scheduler core, so "if a policy works in replay,
the engine makes exactly the same decisions on the same inputs". Each driver still builds its own pool, expert line
and policy (``sim/setup.py``, ``engine/build.py``) and drives its own loop, and that is where they drift apart: the
engine's ``policy="static-offload"`` once offloaded nothing at start, because only the replay's builder read the
policy's ``offload_at_start``. Every policy's unit tests passed; only running both drivers on one input shows it.

What runs: a tiny random Mixtral checkpoint (4 MoE layers, bf16, so the replay's spec, read from its config.json,
counts the same bytes as the engine's tensors), and a tiny Qwen3-Next with prefix caching on (states cached at block
boundaries in both drivers, ``core.mamba_states``; ``Case``), each with six two-turn sessions that share a system
prompt, each session's second turn extending its first (prefix hits, then evictions). The KV budget is
``Case.kv_blocks`` blocks on both sides, small enough that prefixes are evicted and requests preempted;
``max_offload_ratio`` lets policies offload. Replay (``build_replay``, its fast paths off so every step goes
through ``schedule()``) runs first, then the engine (``Engine.generate``, one call per turn round, each session's
next turn sent in the order its previous one finished, as the replay sends them).

Same inputs on both sides where the public API allows: the engine's ``clock`` replays the replay's clock, step for
step; ``vamp``'s coefficients are one fixed ``VampParams`` (a ``FixedSteps`` step record counted from the log, not
measured) given to the engine through ``policy_params`` and to the replay through
``build_replay(vamp_coefficients=...)``. Nothing asserted here depends on timing.

The decision log: at start, the experts offloaded and the pool's size; per ``schedule()`` call, the tokens each
request is scheduled (with where its chunk starts, the blocks it holds, and how many of them are host KV blocks),
who is preempted, failed or finished, blocks evicted, experts offloaded and whether a region was reclaimed, host
hits promoted, the number of experts offloaded and the pool's size. Requests are named by (session, turn), not by
driver-assigned ids; block ids differ between drivers by construction (the arena numbers KV blocks after the
experts' pages) and are compared as counts.

The two expert lines once turned an offloaded expert into different numbers of KV blocks (the replay kept its
staging room out of each expert's bytes, the engine gave whole pages); ``test_expert_ledgers_agree`` holds them
to one count.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from moetide.core.pressure import POLICIES, VampParams, policy_entry  # noqa: E402
from moetide.engine.runner import Engine  # noqa: E402
from moetide.engine.testmodel import TinyModelArgs, make_test_model  # noqa: E402
from moetide.perf.attention import HostKVLayout  # noqa: E402
from moetide.sim.setup import ReplayConfig, build_replay  # noqa: E402
from moetide.workloads.base import BlockKeys, Session, Turn, Workload  # noqa: E402

# ---- the input -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """One checkpoint and the budget that makes both drivers evict, preempt and offload on the turns below."""

    name: str
    model_args: TinyModelArgs
    block_size: int
    block_bytes: int  # one KV block: block_size tokens of every full-attention layer
    page_bytes: int
    kv_blocks: int  # device KV on both sides
    max_num_batched_tokens: int
    mamba_ssm_cache_dtype: str = "auto"  # the replay's; "float32" as the engine keeps recurrent states
    host_blocks: int = 8  # host KV tier of the host-KV cases
    max_offload_ratio: float = 0.25  # 4 of the 16 routed experts
    max_num_seqs: int = 8


# 4 layers, so the offload cap (a quarter of the experts) spreads one expert over each; bf16: the replay's specs count
# 2 bytes per weight and per KV element, as the engine's tensors hold them. Blocks of 4 tokens: 2 KiB, two a page; a
# tiny expert (12 KiB) is three pages; 20 blocks: the largest request (11 blocks) fits alone, six sessions do not.
# Prompts of 30-43 tokens against a 32-token step: chunked prefill.
MIXTRAL = Case("mixtral", TinyModelArgs(arch="mixtral", num_layers=4, dtype="bfloat16"), block_size=4,
               block_bytes=4 * 4 * 2 * 2 * 16 * 2, page_bytes=4096, kv_blocks=20, max_num_batched_tokens=32)
# Qwen3-Next with prefix caching (align mode): one full-attention layer beside three Gated DeltaNet layers. With
# recurrent states in fp32 (the engine's; the replay's mamba_ssm_cache_dtype float32) vLLM's page-aligned block is
# 48 tokens (6 KiB, three 2 KiB pages) and a state fills three blocks, one per group; prompts of 338-483 tokens
# against a 192-token step.
HYBRID = Case("qwen3_next", TinyModelArgs(arch="qwen3_next", num_layers=4, dtype="bfloat16"), block_size=48,
              block_bytes=48 * 1 * 2 * 2 * 16 * 2, page_bytes=2048, kv_blocks=22, max_num_batched_tokens=192,
              mamba_ssm_cache_dtype="float32")
NUM_SESSIONS = 6
SYSTEM_KEYS = tuple(range(1000, 1004))  # 4 blocks every session's prompt starts with
# per turn round: (new full blocks appended to the session's context, partial-block tail tokens, output tokens)
ROUNDS = ((3, 2, 8), (2, 1, 6))
ROUND_GAP_S = 1000.0  # round r is sent at r x this: long after round r-1 has finished in either driver

# ---- vamp's coefficients: fixed numbers, the same on both sides --------------------------------------------
VAMP_HORIZON_S = 0.004  # replay steps of this tiny model are modeled at ~1 ms: a review every few steps
STEP_BUSY_S = 0.0005  # busy seconds FixedSteps counts per non-empty step
STAGING_SHARE_PER_EXPERT = 1e-3
PREFILL_S_PER_TOKEN = 1e-3


class FixedSteps:
    """``StepStats`` from the decision log instead of a clock: each non-empty step adds ``STEP_BUSY_S``; each
    offloaded expert adds ``STAGING_SHARE_PER_EXPERT`` of staging per step-second."""

    def __init__(self) -> None:
        self.busy = 0.0

    def busy_s(self) -> float:
        return self.busy

    def staging_share(self, num_offloaded: int) -> float:
        return STAGING_SHARE_PER_EXPERT * max(num_offloaded, 0)


def fixed_vamp_params(steps: FixedSteps, case: Case = MIXTRAL) -> VampParams:
    return VampParams(prefill_s_per_token=PREFILL_S_PER_TOKEN, steps=steps, block_size=case.block_size,
                      horizon_s=VAMP_HORIZON_S, remap_s_per_expert=0.0, reclaim_check_s=VAMP_HORIZON_S,
                      reclaim_hold_s=VAMP_HORIZON_S)


def _turn_keys(session: int, turn: int) -> list[int]:
    """Block keys of a turn's prompt: the system prompt, then every block the session has added so far."""
    keys = list(SYSTEM_KEYS)
    for t in range(turn + 1):
        keys += [100_000 * (session + 1) + 100 * t + i for i in range(ROUNDS[t][0])]
    return keys


def _block_tokens(case: Case, key: int) -> list[int]:
    rng = random.Random(key)
    return [rng.randrange(1, case.model_args.vocab_size) for _ in range(case.block_size)]


def _tail_tokens(case: Case, session: int, turn: int) -> list[int]:
    rng = random.Random(f"tail {session} {turn}")
    return [rng.randrange(1, case.model_args.vocab_size) for _ in range(ROUNDS[turn][1])]


def label(session: int, turn: int) -> str:
    return f"s{session}t{turn}"


def engine_prompt(case: Case, session: int, turn: int) -> list[int]:
    """The token ids the replay's block keys stand for: equal keys, equal tokens (so equal hashes)."""
    return ([tok for key in _turn_keys(session, turn) for tok in _block_tokens(case, key)]
            + _tail_tokens(case, session, turn))


def replay_workload(case: Case = MIXTRAL) -> Workload:
    sessions = []
    for s in range(NUM_SESSIONS):
        turns = tuple(
            Turn(prompt_tokens=len(_turn_keys(s, t)) * case.block_size + tail, output_tokens=out,
                 block_keys=BlockKeys.from_keys(_turn_keys(s, t)), arrival_s=t * ROUND_GAP_S, think_time_s=0.0,
                 cached_tokens=None, request_id=label(s, t))
            for t, (_, tail, out) in enumerate(ROUNDS))
        sessions.append(Session(session_id=f"s{s}", start_s=0.0, turns=turns, parent_session_id=None, key_scope=""))
    return Workload(name="differential", source="tests/test_drivers_differential.py", mode="open",
                    key_block_size=case.block_size, sessions=tuple(sessions))


# ---- the decision log ---------------------------------------------------------------------------------------


@dataclass
class DecisionLog:
    start: dict = field(default_factory=dict)
    steps: list[dict] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # the scheduler's clock at each schedule()
    finish_order: list[str] = field(default_factory=list)


def start_entry(scheduler, residency) -> dict:
    return {"offloaded": sorted(residency.all_offloaded()), "num_offloaded": residency.num_offloaded,
            "pool_blocks": scheduler.kv.pool.num_blocks}


def record(scheduler, residency, name_of, steps: FixedSteps | None = None) -> DecisionLog:
    """Wrap ``scheduler``'s schedule() and update() (on the instance: both drivers call them by attribute) so every
    step's decisions go into the returned log."""
    log = DecisionLog(start=start_entry(scheduler, residency))
    schedule, update = scheduler.schedule, scheduler.update
    kv = scheduler.kv

    def host_blocks(request_id: str) -> int:
        tier = kv.pool.host_tier
        return 0 if tier is None else tier.count(kv.get_blocks(request_id))

    def logged_schedule(now_s=None):
        out = schedule(now_s)
        log.times.append(scheduler.now_s)
        if steps is not None and out.scheduled:
            steps.busy += STEP_BUSY_S
        log.steps.append({
            "scheduled": [(name_of(r.request_id), n, start, kv.num_held_blocks(r.request_id),
                           host_blocks(r.request_id))
                          for (r, n), start in zip(out.scheduled, out.num_computed_before)],
            "preempted": [name_of(r.request_id) for r in out.preempted],
            "failed": [name_of(r.request_id) for r in out.failed],
            "finished": [],
            "evicted": out.num_evicted_blocks,
            "offloaded": len(out.offloaded),
            "reclaimed": bool(out.reclaimed),
            "promoted": len(out.promoted),
            "num_offloaded": residency.num_offloaded,
            "pool_blocks": kv.pool.num_blocks,
            "free_blocks": kv.pool.num_free_blocks,
        })
        return out

    def logged_update(out, sampled=None, now_s=None):
        emitted, finished = update(out, sampled, now_s)
        names = [name_of(r.request_id) for r in finished]
        log.steps[-1]["finished"] = names
        log.finish_order += names
        return emitted, finished

    scheduler.schedule, scheduler.update = logged_schedule, logged_update
    return log


# ---- the drivers --------------------------------------------------------------------------------------------
def replay_config(checkpoint, case: Case, policy: str, kv_blocks: int | None = None, host_kv: bool = False):
    return ReplayConfig(model=str(checkpoint / "config.json"), policy=policy, block_size=case.block_size,
                        max_num_batched_tokens=case.max_num_batched_tokens, max_num_seqs=case.max_num_seqs,
                        kv_cache_memory=(kv_blocks or case.kv_blocks) * case.block_bytes,
                        max_offload_ratio=case.max_offload_ratio,
                        kv_host_memory=case.host_blocks * case.block_bytes if host_kv else 0,
                        mamba_ssm_cache_dtype=case.mamba_ssm_cache_dtype)


def run_replay(checkpoint, case: Case, policy: str, host_kv: bool = False) -> tuple[DecisionLog, object]:
    steps = FixedSteps()
    # the replay's host tier takes its staging ring out of the KV budget (the engine's ring lies outside it)
    ring = -(-HostKVLayout().ring_bytes // case.block_bytes) if host_kv else 0
    config = replay_config(checkpoint, case, policy, case.kv_blocks + ring, host_kv)
    built = build_replay(replay_workload(case), config, vamp_coefficients=fixed_vamp_params(steps, case))
    device_blocks = built.host_kv.num_device_blocks if host_kv else built.budget.num_blocks
    assert device_blocks == case.kv_blocks, "the replay's budget is not the engine's: fix the test's arithmetic"
    built.replay.fast_forward = False  # decode and prefill runs skip schedule(); they are exact (test_sim_replay)
    log = record(built.replay.scheduler, built.expert_line.residency, lambda rid: rid, steps)
    built.replay.run()
    round_one_end = max(t for t, s in zip(log.times, log.steps) if any(n.endswith("t0") for n, *_ in s["scheduled"]))
    assert round_one_end < ROUND_GAP_S, "the replay's first round ran into the second: raise ROUND_GAP_S"
    return log, built


def build_engine(checkpoint, case: Case, policy: str, clock=None, steps: FixedSteps | None = None,
                 host_kv: bool = False) -> Engine:
    params = ({"params": fixed_vamp_params(steps or FixedSteps(), case)} if policy_entry(policy).needs_costs
              else None)
    return Engine(checkpoint, kv_cache_memory=case.kv_blocks * case.block_bytes, page_bytes=case.page_bytes,
                  block_size=case.block_size, max_num_batched_tokens=case.max_num_batched_tokens,
                  max_num_seqs=case.max_num_seqs, max_offload_ratio=case.max_offload_ratio, ignore_eos=True,
                  policy=policy, policy_params=params, clock=clock,
                  kv_host_memory=case.host_blocks * case.block_bytes if host_kv else 0)


def run_engine(checkpoint, case: Case, policy: str, times: list[float], host_kv: bool = False) -> DecisionLog:
    """The engine on the same turns, its clock replaying ``times`` (the replay's, one per schedule())."""
    pending = iter(times)
    last = [times[-1] if times else 0.0]

    def clock() -> float:  # past the replay's steps (a longer run, which the comparison reports): keep counting
        last[0] = next(pending, last[0] + 1.0)
        return last[0]

    steps = FixedSteps()
    engine = build_engine(checkpoint, case, policy, clock, steps, host_kv)
    names: dict[str, str] = {}
    log = record(engine.scheduler, engine.residency, lambda rid: names[rid], steps)
    initial_blocks = engine.storage.arena.config.num_kv_pages * case.page_bytes // case.block_bytes
    assert initial_blocks == case.kv_blocks, "the engine's budget is not the case's kv_blocks: fix its arithmetic"
    order = list(range(NUM_SESSIONS))
    num_requests = 0
    for turn, (_, _, max_tokens) in enumerate(ROUNDS):
        for s in order:  # the engine numbers requests "0", "1", ... in the order it is given them
            names[str(num_requests)] = label(s, turn)
            num_requests += 1
        engine.generate([engine_prompt(case, s, turn) for s in order], max_tokens)
        # the replay sends a session's next turn when its last one finished: ties in finish order
        order = [int(name[1:].split("t")[0]) for name in log.finish_order if name.endswith(f"t{turn}")]
    return log


# ---- comparing ----------------------------------------------------------------------------------------------
def _show(entry: dict) -> str:
    return "\n".join(f"      {k}: {v}" for k, v in entry.items())


def assert_same_decisions(replay: DecisionLog, engine: DecisionLog) -> None:
    if replay.start != engine.start:
        message = f"start of run differs:\n  replay:\n{_show(replay.start)}\n  engine:\n{_show(engine.start)}"
        raise AssertionError(message)
    for i, (a, b) in enumerate(zip(replay.steps, engine.steps)):
        if a != b:
            keys = [k for k in a if a[k] != b.get(k)]
            before = "\n".join(f"    step {j}: {replay.steps[j]['scheduled']}" for j in range(max(i - 2, 0), i))
            message = (f"step {i} of {len(replay.steps)} differs in {keys}\n  steps before (both):\n{before}\n"
                       f"  replay:\n{_show(a)}\n  engine:\n{_show(b)}")
            raise AssertionError(message)
    assert len(replay.steps) == len(engine.steps), (
        f"the replay took {len(replay.steps)} steps and the engine {len(engine.steps)}; the longer one went on with "
        f"{(replay.steps or engine.steps)[min(len(replay.steps), len(engine.steps)):][:3]}")


def _first_admission_hits(log: DecisionLog) -> int:
    """Tokens found cached when each request was first scheduled (where its first chunk started)."""
    seen: set[str] = set()
    hits = 0
    for step in log.steps:
        for name, _, start, *_ in step["scheduled"]:
            if name not in seen:
                seen.add(name)
                hits += start
    return hits


def _totals(log: DecisionLog) -> dict[str, int]:
    steps = log.steps
    return {"evicted": sum(s["evicted"] for s in steps), "preempted": sum(len(s["preempted"]) for s in steps),
            "hit_tokens": _first_admission_hits(log),
            "offloaded": log.start["num_offloaded"] + sum(s["offloaded"] for s in steps),
            "host_blocks": max((h for s in steps for *_, h in s["scheduled"]), default=0)}


# Which mechanisms the input must make each policy use (checked on the replay's log before comparing).
EXERCISED = {"vllm": ("evicted", "preempted"), "static-offload": ("evicted", "offloaded"),
             "vamp": ("evicted", "offloaded"), "vamp-reclaim": ("evicted", "offloaded")}
# On the hybrid checkpoint vamp sees no reuse worth its staging and keeps the line (Mixtral's case moves it): its
# evictions and preemptions are what the two drivers must decide alike there.
EXERCISED_HYBRID = {**EXERCISED, "vamp": ("evicted", "preempted", "hit_tokens"),
                    "vamp-reclaim": ("evicted", "preempted", "hit_tokens"),
                    "vllm": ("evicted", "preempted", "hit_tokens"), "static-offload": ("evicted", "offloaded")}

@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, torch_one_thread):
    """``checkpoints(case) -> Path``, each made once."""
    made = {}

    def get(case: Case):
        if case.name not in made:
            made[case.name] = make_test_model(case.model_args, tmp_path_factory.mktemp(f"differential-{case.name}"))
        return made[case.name]

    return get


@pytest.fixture(scope="module")
def checkpoint(checkpoints):
    return checkpoints(MIXTRAL)


@pytest.mark.parametrize("case", [MIXTRAL, HYBRID], ids=lambda c: c.name)
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_decision_logs_match(checkpoints, case, policy):
    """Mixtral, and Qwen3-Next with prefix caching (its states cached at block boundaries, hits resuming there)."""
    checkpoint = checkpoints(case)
    replay, _ = run_replay(checkpoint, case, policy)
    totals = _totals(replay)
    exercised = (EXERCISED_HYBRID if case is HYBRID else EXERCISED).get(policy, ("evicted",))
    assert all(totals[m] > 0 for m in exercised), (
        f"the input no longer makes {policy} use {exercised} in replay: {totals}")
    assert_same_decisions(replay, run_engine(checkpoint, case, policy, replay.times))


# The replay models a host KV tier beside a fixed line only (vllm, static-offload): ReplayConfig refuses vamp there.
@pytest.mark.parametrize("policy", [
    "vllm", "static-offload"])
def test_decision_logs_match_with_host_kv(checkpoint, policy):
    replay, built = run_replay(checkpoint, MIXTRAL, policy, host_kv=True)
    totals = _totals(replay)
    assert totals["host_blocks"] > 0 and totals["evicted"] > 0, f"no KV spilled to the host tier in replay: {totals}"
    assert_same_decisions(replay, run_engine(checkpoint, MIXTRAL, policy, replay.times, host_kv=True))


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_start_offload_matches(checkpoint, policy):
    """The experts offloaded before the first request: the same (layer, expert) keys on both sides. (The engine
    once offloaded none for ``static-offload``: only ``sim/setup.py`` read ``offload_at_start``.)"""
    built = build_replay(replay_workload(), replay_config(checkpoint, MIXTRAL, policy),
                         vamp_coefficients=fixed_vamp_params(FixedSteps()))
    engine = build_engine(checkpoint, MIXTRAL, policy)
    replay_start = start_entry(built.replay.scheduler, built.expert_line.residency)
    engine_start = start_entry(engine.scheduler, engine.residency)
    assert (engine_start["offloaded"], engine_start["num_offloaded"]) == (
        replay_start["offloaded"], replay_start["num_offloaded"]), (
        f"{policy}: experts offloaded at start: engine {engine_start['offloaded']}, replay {replay_start['offloaded']}")


def test_expert_ledgers_agree(checkpoint):
    """Both expert lines, before any offload: the KV blocks that offloading n experts adds, for n up to the cap."""
    replay_line = build_replay(replay_workload(), replay_config(checkpoint, MIXTRAL, "vllm")).expert_line
    engine_line = build_engine(checkpoint, MIXTRAL, "vllm").parts.expert_line
    cap = replay_line.residency.max_num_offloaded
    assert cap == engine_line.residency.max_num_offloaded > 0
    assert replay_line.block_bytes == engine_line.block_bytes
    gained = [(n, replay_line.blocks_gained(n), engine_line.blocks_gained(n)) for n in range(cap + 1)]
    assert all(r == e for _, r, e in gained), f"(experts, replay blocks, engine blocks): {gained}"
