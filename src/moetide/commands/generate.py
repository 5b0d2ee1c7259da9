"""``moetide generate``: run prompts through the engine under a KV budget and print (or write) the continuations.

Greedy unless ``--temperature`` is given (then seeded by ``--seed``: same arguments, same text). The tokenizer
comes from the model directory (local files only). ``--json OUT`` writes::

    {"outputs": [{"prompt", "prompt_token_ids", "token_ids", "text", "finish_reason"}, ...],
     "stats": {"prefix_evictions", "preemptions", "experts_offloaded", "expert_reclaims", "prefix_hit_tokens",
               "steps", ...,
               "kv_host_blocks", "split_policy", "split": {"cpu_blocks", "streamed_blocks", "cpu_s", ...}}}

and stdout gets one line per prompt plus a one-line summary of the counters (a second one for host KV).
torch and transformers are imported only when the verb runs.

``--kv-host-mib X`` adds X MiB of host KV blocks (pinned on CUDA) beyond the device budget: KV spills there once
the device part is full, and attention splits each step between the device, the CPU in place and blocks streamed
to the device, as ``--split-policy`` chooses (docs/writescope.md, "The engine half"). ``--kv-host-active-mib A``
admits a request only while the host KV that running requests attend stays within A MiB (``core.scheduler``);
``--device-prefixes evict`` evicts cached device prefixes before new KV spills.

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
from pathlib import Path

from moetide.core.experts import DEFAULT_MAX_OFFLOAD_RATIO
from moetide.core.kv_manager import DEVICE_PREFIXES
from moetide.core.pressure import POLICIES
from moetide.core.splits import SPLIT_POLICIES
from moetide.engine.split_plan import DEFAULT_SPLIT_GPU, DEFAULT_SPLIT_HOST
from moetide.errors import UserError, read_json
from moetide.perf.staging import COLD_EXPERT_MODES
from moetide.perf.routing_profile import write_profile

DEFAULT_KV_BUDGET_MIB = 256.0


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared with ``bench-engine``."""
    add = parser.add_argument
    add("--model", required=True, metavar="DIR", help="HF checkpoint directory (config.json + safetensors)")
    add("--kv-budget-mib", type=float, default=DEFAULT_KV_BUDGET_MIB, metavar="X",
        help="device memory for the KV cache beyond the routed experts, MiB (default %(default)s)")
    add("--block-size", type=int, default=16, metavar="B", help="tokens per KV block (default %(default)s)")
    add("--policy", default="vllm", metavar="|".join(sorted(POLICIES)),
        help="memory-pressure policy: vllm (evict, then preempt), vamp / vamp-reclaim (also move the expert/KV "
             "line, priced with the engine's measured step, prefill and copy times), static-offload "
             "(default %(default)s)")
    add("--max-offload-ratio", type=float, default=DEFAULT_MAX_OFFLOAD_RATIO, metavar="R",
        help="cap on offloaded / all routed-expert bytes under vamp, vamp-reclaim, static-offload and "
             "--static-offload (default %(default)s)")
    add("--vamp-horizon-s", type=float, default=60.0, metavar="S",
        help="vamp: how often (engine seconds) it reviews the line, and the time constant of its rates "
             "(default %(default)s)")
    add("--vamp-costs", metavar="FILE",
        help="vamp: price with this cost record (an earlier --json report's \"vamp_costs\") instead of "
             "measuring one at start; the same input then makes the same decisions")
    add("--static-offload", action="store_true",
        help="offload --max-offload-ratio of the expert bytes at start (coldest first), whatever the policy")
    add("--cold-experts", choices=COLD_EXPERT_MODES, default="fetch",
        help="offloaded experts a step routes few rows to: staged into the device (fetch), or computed from their "
             "host copies, the rows sent there and back (cpu; up to 32 rows, more are staged) (default %(default)s)")
    add("--max-num-seqs", type=int, default=256, help="sequences per step (default %(default)s)")
    add("--max-num-batched-tokens", type=int, default=2048, help="tokens per step (default %(default)s)")
    add("--device", choices=("cpu", "cuda"), default="cpu", help="where the arena lives (default %(default)s)")
    add("--threads", type=int, metavar="N", help="torch CPU threads (default: torch's choice)")
    add("--kv-host-mib", type=float, default=0.0, metavar="X",
        help="host memory for KV blocks that spill past the device budget, MiB (default %(default)s: none)")
    add("--kv-host-active-mib", type=float, metavar="A",
        help="with host KV: admit a request only while the host KV that running requests attend each step stays "
             "within A MiB (the rest holds cached prefixes) (default: no bound)")
    add("--device-prefixes", choices=DEVICE_PREFIXES, default="keep",
        help="with host KV, when no uncached device block is free: keep cached device prefixes and spill new KV, "
             "or evict the least recently used of them first (default %(default)s)")
    add("--split-policy", choices=tuple(SPLIT_POLICIES), default="writescope",
        help="with host KV: who attends the host blocks each step (default %(default)s)")
    add("--split-fixed-ratio", type=float, default=0.5, metavar="R",
        help="CPU share of the host blocks under --split-policy fixed-ratio (default %(default)s)")
    add("--split-gpu", default=DEFAULT_SPLIT_GPU, metavar="NAME|FILE",
        help="GPU preset or file whose costs the split policy weighs (default %(default)s)")
    add("--split-host", default=DEFAULT_SPLIT_HOST, metavar="NAME|FILE",
        help="host preset or file (a `moetide calibrate` file adds its fitted factors) (default %(default)s)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    add = parser.add_argument
    prompts = parser.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", metavar="TEXT", help="one prompt")
    prompts.add_argument("--prompts-file", metavar="FILE", help="prompts, one a line (blank lines skipped)")
    add("--max-tokens", type=int, required=True, metavar="N", help="tokens to generate per prompt")
    add("--temperature", type=float, metavar="T", help="sample at this temperature (default: greedy)")
    add("--seed", type=int, default=0, help="sampling seed (default %(default)s)")
    add("--ignore-eos", action="store_true", help="generate --max-tokens even past an end-of-sequence token")
    add("--json", metavar="OUT", help="write outputs and counters as JSON to OUT ('-' for stdout)")
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


def load_tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    if not Path(model_dir).is_dir():
        raise UserError(f"--model {model_dir}: not a checkpoint directory")
    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"--model {model_dir}: cannot load a tokenizer from it ({first})") from None


