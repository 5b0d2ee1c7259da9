"""Driver against driver: vLLM 0.32's real scheduler (stock, or with moetide's plugin) and moetide's core on the
same requests and token ids, step by step, with no model.

Both sides run the same arrivals. Each step, every request that reaches the end of its known tokens samples one
token (the same id on both sides), and a request stops after its recorded output length. Arrivals are in steps: an
open-loop trace's timestamps divided by ``ms_per_step``; a closed-loop session sends its next turn
``think_time / ms_per_step`` steps after the previous one finished. Each side runs the arrivals its own finishes
produce, so a divergence is followed to its consequences rather than hidden.

With ``PluginSettings`` both sides run that policy, built by the same builders from one cost record (``costs``),
the policy's clock the record's modeled step seconds: each step compares scheduled tokens, preemptions, blocks
evicted and line moves (experts offloaded, regions given back). Without, vLLM is stock and the core runs ``vllm``
(``benchmarks/vllm_fidelity.py``).

Token content: a trace's block key k (chained, per key scope) becomes key_block_size token ids derived from
(scope, k), so equal keys give equal token blocks and so equal block hashes on both sides; a prompt's tail
beyond its keyed blocks gets ids unique to the request. The core hashes the same token ids
(``core.hashing.hash_token_blocks``); vLLM hashes them with its own default. Only ``compare`` imports vLLM.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from moetide.core.blocks import BlockPool
from moetide.core.config import build_scheduler, expert_residency, make_policy
from moetide.core.expert_line import ByteLayout, ExpertLine
from moetide.core.kv_manager import KVCacheManager
from moetide.core.mamba_states import MambaStates
from moetide.core.pressure import policy_entry
from moetide.core.request import Request
from moetide.core.pressure.step_costs import EngineCosts, RecordSteps, engine_vamp_params
from moetide.vllm.settings import PluginSettings

VOCAB = 1 << 30


def sampled_token(request_id: str, index: int) -> int:
    return 1 + (index * 7919 + len(request_id)) % 50000


@dataclass
class Record:
    scheduled: dict[str, int]
    preempted: list[str]
    new_hits: dict[str, int]
    finished: list[str]
    num_evicted: int = 0  # cached blocks the policy evicted (counted where the plugin or the core evicts)
    offloaded: list[tuple[int, int]] = field(default_factory=list)  # experts whose memory went to the KV cache
    reclaimed: int = 0  # regions given back to their experts


@dataclass(frozen=True)
class LineSetup:
    """What a policy with an expert line needs on the core side, as the plugin derives it from vLLM's config:
    the settings (with the experts' shape and the cost record) and one block's bytes over every layer."""

    settings: PluginSettings
    block_bytes: int


class CoreSide:
    """moetide's core Scheduler + KVCacheManager + BlockPool, block ids 1..num_blocks-1 as vLLM numbers them (its
    block 0 is the null block); with a ``LineSetup``, the settings' policy and an expert line over ids from
    ``num_blocks`` on (the plugin's reserve), priced from the settings' cost record and clocked by its seconds."""

    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 long_prefill_token_threshold: int, reserve_full_isl: bool, mamba_groups: int = 0,
                 retention_interval: int | None = 0, line: LineSetup | None = None) -> None:
        self.pool = BlockPool(range(1, num_blocks))
        mamba = MambaStates(self.pool, block_size, mamba_groups, retention_interval=retention_interval) \
            if mamba_groups else None
        self.kv = KVCacheManager(self.pool, block_size, mamba=mamba)
        settings = line.settings if line is not None else PluginSettings()
        config = dataclasses.replace(settings.serving_config(), max_num_batched_tokens=max_num_batched_tokens,
                                     max_num_seqs=max_num_seqs)
        self.steps = self.expert_line = None
        if line is not None:
            shape = settings.experts
            residency = expert_residency(config, num_layers=shape.num_layers, num_experts=shape.num_experts,
                                         expert_bytes=shape.expert_bytes)
            if policy_entry(settings.policy).offloads_experts:
                self.expert_line = ExpertLine(residency, ByteLayout(
                    self.pool, block_bytes=line.block_bytes, kv_bytes_per_expert=shape.expert_bytes,
                    first_block_id=num_blocks))
            self.steps = RecordSteps(EngineCosts(**settings.costs), residency, shape.experts_per_token)
        steps = self.steps
        policy = make_policy(config, costs=lambda: engine_vamp_params(
            steps, block_size=block_size, chunk_tokens=max_num_batched_tokens, horizon_s=config.vamp_horizon_s))
        self.sched = build_scheduler(config, self.kv, self.expert_line, policy,
                                     long_prefill_token_threshold=long_prefill_token_threshold,
                                     scheduler_reserve_full_isl=reserve_full_isl)
        self.block_size = block_size
        self._running_before: set[str] = set()  # running after the last step: who is newly scheduled now

    def add_request(self, request_id: str, prompt: list[int], max_tokens: int) -> None:
        self.sched.add_request(Request.from_tokens(request_id, prompt, max_tokens, self.block_size))

    @property
    def has_work(self) -> bool:
        return self.sched.has_work

    def step(self) -> Record:
        line = self.expert_line
        reclaims = line.num_reclaims if line is not None else 0
        out = self.sched.schedule(self.steps.busy_s() if self.steps is not None else None)
        sampled = {r.request_id: sampled_token(r.request_id, r.num_output_tokens)
                   for (r, n), start in zip(out.scheduled, out.num_computed_before) if start + n == r.num_tokens}
        new_hits = {r.request_id: start for (r, _), start in zip(out.scheduled, out.num_computed_before)
                    if r.request_id not in self._running_before}
        _, finished = self.sched.update(out, sampled)
        if self.steps is not None:
            self.steps.record(out.total_num_scheduled_tokens)
        self._running_before = {r.request_id for r in self.sched.running}
        return Record({r.request_id: n for r, n in out.scheduled}, [r.request_id for r in out.preempted], new_hits,
                      [r.request_id for r in finished], out.num_evicted_blocks, list(out.offloaded),
                      (line.num_reclaims - reclaims) if line is not None else 0)


# ---- workloads ----------------------------------------------------------------------------------------------
@dataclass
class Arrival:
    request_id: str
    prompt: list[int]
    max_tokens: int
    step: int | None  # open loop: the step it arrives at; None: after the session's previous turn
    think_steps: int = 0


def key_tokens(scope: str, key: int, n: int) -> list[int]:
    seed = int.from_bytes(hashlib.blake2b(f"{scope}/{key}".encode(), digest_size=8).digest(), "little")
    return [(seed + 0x9E3779B97F4A7C15 * j) % VOCAB for j in range(n)]


def prompt_tokens(scope: str, keys, key_block_size: int, length: int, request_id: str) -> list[int]:
    tokens: list[int] = []
    for key in keys:
        if len(tokens) + key_block_size > length:
            break
        tokens.extend(key_tokens(scope, key, key_block_size))
    tail = key_tokens("tail/" + request_id, 0, length - len(tokens))
    return tokens + tail


def mooncake(traces: Path, limit: int, ms_per_step: float, max_input: int) -> list[list[Arrival]]:
    """Open loop, one-turn sessions: the first ``limit`` requests of Mooncake's conversation trace."""
    path = traces / "mooncake" / "conversation_trace.jsonl.gz"
    out = []
    with gzip.open(path, "rt") as f:
        for i, line in zip(range(limit), f):
            obj = json.loads(line)
            rid = f"m{i}"
            length = min(obj["input_length"], max_input)
            prompt = prompt_tokens("", obj["hash_ids"][: obj["input_length"] // 512], 512, length, rid)
            out.append([Arrival(rid, prompt, max(1, min(obj["output_length"], 512)),
                                int(obj["timestamp"] / ms_per_step))])
    return out


def weka(traces: Path, num_sessions: int, turns: int, ms_per_step: float, max_input: int,
         gap_steps: int) -> list[list[Arrival]]:
    """Closed loop: the first turns of the first WEKA Claude Code sessions (contexts capped at ``max_input``)."""
    from moetide.workloads import load_workload

    workload = load_workload(traces / "weka_claude_code" / "weka_cc_traces_compact.jsonl.gz", seed=0)
    sessions = []
    for s_index, session in enumerate(workload.sessions[:num_sessions]):
        arrivals = []
        for t_index, turn in enumerate(session.turns[:turns]):
            rid = f"w{s_index}.{t_index}"
            length = min(turn.prompt_tokens, max_input)
            prompt = prompt_tokens(session.key_scope, turn.block_keys, workload.key_block_size, length, rid)
            arrivals.append(Arrival(rid, prompt, max(1, min(turn.output_tokens, 256)),
                                    s_index * gap_steps if t_index == 0 else None,
                                    int(turn.think_time_s * 1000 / ms_per_step)))
        sessions.append(arrivals)
    return sessions


# ---- the comparison -----------------------------------------------------------------------------------------
class Feeder:
    """Hands each side the requests due at a step: open-loop ones by step, a session's next turn once its
    previous one finished plus think time."""

    def __init__(self, sessions: list[list[Arrival]]) -> None:
        self.sessions = [deque(s) for s in sessions]
        self.session_of = {a.request_id: i for i, s in enumerate(sessions) for a in s}
        self.due: dict[int, list[Arrival]] = {}
        for s in self.sessions:
            if s and s[0].step is not None:
                self.due.setdefault(s[0].step, []).append(s.popleft())
        self.left = sum(len(s) for s in sessions)

    def arrivals(self, step: int) -> list[Arrival]:
        return self.due.pop(step, [])

    def finished(self, request_id: str, step: int) -> None:
        queue = self.sessions[self.session_of[request_id]]
        if queue and queue[0].step is None:
            nxt = queue.popleft()
            self.due.setdefault(step + 1 + nxt.think_steps, []).append(nxt)
        elif queue:  # open-loop turns of a session arrive by their own step
            nxt = queue.popleft()
            self.due.setdefault(max(nxt.step, step + 1), []).append(nxt)

    @property
    def pending(self) -> bool:
        return bool(self.due)


@dataclass
class Stats:
    steps: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0
    prefix_hit_tokens: int = 0
    evicted_blocks: int = 0
    offloaded_experts: int = 0
    reclaimed_regions: int = 0
    trace: list = field(default_factory=list)


def run_side(side, sessions, step_of, record_of, max_steps: int) -> Stats:
    feeder, stats = Feeder(sessions), Stats()
    prompt_len: dict[str, int] = {}
    preempted_once: set[str] = set()
    step = 0
    while (side.has_work or feeder.pending) and step < max_steps:
        for a in feeder.arrivals(step):
            side.add_request(a.request_id, a.prompt, a.max_tokens)
            prompt_len[a.request_id] = len(a.prompt)
        if not side.has_work:
            step += 1
            stats.trace.append(None)
            continue
        rec = record_of(step_of(side))
        stats.trace.append((rec.scheduled, rec.preempted, rec.num_evicted, rec.offloaded, rec.reclaimed))
        stats.evicted_blocks += rec.num_evicted
        stats.offloaded_experts += len(rec.offloaded)
        stats.reclaimed_regions += rec.reclaimed
        stats.preemptions += len(rec.preempted)
        preempted_once.update(rec.preempted)
        for rid, hit in rec.new_hits.items():
            if rid in preempted_once:
                stats.recomputed_tokens += max(prompt_len[rid] - hit, 0)
            else:
                stats.prefix_hit_tokens += hit
        for rid in rec.finished:
            feeder.finished(rid, step)
        step += 1
    stats.steps = step
    return stats


def vllm_record(rec) -> Record:
    """The harness's step record in this module's terms (the plugin's line step where there is one)."""
    line = rec.line
    if line is None:
        return Record(rec.scheduled, rec.preempted, rec.new_hits, rec.finished, rec.num_evicted)
    return Record(rec.scheduled, rec.preempted, rec.new_hits, rec.finished, rec.num_evicted, list(line.offloaded),
                  line.reclaimed)


def first_divergence(vllm_trace: list, core_trace: list) -> dict | None:
    """The first step the two sides' records differ at (a side that ran fewer steps differs where it stopped)."""
    first = next((i for i, (a, b) in enumerate(zip(vllm_trace, core_trace)) if a != b), None)
    if first is None and len(vllm_trace) != len(core_trace):
        first = min(len(vllm_trace), len(core_trace))
    if first is None:
        return None

    def show(trace):
        if first >= len(trace) or trace[first] is None:
            return None
        sched, pre, evicted, offloaded, reclaimed = trace[first]
        return {"scheduled": sched, "preempted": pre, "evicted": evicted, "offloaded": offloaded,
                "reclaimed": reclaimed}
    return {"step": first, "vllm": show(vllm_trace), "core": show(core_trace)}


def compare(name: str, sessions, num_blocks: int, block_size: int = 16, max_num_seqs: int = 1024,
            max_num_batched_tokens: int = 8192, threshold: int = 0, reserve_full_isl: bool = True,
            max_steps: int = 200_000, hybrid: bool = False, retention_interval: int | None = 0,
            plugin: PluginSettings | None = None) -> dict:
    """``hybrid``: a Qwen3-Next-80B-shaped KV cache (12 full-attention layers, 36 Gated DeltaNet layers in 3
    groups; vLLM's 544-token page-aligned block, its default ``mamba_cache_mode`` 'align' with prefix caching)
    against the core's model of it (``core.mamba_states``); ``retention_interval`` as vLLM's
    ``prefix_cache_retention_interval`` (0, its default: states kept at replay boundaries and junctions only;
    None: every state). ``plugin``: vLLM runs moetide's scheduler with these settings (experts and costs given)
    and the core the same policy and line."""
    from moetide_testing.vllm_harness import HybridSpec, VllmSide, VllmSideConfig

    longest = max(len(a.prompt) + a.max_tokens for s in sessions for a in s)
    t0 = time.perf_counter()
    vside = VllmSide(VllmSideConfig(num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                                    max_num_batched_tokens=max_num_batched_tokens, max_model_len=longest + 16,
                                    long_prefill_token_threshold=threshold,
                                    scheduler_reserve_full_isl=reserve_full_isl,
                                    hybrid=HybridSpec() if hybrid else None,
                                    retention_interval=retention_interval if hybrid else "default",
                                    plugin=plugin))
    v = run_side(vside, sessions, lambda s: s.step(sampled_token), vllm_record, max_steps)
    line = None if plugin is None else LineSetup(plugin, vside.block_bytes)
    t1 = time.perf_counter()
    cside = CoreSide(num_blocks, block_size, max_num_seqs, max_num_batched_tokens, threshold, reserve_full_isl,
                     mamba_groups=3 if hybrid else 0, retention_interval=retention_interval, line=line)
    c = run_side(cside, sessions, lambda s: s.step(), lambda r: r, max_steps)
    t2 = time.perf_counter()
    identical = sum(1 for a, b in zip(v.trace, c.trace) if a == b)
    steps = max(len(v.trace), len(c.trace))
    return {
        "config": name, "requests": sum(len(s) for s in sessions), "num_blocks": num_blocks,
        "block_size": block_size, "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
        "long_prefill_token_threshold": threshold, "scheduler_reserve_full_isl": reserve_full_isl, "hybrid": hybrid,
        "retention_interval": retention_interval if hybrid else None,
        "policy": plugin.policy if plugin is not None else "vllm (stock vLLM)",
        "steps": steps, "identical_steps": identical, "identical_share": round(identical / max(steps, 1), 5),
        "first_divergence": first_divergence(v.trace, c.trace),
        "vllm": side_summary(v, t1 - t0), "core": side_summary(c, t2 - t1),
    }


def side_summary(stats: Stats, wall_s: float) -> dict:
    return {"steps": stats.steps, "preemptions": stats.preemptions, "recomputed_tokens": stats.recomputed_tokens,
            "prefix_hit_tokens": stats.prefix_hit_tokens, "evicted_blocks": stats.evicted_blocks,
            "offloaded_experts": stats.offloaded_experts, "reclaimed_regions": stats.reclaimed_regions,
            "wall_s": round(wall_s, 1)}

