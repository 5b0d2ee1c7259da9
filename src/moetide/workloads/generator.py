"""Built-in generator of multi-turn agent sessions (closed loop), shaped like WEKA's Claude Code traces.

Each session is one agent run: its first prompt is a system prompt shared by every session (same block keys
across sessions, as a deployment's system prompt and tool definitions are) followed by a per-session task
prefix; every later prompt is the previous prompt + the previous output + new tool/user tokens, so a turn's
block keys extend the previous turn's (prefix reuse like a real agent). Output lengths, new tokens and think
times are drawn per turn; sessions start as a Poisson process. A session ends after its drawn number of turns,
or before a prompt would exceed ``max_prompt_tokens`` (real agents compact their context there).

Distribution shapes (median and log-normal sigma) are measured on the WEKA trace (docs/workloads.md has the
numbers and the command); turns per session and the task prefix are scaled down so the default replay is a
modest job (64 sessions, ~1,400 requests: 1,304-1,502 over seeds 0-4). Everything is drawn from one
``random.Random(seed)`` in a fixed order, so the same seed and config give the same ``Workload``.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass

from moetide.workloads.base import BlockKeys, Session, Turn, Workload

SOURCE = "builtin:generator"


@dataclass(frozen=True)
class LogNormal:
    """``median · exp(sigma · N(0, 1))`` clipped to ``[low, high]`` (a heavy right tail, as the trace has)."""

    median: float
    sigma: float
    low: float
    high: float

    def __post_init__(self) -> None:
        values = (self.median, self.sigma, self.low, self.high)
        if not all(math.isfinite(value) for value in values):
            raise ValueError(f"LogNormal fields must be finite, got {self}")
        if not 0 <= self.low <= self.median <= self.high or self.median <= 0:
            raise ValueError(f"LogNormal needs 0 <= low <= median <= high and median > 0, got {self}")
        if self.sigma < 0:
            raise ValueError(f"LogNormal sigma must be >= 0, got {self.sigma}")

    def sample(self, rng: random.Random) -> float:
        return min(self.high, max(self.low, rng.lognormvariate(math.log(self.median), self.sigma)))

    def sample_int(self, rng: random.Random) -> int:
        return int(round(self.sample(rng)))


@dataclass(frozen=True)
class GeneratorConfig:
    """Every knob of the generator; defaults and their sources are in docs/workloads.md."""

    num_sessions: int = 64
    session_rate_per_s: float = 0.2  # all 64 sessions open within ~5 min, then overlap for tens of minutes
    key_block_size: int = 64  # WEKA's block size
    system_prompt_tokens: int = 14_949  # WEKA median system_tokens + tool_tokens, shared by all sessions
    # first prompt minus system and tools: WEKA median 7,271; sigma from p10/p50 (the upper tail is resumed
    # sessions carrying old history); clipped at 32K to keep the job modest
    task_prompt_tokens: LogNormal = LogNormal(7_271, 1.25, 64, 32_768)
    # WEKA: median 45, sigma 0.97, p99 330; the median is scaled to 16 and the tail cut at 64
    turns_per_session: LogNormal = LogNormal(16, 0.97, 2, 64)
    # prompt growth beyond the previous output (tool results, user text): WEKA median 277, sigma 1.82, p99 16,083
    new_tokens_per_turn: LogNormal = LogNormal(277, 1.82, 0, 16_083)
    output_tokens: LogNormal = LogNormal(216, 1.11, 1, 3_663)  # WEKA, p99 cut
    think_time_s: LogNormal = LogNormal(10.0, 2.22, 0.0, 3_041.0)  # WEKA, p99 cut
    max_prompt_tokens: int = 131_072

    def __post_init__(self) -> None:
        for name in ("num_sessions", "key_block_size", "system_prompt_tokens", "max_prompt_tokens"):
            value, minimum = getattr(self, name), 0 if name == "system_prompt_tokens" else 1
            if type(value) is not int or value < minimum:
                raise ValueError(f"GeneratorConfig.{name} must be an integer >= {minimum}, got {value!r}")
        if not (math.isfinite(self.session_rate_per_s) and self.session_rate_per_s > 0):
            raise ValueError(f"GeneratorConfig.session_rate_per_s must be > 0, got {self.session_rate_per_s}")
        if self.turns_per_session.low < 1:
            raise ValueError("GeneratorConfig.turns_per_session.low must be >= 1")
        if self.output_tokens.low < 1:
            raise ValueError("GeneratorConfig.output_tokens.low must be >= 1")
        if self.system_prompt_tokens + self.task_prompt_tokens.high > self.max_prompt_tokens:
            raise ValueError(
                "GeneratorConfig: system_prompt_tokens + task_prompt_tokens.high "
                f"({self.system_prompt_tokens + self.task_prompt_tokens.high:g}) exceeds max_prompt_tokens "
                f"({self.max_prompt_tokens}): a first prompt would not fit"
            )


def generate_agent_sessions(
    seed: int, num_sessions: int | None = None, *, config: GeneratorConfig | None = None
) -> Workload:
    """A closed-loop ``Workload`` of agent sessions; ``num_sessions`` overrides ``config.num_sessions``."""
    config = config or GeneratorConfig()
    if num_sessions is not None:
        config = dataclasses.replace(config, num_sessions=num_sessions)
    return _Generator(config, random.Random(seed)).workload()


class _Generator:
    """Owns the RNG and the next free block key; keys [0, shared) are the shared system prompt's blocks."""

    def __init__(self, config: GeneratorConfig, rng: random.Random) -> None:
        self.config = config
        self.rng = rng
        self.num_shared_keys = config.system_prompt_tokens // config.key_block_size
        self.next_key = self.num_shared_keys

    def workload(self) -> Workload:
        sessions, start_s = [], 0.0
        for index in range(self.config.num_sessions):
            start_s += self.rng.expovariate(self.config.session_rate_per_s) if index else 0.0
            sessions.append(self._session(f"agent{index:04d}", start_s))
        return Workload(
            name="agent_sessions",
            source=SOURCE,
            mode="closed",
            key_block_size=self.config.key_block_size,
            sessions=tuple(sessions),
        )

    def _session(self, session_id: str, start_s: float) -> Session:
        config, rng = self.config, self.rng
        num_turns = config.turns_per_session.sample_int(rng)
        prompt_tokens = config.system_prompt_tokens + config.task_prompt_tokens.sample_int(rng)
        base_key, turns = self.next_key, []
        for index in range(num_turns):
            output_tokens = config.output_tokens.sample_int(rng)
            think_time_s = config.think_time_s.sample(rng) if index else 0.0
            turns.append(
                Turn(
                    prompt_tokens=prompt_tokens,
                    output_tokens=output_tokens,
                    block_keys=self._keys(prompt_tokens, base_key),
                    arrival_s=start_s if index == 0 else None,
                    think_time_s=think_time_s,
                    cached_tokens=None,
                    request_id=f"{session_id}/{index}",
                )
            )
            prompt_tokens += output_tokens + config.new_tokens_per_turn.sample_int(rng)
            if prompt_tokens > config.max_prompt_tokens:
                break
        self.next_key += max(0, len(turns[-1].block_keys) - self.num_shared_keys)
        return Session(session_id=session_id, start_s=start_s, turns=tuple(turns), parent_session_id=None, key_scope="")

    def _keys(self, prompt_tokens: int, base_key: int) -> BlockKeys:
        num_blocks = prompt_tokens // self.config.key_block_size
        shared = min(num_blocks, self.num_shared_keys)
        return BlockKeys(((0, shared), (base_key, num_blocks - shared)))
