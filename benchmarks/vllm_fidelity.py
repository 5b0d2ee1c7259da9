"""Step-exactness of the `vllm` baseline: vLLM 0.32's real v1 scheduler against moetide's core, same requests.

Both schedulers run with no model: each step, every request that reaches the end of its known tokens samples one
token (the same id on both sides), and a request stops after its recorded output length. Arrivals are in steps:
an open-loop trace's timestamps divided by ``--ms-per-step``; a closed-loop session sends its next turn
``think_time / --ms-per-step`` steps after the previous one finished. Each side runs the arrivals its own
finishes produce, so a divergence is followed to its consequences rather than hidden.

Prints one JSON line per configuration: steps, identical steps, the first divergent step with both sides'
decisions, preemptions, recomputed tokens (prompt tokens computed again after a preemption) and prefix-hit
tokens. Run under vLLM's venv (../shared/PEERS.md), from the project root:

    /work/venv-vllm/bin/python benchmarks/vllm_fidelity.py [--configs mooncake-roomy,...]

Token content: a trace's block key k (chained, per key scope) becomes key_block_size token ids derived from
(scope, k), so equal keys give equal token blocks and so equal block hashes on both sides; a prompt's tail
beyond its keyed blocks gets ids unique to the request. The core hashes the same token ids
(``core.hashing.hash_token_blocks``); vLLM hashes them with its own default.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# MOETIDE_SRC: another checkout's src/ (to measure an older core against the same vLLM)
sys.path.insert(0, os.environ.get("MOETIDE_SRC", str(ROOT / "src")))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from moetide.core.blocks import BlockPool  # noqa: E402
from moetide.core.kv_manager import KVCacheManager  # noqa: E402
from moetide.core.mamba_states import MambaStates  # noqa: E402
from moetide.core.pressure import get_policy  # noqa: E402
from moetide.core.request import Request  # noqa: E402
from moetide.core.scheduler import Scheduler, SchedulerConfig  # noqa: E402

TRACES = ROOT.parent / "shared" / "traces"
VOCAB = 1 << 30


def sampled_token(request_id: str, index: int) -> int:
    return 1 + (index * 7919 + len(request_id)) % 50000


@dataclass
class Record:
    scheduled: dict[str, int]
    preempted: list[str]
    new_hits: dict[str, int]
    finished: list[str]


class CoreSide:
    """moetide's core Scheduler + KVCacheManager + BlockPool, block ids 1..num_blocks-1 as vLLM numbers them (its
    block 0 is the null block)."""

    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 long_prefill_token_threshold: int, reserve_full_isl: bool, mamba_groups: int = 0,
                 retention_interval: int | None = 0) -> None:
        self.pool = BlockPool(range(1, num_blocks))
        mamba = MambaStates(self.pool, block_size, mamba_groups, retention_interval=retention_interval) \
            if mamba_groups else None
        self.kv = KVCacheManager(self.pool, block_size, mamba=mamba)
        options = {"scheduler_reserve_full_isl": reserve_full_isl} if hasattr(
            SchedulerConfig, "scheduler_reserve_full_isl") else {}  # (an older core has no such option)
        self.sched = Scheduler(SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                                               max_num_seqs=max_num_seqs,
                                               long_prefill_token_threshold=long_prefill_token_threshold,
                                               **options),
                               self.kv, get_policy("vllm"))
        self.block_size = block_size
        self._running_before: set[str] = set()  # running after the last step: who is newly scheduled now

    def add_request(self, request_id: str, prompt: list[int], max_tokens: int) -> None:
        self.sched.add_request(Request.from_tokens(request_id, prompt, max_tokens, self.block_size))

    @property
    def has_work(self) -> bool:
        return self.sched.has_work

    def step(self) -> Record:
        out = self.sched.schedule()
        sampled = {r.request_id: sampled_token(r.request_id, r.num_output_tokens)
                   for (r, n), start in zip(out.scheduled, out.num_computed_before) if start + n == r.num_tokens}
        new_hits = {r.request_id: start for (r, _), start in zip(out.scheduled, out.num_computed_before)
                    if r.request_id not in self._running_before}
        _, finished = self.sched.update(out, sampled)
        self._running_before = {r.request_id for r in self.sched.running}
        return Record({r.request_id: n for r, n in out.scheduled}, [r.request_id for r in out.preempted], new_hits,
                      [r.request_id for r in finished])


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


def mooncake(limit: int, ms_per_step: float, max_input: int) -> list[list[Arrival]]:
    """Open loop, one-turn sessions: the first ``limit`` requests of Mooncake's conversation trace."""
    path = TRACES / "mooncake" / "conversation_trace.jsonl.gz"
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


def weka(num_sessions: int, turns: int, ms_per_step: float, max_input: int, gap_steps: int) -> list[list[Arrival]]:
    """Closed loop: the first turns of the first WEKA Claude Code sessions (contexts capped at ``max_input``)."""
    from moetide.workloads import load_workload

    workload = load_workload(TRACES / "weka_claude_code" / "weka_cc_traces_compact.jsonl.gz", seed=0)
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
        stats.trace.append((rec.scheduled, rec.preempted))
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


