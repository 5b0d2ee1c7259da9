"""Run vLLM once on a checkpoint and print what the plugin's engine tests compare.

A subprocess of ``tests/test_vllm_plugin_engine.py``: each run gets the environment its test picks
(``VLLM_ENABLE_V1_MULTIPROCESSING``, ``MOETIDE_VLLM_DISABLE`` for stock vLLM) and a fresh process, so vLLM's
process-wide state never carries from one engine to the next. Prints one line ``RESULT {json}``: greedy token ids
per prompt per batch and, with the plugin, every worker's KV backing stats (``vllm.backing.CpuBacking.stats``) and
host tier stats (``vllm.host_tier.HostTier.stats``). Prompts are text (``batches``) or token ids
(``token_batches``).

With ``score`` in the spec it scores instead (``tests/greedy.py``): stock vLLM, teacher-forced along each (prompt
token ids, continuation token ids), gives for every continuation token its log-probability, the best one's and the
best token.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    spec = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from moetide.vllm.settings import SCHEDULER_CLS, PluginSettings

    if "score" in spec:
        print("RESULT " + json.dumps({"scores": score(spec)}), flush=True)
        return
    kwargs = dict(model=spec["model"], dtype="bfloat16", max_model_len=spec["max_model_len"],
                  kv_cache_memory_bytes=spec["kv_cache_memory"], max_num_seqs=spec.get("max_num_seqs", 8),
                  enforce_eager=spec.get("enforce_eager", False), seed=0)
    if spec.get("tensor_parallel_size", 1) > 1:  # one worker process per rank
        kwargs.update(tensor_parallel_size=spec["tensor_parallel_size"], distributed_executor_backend="mp")
    plugin = spec.get("plugin")
    if plugin is not None:
        kwargs.update(scheduler_cls=spec.get("scheduler_cls", SCHEDULER_CLS),
                      kv_transfer_config=PluginSettings.from_extra_config(plugin).kv_transfer_config(),
                      worker_extension_cls="moetide.vllm.worker.MoetideWorkerExtension")
    llm = LLM(**kwargs)
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0)
    batches = spec.get("batches") or [[TokensPrompt(prompt_token_ids=ids) for ids in batch]
                                      for batch in spec["token_batches"]]
    began = time.perf_counter()
    done = [llm.generate(batch, params, use_tqdm=False) for batch in batches]
    seconds = time.perf_counter() - began
    outputs = [[list(o.outputs[0].token_ids) for o in batch] for batch in done]
    prompts = [[list(o.prompt_token_ids) for o in batch] for batch in done]
    stats = llm.collective_rpc("moetide_backing_stats") if plugin is not None else None
    host_tier = llm.collective_rpc("moetide_host_tier_stats") if plugin is not None else None
    print("RESULT " + json.dumps({"outputs": outputs, "prompts": prompts, "stats": stats, "line": line_books(llm),
                                  "host_tier": host_tier, "seconds": seconds}), flush=True)


def score(spec: dict) -> list[list[tuple[float, float, int]]]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=spec["model"], dtype="bfloat16", max_model_len=spec["max_model_len"],
              kv_cache_memory_bytes=spec["kv_cache_memory"], max_num_seqs=8,
              enforce_eager=spec.get("enforce_eager", False), seed=0)
    pairs = spec["score"]
    done = llm.generate([TokensPrompt(prompt_token_ids=prompt + continuation) for prompt, continuation in pairs],
                        SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1), use_tqdm=False)
    scores = []
    for (prompt, continuation), out in zip(pairs, done):
        rows = []
        for position, token in enumerate(continuation, start=len(prompt)):
            ranked = out.prompt_logprobs[position]
            best_id, best = min(ranked.items(), key=lambda item: item[1].rank)
            rows.append((ranked[token].logprob, best.logprob, best_id))
        scores.append(rows)
    return scores


def line_books(llm) -> dict | None:
    """In-process only (the scheduler lives here): what the line's books learnt of the workers' routing."""
    from vllm.v1.engine.core_client import InprocClient

    from moetide.vllm.scheduler import MoetideScheduler

    client = llm.llm_engine.engine_core
    if not isinstance(client, InprocClient) or not isinstance(client.engine_core.scheduler, MoetideScheduler):
        return None
    books = client.engine_core.scheduler.moetide
    if books.residency is None:  # a policy that never offloads keeps no expert books
        return {"routed_steps": books.num_routed_steps, "hotness": None}
    config = books.residency.config
    return {"routed_steps": books.num_routed_steps,
            "hotness": [[books.residency.hotness(m, e) for e in range(config.num_experts)]
                        for m in range(config.num_layers)]}


if __name__ == "__main__":
    main()
