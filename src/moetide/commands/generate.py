"""``moetide generate``: run prompts through the engine under a KV budget and print (or write) the continuations.

Greedy unless ``--temperature`` is given (then seeded by ``--seed``: same arguments, same text). The tokenizer
comes from the model directory (local files only). ``--json OUT`` writes::

    {"outputs": [{"prompt", "prompt_token_ids", "token_ids", "text", "finish_reason"}, ...],
     "stats": {"prefix_evictions", "preemptions", "experts_offloaded", "expert_reclaims", "prefix_hit_tokens",
               "steps", ...,
               "kv_host_blocks", "split_policy", "split": {"cpu_blocks", "streamed_blocks", "cpu_s", ...}}}

and stdout gets each continuation as text (under a ``--- prompt i: finish reason ---`` line when there are
several), a sentence saying how far the weights/KV line moved when a policy moved it, and a one-line summary of the
counters (a second one for host KV). A request whose prompt and output the KV cache can never hold (with what the
offload cap could add under an offloading policy) fails before any step runs. The exit code is 1 when every
request failed (none fits the KV cache), 0 otherwise. A prompt whose length plus
``--max-tokens`` passes ``--max-model-len`` (default: config.json's ``max_position_embeddings``) is refused before
anything runs, as vLLM refuses it.
torch and transformers are imported only when the verb runs.

``--kv-host-memory X`` (e.g. ``64MiB``) adds that much host memory of KV blocks (pinned on CUDA) beyond the device
budget: KV spills there once the device part is full, and attention splits each step between the device, the CPU
in place and blocks streamed to the device, as ``--split-policy`` chooses (docs/writescope.md, "The engine half").
``--kv-host-active-memory A`` admits a request only while the host KV that running requests attend stays within A
(``core.scheduler``); ``--device-prefixes evict`` evicts cached device prefixes before new KV spills.

``--routing-out FILE`` writes the measured routing (tokens per expert per MoE layer, ``perf.routing_profile``),
which ``moetide replay|compare|sweep --routing-profile FILE`` uses to price expert staging.

``--policy vamp`` (or ``vamp-reclaim``) runs the core's VAMP policy on a cost record the engine measures once at
start (one expert copy, one expert call; ``engine.vamp``) and the touch rates it counts, reviewing the line once
per ``--vamp-horizon-s`` of modeled engine seconds; ``--max-offload-ratio`` caps it. The report's ``vamp_costs``
is that record: ``--vamp-costs REPORT`` reruns with it, making the same decisions.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from moetide.commands.options import (
    add_json_argument,
    add_max_model_len,
    add_serving_arguments,
    bytes_text,
    check_output_path,
    checkpoint_dir,
    flag_message,
    human_output,
    read_costs,
    write_json_output,
)
from moetide.core.splits import DEFAULT_SPLIT_GPU
from moetide.errors import UserError, read_json
from moetide.perf.routing_profile import write_profile


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine's option group, shared by ``generate``, ``bench-engine`` and ``serve``: the serving options
    the replay has too (``commands.options.add_serving_arguments``), then the engine's own."""
    add_serving_arguments(parser, "engine")
    add = parser.add_argument
    add("--static-offload", action="store_true",
        help="offload --max-offload-ratio of the expert bytes at start (coldest first), whatever the policy")
    add("--device", choices=("cpu", "cuda"), default="cpu", help="where the arena lives (default %(default)s)")
    add("--threads", type=int, metavar="N", help="torch CPU threads (default: torch's choice)")
    add("--split-gpu", default=DEFAULT_SPLIT_GPU, metavar="NAME|FILE",
        help="GPU preset or file whose costs the split policy weighs (default %(default)s)")
    add("--cpu", metavar="NAME|FILE",
        help="--kv-host-memory: the host CPU socket whose costs the split policy weighs, a preset or a `moetide "
             "calibrate` file, which adds its fitted factors (default: --split-gpu's host)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    add_max_model_len(parser, "the model's max_position_embeddings")
    add = parser.add_argument
    prompts = parser.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", metavar="TEXT", help="one prompt")
    prompts.add_argument("--prompts-file", metavar="FILE", help="prompts, one a line (blank lines skipped)")
    add("--max-tokens", type=int, required=True, metavar="N", help="tokens to generate per prompt")
    add("--temperature", type=float, metavar="T", help="sample at this temperature (default: greedy)")
    add("--seed", type=int, default=0, help="sampling seed (default %(default)s)")
    add("--ignore-eos", action="store_true", help="generate --max-tokens even past an end-of-sequence token")
    add_json_argument(parser, "outputs and counters")
    add("--routing-out", metavar="FILE",
        help="write the tokens routed to every expert of every MoE layer (a routing profile for replay's "
             "--routing-profile)")


def read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompt is not None:
        if not args.prompt.strip():
            raise UserError("--prompt: the prompt is empty")
        return [args.prompt]
    path = Path(args.prompts_file)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise UserError(f"--prompts-file {path}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise UserError(f"--prompts-file {path}: not UTF-8 text ({exc.reason})") from None
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise UserError(f"--prompts-file {path}: no prompts (every line is blank)")
    return prompts


def read_config(model: str) -> dict:
    """The checkpoint's config.json, read first so that a broken one is blamed on itself, with its line."""
    path = checkpoint_dir(model) / "config.json"
    config = read_json(path, f"--model {path}")
    if not isinstance(config, dict):
        raise UserError(f"--model {path}: expected a JSON object")
    return config


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def load_tokenizer(model: str):
    from transformers import AutoTokenizer

    model_dir = checkpoint_dir(model)
    if not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        raise UserError(f"--model {model_dir}: no tokenizer files (expected one of {', '.join(TOKENIZER_FILES)}; "
                        f"`moetide make-test-model` writes tokenizer.json)")
    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"--model {model_dir}: cannot load a tokenizer from it ({first})") from None


def build_engine(args: argparse.Namespace, **overrides: object):
    """The engine the shared options describe (torch imported here)."""
    import torch

    from moetide.engine.runner import Engine

    if args.threads is not None:
        if args.threads < 1:
            raise UserError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    options = dict(kv_cache_memory=args.kv_cache_memory, block_size=args.block_size, policy=args.policy,
                   max_offload_ratio=args.max_offload_ratio, static_offload=args.static_offload,
                   max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                   device=args.device, kv_host_memory=args.kv_host_memory,
                   kv_host_active_memory=args.kv_host_active_memory, device_prefixes=args.device_prefixes,
                   split_policy=args.split_policy,
                   split_fixed_ratio=args.split_fixed_ratio, split_gpu=args.split_gpu, cpu=args.cpu,
                   vamp_horizon_s=args.vamp_horizon_s, cold_experts=args.cold_experts,
                   costs=read_costs(args.vamp_costs) if args.vamp_costs else None)
    options.update(overrides)
    try:
        return Engine(checkpoint_dir(args.model), **options)
    except UserError as exc:
        raise UserError(flag_message(str(exc))) from None


def max_model_len(args: argparse.Namespace, config: dict) -> int | None:
    """``--max-model-len``, or config.json's ``max_position_embeddings``; past the latter only with a warning."""
    positions = config.get("max_position_embeddings")
    positions = positions if isinstance(positions, int) and positions > 0 else None
    if args.max_model_len is None:
        return positions
    if positions is not None and args.max_model_len > positions:
        print(f"moetide: warning: --max-model-len {args.max_model_len:,} is past the model's "
              f"max_position_embeddings ({positions:,}): positions beyond it were never trained", file=sys.stderr)
    return args.max_model_len


def kv_capacity_tokens(engine, policy: str) -> int:
    """The most tokens one sequence can hold: every KV block of the pool (device and host), with what the offload
    cap could still add when the policy offloads experts, less a request's state blocks."""
    from moetide.core.pressure import policy_entry

    parts, kv = engine.parts, engine.parts.scheduler.kv
    blocks = kv.pool.num_blocks
    if policy_entry(policy).offloads_experts:
        residency = parts.residency
        blocks += parts.expert_line.blocks_gained(residency.max_num_offloaded - residency.num_offloaded)
    return max(blocks - kv.num_state_blocks_per_request, 0) * kv.block_size


def check_lengths(texts: list[str], prompt_ids: list[list[int]], max_tokens: int, limit: int | None) -> None:
    for text, ids in zip(texts, prompt_ids):
        if not ids:
            raise UserError(f"prompt {text!r} encodes to no tokens")
        if limit is not None and len(ids) + max_tokens > limit:
            raise UserError(f"prompt {text[:40]!r}: {len(ids):,} prompt tokens + --max-tokens {max_tokens:,} = "
                            f"{len(ids) + max_tokens:,} is past --max-model-len {limit:,} (the model's length, "
                            f"max_position_embeddings, unless given)")


def run(args: argparse.Namespace) -> int:
    if args.max_tokens < 1:
        raise UserError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    check_output_path("--json", args.json)
    check_output_path("--routing-out", args.routing_out)
    texts = read_prompts(args)
    config = read_config(args.model)
    tokenizer = load_tokenizer(args.model)
    prompt_ids = [tokenizer.encode(text) for text in texts]
    check_lengths(texts, prompt_ids, args.max_tokens, max_model_len(args, config))
    engine = build_engine(args, ignore_eos=args.ignore_eos)
    if args.routing_out:
        engine.parts.experts.record_totals()
    # a request whose prompt and output can never be held fails now, not after the steps it would run first (the
    # last output token is sampled, never written to the KV cache)
    capacity = kv_capacity_tokens(engine, args.policy)
    fits = [len(ids) + args.max_tokens - 1 <= capacity for ids in prompt_ids]
    result = engine.generate([ids for ids, ok in zip(prompt_ids, fits) if ok], args.max_tokens,
                             temperature=args.temperature, seed=args.seed)
    ran = iter(result.outputs)
    outputs = []
    for text, ids, ok in zip(texts, prompt_ids, fits):
        out = next(ran) if ok else None
        token_ids = out.token_ids if out else []
        outputs.append(dict(prompt=text, prompt_token_ids=out.prompt_token_ids if out else ids, token_ids=token_ids,
                            text=tokenizer.decode(token_ids, skip_special_tokens=True),
                            finish_reason=out.finish_reason if out else "failed"))
    report = dict(outputs=outputs, stats=dataclasses.asdict(result.stats))
    if engine.costs is not None:
        report["vamp_costs"] = engine.costs.as_dict()
    _emit(args.json, report)
    if args.routing_out:  # after the outputs: a bad path loses nothing already computed
        write_profile(args.routing_out, engine.parts.experts.totals.tolist(),
                      top_k=engine.parts.model.config.num_experts_per_tok, model=str(args.model))
    failed = sum(out["finish_reason"] == "failed" for out in outputs)
    if failed == len(outputs):
        host = args.kv_host_memory
        budget = bytes_text(engine.config.kv_cache_memory) + (f" and {bytes_text(host)} of host KV" if host else "")
        hint = "raise --kv-cache-memory or --kv-host-memory" if host else ("raise --kv-cache-memory, or give "
                                                                            "--kv-host-memory")
        what = "the request does not fit" if failed == 1 else f"none of the {failed} requests fits"
        print(f"moetide generate: every request failed: {what} the KV cache of {budget} ({hint})",
              file=sys.stderr)
        return 1
    return 0


def _emit(json_path: str | None, report: dict) -> None:
    if json_path == "-":
        write_json_output("-", json.dumps(report))
        return
    with human_output(json_path):
        _print_report(report)
    if json_path is not None:
        write_json_output(json_path, json.dumps(report, indent=1))


def _print_report(report: dict) -> None:
    outputs = report["outputs"]
    for i, out in enumerate(outputs):
        head = f"--- prompt {i}: {out['finish_reason']} ---" if len(outputs) > 1 else None
        if head:
            print(head)
        print(out["text"] if out["finish_reason"] != "failed" else "[failed: it never fits the KV cache]")
    stats = report["stats"]
    if stats["experts_offloaded"] or stats["kv_blocks"] != stats["kv_blocks_at_start"]:
        experts = stats["experts_offloaded"]
        noun = "expert is" if experts == 1 else "experts are"
        print(f"the weights/KV line moved: {experts} {noun} served from host memory "
              f"({stats['offloaded_ratio']:.1%} of routed-expert bytes), and the KV "
              f"cache went from {stats['kv_blocks_at_start']:,} to {stats['kv_blocks']:,} blocks")
    print(f"steps {stats['steps']}, prefix evictions {stats['prefix_evictions']} blocks, preemptions "
          f"{stats['preemptions']}, experts offloaded {stats['experts_offloaded']} (regions reclaimed "
          f"{stats['expert_reclaims']}; staged {stats['experts_staged']}, computed on the host "
          f"{stats['experts_on_host']}), prefix hits "
          f"{stats['prefix_hit_tokens']} tokens, recomputed {stats['recomputed_tokens']} tokens")
    split = stats.get("split")
    if split:
        print(f"host KV ({stats['split_policy']}): {stats['kv_host_blocks']} blocks, {split['host_tokens_written']} "
              f"tokens written there; over {split['steps']} steps: {split['device_blocks']} device, "
              f"{split['cpu_blocks']} CPU in place, {split['streamed_blocks']} streamed block-steps; CPU "
              f"{split['cpu_s'] * 1e3:.1f} ms measured, {split['predicted_cpu_s'] * 1e3:.1f} ms predicted"
              + (f"; correction factor {split['correction_factor']:.2f}, {split['probes']} probes"
                 if stats['split_policy'] == "writescope" else "")
              + (f"; admission held {stats['host_bound_waits']} times by the host KV bound, host hits copied to the "
                 f"device {stats['host_blocks_promoted']} blocks, recomputed {stats['host_hits_recomputed']}"
                 if stats['host_bound_waits'] or stats['host_blocks_promoted'] or stats['host_hits_recomputed']
                 else ""))
