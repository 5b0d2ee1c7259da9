"""Greedy tokens against stock vLLM's, where stock vLLM itself does not give one answer.

On this CPU, vLLM's greedy tokens depend on how requests were batched: stock vLLM (the plugin disabled, eager) on
the whole-line test's checkpoint gives different tokens for one of 14 prompts at 2 MiB and at 16 MiB of KV cache,
and for another with ``max_num_seqs=1``. The make-test-model checkpoints have random weights and nearly flat
next-token distributions: where those two stock runs part, stock vLLM's log-probabilities of the two tokens are
0.002 nats apart, and a change of batch shifts logits by about that much. The line gives the KV cache more blocks,
so vLLM batches differently, and the same can happen.

So a sequence passes if it equals stock vLLM's; one that differs is scored by stock vLLM, teacher-forced along the
sequence itself (``tests/vllm_generate.py`` with ``score``), and every one of its tokens must be stock vLLM's top
choice given the tokens before it, or within ``TIE_NATS`` of it. A token computed from wrong weights or wrong KV
is not: it lands anywhere in the distribution, and the check covers every token of the sequence.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

TIE_NATS = 0.01  # 5x the gap measured where stock vLLM parts from itself

Score = Callable[[list[tuple[list[int], list[int]]]], list[list[tuple[float, float, int]]]]


def check_greedy(outputs: Sequence[Sequence[int]], reference: Sequence[Sequence[int]],
                 prompts: Sequence[Sequence[int]], score: Score) -> dict:
    """Assert every output equals the reference's or is stock vLLM's near-argmax at every token (module
    docstring); ``prompts`` are the token ids each output continues. Returns counts for the report."""
    assert len(outputs) == len(reference) == len(prompts)
    differing = [i for i, (out, ref) in enumerate(zip(outputs, reference)) if list(out) != list(ref)]
    report = {"sequences": len(outputs), "equal": len(outputs) - len(differing), "near_ties": 0, "max_gap": 0.0}
    if not differing:
        return report
    scores = score([(list(prompts[i]), list(outputs[i])) for i in differing])
    failures = []
    for i, rows in zip(differing, scores):
        for position, ((logprob, best, best_id), token) in enumerate(zip(rows, outputs[i])):
            gap = best - logprob if token != best_id else 0.0
            report["max_gap"] = max(report["max_gap"], gap)
            if gap > TIE_NATS:
                failures.append(f"sequence {i} token {position}: {token} is {gap:.4f} nats below stock vLLM's "
                                f"choice {best_id}")
        report["near_ties"] += 1
    assert not failures, "not stock vLLM's greedy tokens:\n" + "\n".join(failures[:20])
    return report


def run_vllm(spec: dict, *, plugin: bool, multiprocessing: bool = False, env: dict | None = None) -> dict:
    """One vLLM run of ``tests/vllm_generate.py`` in a fresh process: with moetide's plugin or stock; ``env`` adds
    to the environment."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1" if multiprocessing else "0",
               MOETIDE_VLLM_DISABLE="0" if plugin else "1", **(env or {}))
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("vllm_generate.py")), json.dumps(spec)],
                          env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, f"vLLM run failed (rc {done.returncode}):\n{done.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def stock_scorer(model: Path, *, enforce_eager: bool) -> Score:
    """Score with stock vLLM on ``model`` (``tests/vllm_generate.py`` with ``score``), in the mode of the run
    it judges (vLLM's default, compiled, or eager)."""
    def score(pairs: list[tuple[list[int], list[int]]]) -> list[list[tuple[float, float, int]]]:
        spec = {"model": str(model), "max_model_len": 4096, "kv_cache_memory": 64 << 20, "score": pairs,
                "enforce_eager": enforce_eager}
        return run_vllm(spec, plugin=False)["scores"]

    return score