def compare(name: str, sessions, num_blocks: int, block_size: int = 16, max_num_seqs: int = 1024,
            max_num_batched_tokens: int = 8192, threshold: int = 0, reserve_full_isl: bool = True,
            max_steps: int = 200_000, hybrid: bool = False, retention_interval: int | None = 0) -> dict:
    """``hybrid``: a Qwen3-Next-80B-shaped KV cache (12 full-attention layers, 36 Gated DeltaNet layers in 3
    groups; vLLM's 544-token page-aligned block, its default ``mamba_cache_mode`` 'align' with prefix caching)
    against the core's model of it (``core.mamba_states``); ``retention_interval`` as vLLM's
    ``prefix_cache_retention_interval`` (0, its default: states kept at replay boundaries and junctions only;
    None: every state)."""
    from vllm_driver import HybridSpec, VllmSide, VllmSideConfig

    longest = max(len(a.prompt) + a.max_tokens for s in sessions for a in s)
    t0 = time.perf_counter()
    vside = VllmSide(VllmSideConfig(num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                                    max_num_batched_tokens=max_num_batched_tokens, max_model_len=longest + 16,
                                    long_prefill_token_threshold=threshold,
                                    scheduler_reserve_full_isl=reserve_full_isl,
                                    hybrid=HybridSpec() if hybrid else None,
                                    retention_interval=retention_interval if hybrid else "default"))
    v = run_side(vside, sessions, lambda s: s.step(sampled_token), lambda r: r, max_steps)
    t1 = time.perf_counter()
    cside = CoreSide(num_blocks, block_size, max_num_seqs, max_num_batched_tokens, threshold, reserve_full_isl,
                     mamba_groups=3 if hybrid else 0, retention_interval=retention_interval)
    c = run_side(cside, sessions, lambda s: s.step(), lambda r: r, max_steps)
    t2 = time.perf_counter()
    identical = sum(1 for a, b in zip(v.trace, c.trace) if a == b)
    first = next((i for i, (a, b) in enumerate(zip(v.trace, c.trace)) if a != b), None)
    if first is None and len(v.trace) != len(c.trace):
        first = min(len(v.trace), len(c.trace))
    steps = max(len(v.trace), len(c.trace))
    divergence = None
    if first is not None:
        def show(trace):
            if first >= len(trace) or trace[first] is None:
                return None
            sched, pre = trace[first]
            return {"scheduled": sched, "preempted": pre}
        divergence = {"step": first, "vllm": show(v.trace), "core": show(c.trace)}
    return {
        "config": name, "requests": sum(len(s) for s in sessions), "num_blocks": num_blocks,
        "block_size": block_size, "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
        "long_prefill_token_threshold": threshold, "scheduler_reserve_full_isl": reserve_full_isl, "hybrid": hybrid,
        "retention_interval": retention_interval if hybrid else None,
        "steps": steps, "identical_steps": identical, "identical_share": round(identical / max(steps, 1), 5),
        "first_divergence": divergence,
        "vllm": {"steps": v.steps, "preemptions": v.preemptions, "recomputed_tokens": v.recomputed_tokens,
                 "prefix_hit_tokens": v.prefix_hit_tokens, "wall_s": round(t1 - t0, 1)},
        "core": {"steps": c.steps, "preemptions": c.preemptions, "recomputed_tokens": c.recomputed_tokens,
                 "prefix_hit_tokens": c.prefix_hit_tokens, "wall_s": round(t2 - t1, 1)},
    }


CONFIGS = {
    # Mooncake conversation: 300 requests, inputs capped at 8K tokens, 50 ms a step
    "mooncake-roomy": lambda: compare("mooncake-roomy", mooncake(300, 50, 8192), num_blocks=40_000),
    "mooncake-tight": lambda: compare("mooncake-tight", mooncake(300, 50, 8192), num_blocks=2_000),
    "mooncake-tight-threshold": lambda: compare("mooncake-tight-threshold", mooncake(300, 50, 8192),
                                                num_blocks=2_000, threshold=512),
    "mooncake-tight-first-chunk": lambda: compare("mooncake-tight-first-chunk", mooncake(300, 50, 8192),
                                                  num_blocks=2_000, reserve_full_isl=False),
    # WEKA: 30 sessions x 6 turns, closed loop, contexts capped at 16K tokens, 20 ms a step
    "weka-roomy": lambda: compare("weka-roomy", weka(30, 6, 20, 16_384, 10), num_blocks=40_000),
    "weka-tight": lambda: compare("weka-tight", weka(30, 6, 20, 16_384, 10), num_blocks=2_500),
    "weka-tight-threshold": lambda: compare("weka-tight-threshold", weka(30, 6, 20, 16_384, 10), num_blocks=2_500,
                                            threshold=512),
    # hybrid (Qwen3-Next-shaped), WEKA sessions, 544-token blocks
    "hybrid-roomy": lambda: compare("hybrid-roomy", weka(30, 6, 20, 16_384, 10), num_blocks=2_000,
                                    block_size=544, hybrid=True),
    "hybrid-tight": lambda: compare("hybrid-tight", weka(30, 6, 20, 16_384, 10), num_blocks=200,
                                    block_size=544, hybrid=True),
    "hybrid-tight-dense": lambda: compare("hybrid-tight-dense", weka(30, 6, 20, 16_384, 10), num_blocks=200,
                                          block_size=544, hybrid=True, retention_interval=None),
    "hybrid-tight-threshold": lambda: compare("hybrid-tight-threshold", weka(30, 6, 20, 16_384, 10),
                                              num_blocks=200, block_size=544, hybrid=True, threshold=1088),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated: " + ", ".join(CONFIGS))
    args = parser.parse_args()
    for name in args.configs.split(","):
        print(json.dumps(CONFIGS[name]()), flush=True)


if __name__ == "__main__":
    main()
