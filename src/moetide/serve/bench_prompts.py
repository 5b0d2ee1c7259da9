"""Token prompts for a recorded trace, built so that the trace's prefix structure is real at the server.

A trace names each prompt's leading blocks by key (``Turn.block_keys``, ``Workload.key_block_size`` tokens each;
equal keys in one ``key_scope`` are the same content). Each key becomes one fixed block of pseudo-random token ids,
drawn from a generator seeded by (seed, scope, key) — so equal keys give equal token blocks, in any request and any
run with the same seed, and a server's prefix cache finds exactly the reuse the trace recorded. What the keys do
not cover (the tail of a prompt; all of a keyless Azure prompt) is drawn from the request's own generator, so it is
never shared. Prompts are sent as token ids, not text: no tokenizer round trip can merge or split a block.

Lengths and times come scaled already (``workloads.scale``, the rule every verb shares). Token ids are drawn from
[``FIRST_TOKEN_ID``, ``vocab_size``): ids 0-2 are special in most vocabularies, and every byte-level or
byte-fallback vocabulary has its first 259 ids as ordinary tokens, hence the default vocabulary of 259.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from moetide.workloads.base import Workload

FIRST_TOKEN_ID = 3
DEFAULT_VOCAB_SIZE = 259
# words for a chat prompt's text: one per token id, short lower-case syllables that BPE vocabularies keep whole
_WORDS = [c + v for c in "bdfghklmnprstvz" for v in "aeiou"] + [c + v + "n" for c in "bdfgklmprst" for v in "aeiou"]


@dataclass(frozen=True)
class BenchTurn:
    request_id: str
    prompt_token_ids: list[int]
    output_tokens: int
    arrival_s: float | None  # open loop, or a closed-loop session's first turn: seconds after the start
    think_time_s: float  # closed loop: previous turn's completion -> this send


@dataclass(frozen=True)
class BenchSession:
    session_id: str
    start_s: float
    turns: tuple[BenchTurn, ...]


class PromptBuilder:
    def __init__(self, key_block_size: int | None, vocab_size: int, seed: int) -> None:
        if vocab_size <= FIRST_TOKEN_ID:
            raise ValueError(f"vocab_size must be > {FIRST_TOKEN_ID}, got {vocab_size}")
        self.block_tokens, self.vocab_size, self.seed = key_block_size, vocab_size, seed
        self._blocks: dict[tuple[str, int], list[int]] = {}

    def _draw(self, rng: random.Random, n: int) -> list[int]:
        return [rng.randrange(FIRST_TOKEN_ID, self.vocab_size) for _ in range(n)]

    def block(self, scope: str, key: int) -> list[int]:
        found = self._blocks.get((scope, key))
        if found is None:
            assert self.block_tokens is not None
            found = self._blocks[scope, key] = self._draw(random.Random(f"{self.seed}/{scope}/{key}"),
                                                          self.block_tokens)
        return found

    def prompt(self, scope: str, keys: Sequence[int], num_tokens: int, request_id: str) -> list[int]:
        tokens: list[int] = []
        if self.block_tokens is not None:
            for key in keys:
                if len(tokens) + self.block_tokens > num_tokens:
                    break
                tokens += self.block(scope, key)
        rest = num_tokens - len(tokens)
        return tokens + self._draw(random.Random(f"{self.seed}/private/{request_id}"), rest) if rest else tokens


def bench_sessions(workload: Workload, seed: int, vocab_size: int = DEFAULT_VOCAB_SIZE) -> list[BenchSession]:
    """The workload's sessions (scaled already: ``workloads.scale``) with token prompts."""
    builder = PromptBuilder(workload.key_block_size, vocab_size, seed)
    sessions = []
    for session in workload.sessions:
        turns = tuple(
            BenchTurn(turn.request_id, builder.prompt(session.key_scope, turn.block_keys, turn.prompt_tokens,
                                                      turn.request_id),
                      turn.output_tokens, turn.arrival_s, turn.think_time_s)
            for turn in session.turns)
        sessions.append(BenchSession(session.session_id, session.start_s, turns))
    return sessions


def prompt_text(token_ids: Sequence[int]) -> str:
    """A chat prompt's text for token ids: one word per id, so equal token blocks are equal text and a server's
    prefix cache still finds the trace's reuse. Its length in the server's tokens is the tokenizer's, near one per
    word; the server's ``usage.prompt_tokens`` is what the metrics count."""
    return " ".join(_WORDS[t % len(_WORDS)] for t in token_ids)


def fit_turn(turn: BenchTurn, max_model_len: int) -> BenchTurn | None:
    """The turn cut to fit ``max_model_len`` (prompt + output): the prompt keeps its leading tokens (so its shared
    blocks stay shared), and the output is cut only when it alone does not leave one prompt token; None when the
    turn already fits."""
    if len(turn.prompt_token_ids) + turn.output_tokens <= max_model_len:
        return None
    output = min(turn.output_tokens, max_model_len - 1)
    return BenchTurn(turn.request_id, turn.prompt_token_ids[:max_model_len - output], output, turn.arrival_s,
                     turn.think_time_s)