def read_costs(path: str) -> dict:
    """A cost record: a --json report (its ``vamp_costs``) or the bare record."""
    doc = read_json(path, f"--vamp-costs {path}")
    record = doc.get("vamp_costs", doc) if isinstance(doc, dict) else None
    if not isinstance(record, dict):
        raise UserError(f"--vamp-costs {path}: expected an object with the cost fields or a \"vamp_costs\" one")
    return record


def build_engine(args: argparse.Namespace, **overrides: object):
    """The engine the shared options describe (torch imported here)."""
    import torch

    from moetide.engine.runner import Engine

    if args.threads is not None:
        if args.threads < 1:
            raise UserError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    if not args.kv_budget_mib >= 0:
        raise UserError(f"--kv-budget-mib must be >= 0, got {args.kv_budget_mib}")
    if not args.kv_host_mib >= 0:
        raise UserError(f"--kv-host-mib must be >= 0, got {args.kv_host_mib}")
    options = dict(kv_budget_mib=args.kv_budget_mib, block_size=args.block_size, policy=args.policy,
                   max_offload_ratio=args.max_offload_ratio, static_offload=args.static_offload,
                   max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                   device=args.device, kv_host_mib=args.kv_host_mib, kv_host_active_mib=args.kv_host_active_mib,
                   evict_device_prefixes=args.device_prefixes == "evict", split_policy=args.split_policy,
                   split_fixed_ratio=args.split_fixed_ratio, split_gpu=args.split_gpu, split_host=args.split_host,
                   vamp_horizon_s=args.vamp_horizon_s, cold_experts=args.cold_experts,
                   costs=read_costs(args.vamp_costs) if args.vamp_costs else None)
    options.update(overrides)
    return Engine(args.model, **options)


def run(args: argparse.Namespace) -> int:
    if args.max_tokens < 1:
        raise UserError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    texts = read_prompts(args)
    tokenizer = load_tokenizer(args.model)
    prompt_ids = [tokenizer.encode(text) for text in texts]
    for text, ids in zip(texts, prompt_ids):
        if not ids:
            raise UserError(f"prompt {text!r} encodes to no tokens")
    engine = build_engine(args, ignore_eos=args.ignore_eos)
    if args.routing_out:
        engine.parts.experts.record_totals()
    result = engine.generate(prompt_ids, args.max_tokens, temperature=args.temperature, seed=args.seed)
    outputs = [dict(prompt=text, prompt_token_ids=out.prompt_token_ids, token_ids=out.token_ids,
                    text=tokenizer.decode(out.token_ids, skip_special_tokens=True), finish_reason=out.finish_reason)
               for text, out in zip(texts, result.outputs)]
    report = dict(outputs=outputs, stats=dataclasses.asdict(result.stats))
    if engine.costs is not None:
        report["vamp_costs"] = engine.costs.as_dict()
    _emit(args.json, report)
    if args.routing_out:  # after the outputs: a bad path loses nothing already computed
        write_profile(args.routing_out, engine.parts.experts.totals.tolist(),
                      top_k=engine.parts.model.config.num_experts_per_tok, model=str(args.model))
    return 0


def _emit(json_path: str | None, report: dict) -> None:
    if json_path == "-":
        print(json.dumps(report))
        return
    for out in report["outputs"]:
        print(json.dumps(out["text"]) + ("" if out["finish_reason"] != "failed" else "  [failed: never fits]"))
    stats = report["stats"]
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
    if json_path is not None:
        try:
            Path(json_path).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
        except OSError as exc:
            raise UserError(f"--json {json_path}: cannot write: {exc.strerror or exc}") from None
