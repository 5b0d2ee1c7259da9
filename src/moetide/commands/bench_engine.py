"""``moetide bench-engine``: measured prefill and decode throughput of the engine on a checkpoint.

Nothing is modeled: for each batch size, ``--warmup`` untimed runs, then ``--repeats`` timed runs of ``batch``
random prompts of ``--prompt-tokens`` tokens generating ``--decode-tokens`` each (greedy, eos ignored). The
engine times its own steps (``EngineStats``): steps that carry any prompt token are prefill, steps of one output
token per sequence are decode, so prefill tokens/s = prompt tokens / prefill seconds and decode tokens/s =
decode tokens / decode seconds. Each run draws fresh prompts (seeded), so no run hits the previous one's prefix
cache. One JSON line per batch size with the median and the spread, and ``native_kernels``: true if the engine's
native CPU kernels were available, else why not (``MOETIDE_NATIVE=0`` measures the torch paths); nothing asserts a
speed.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics

from moetide.commands.generate import add_engine_arguments, build_engine, max_model_len, read_config
from moetide.commands.options import add_max_model_len, int_list
from moetide.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    add_max_model_len(parser, "the model's max_position_embeddings")
    add = parser.add_argument
    add("--batch-sizes", type=int_list, default=[1, 8, 32], metavar="LIST",
        help="comma-separated batch sizes (default 1,8,32)")
    add("--prompt-tokens", type=int, default=128, metavar="N", help="tokens per prompt (default %(default)s)")
    add("--decode-tokens", type=int, default=32, metavar="N", help="tokens generated per prompt "
                                                                    "(default %(default)s)")
    add("--repeats", type=int, default=3, help="timed runs per batch size; the median is reported "
                                               "(default %(default)s)")
    add("--warmup", type=int, default=1, help="untimed runs per batch size first (default %(default)s)")
    add("--seed", type=int, default=0, help="seed of the random prompts (default %(default)s)")


def _check(args: argparse.Namespace) -> None:
    for name in ("prompt_tokens", "decode_tokens", "repeats"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0 or any(b < 1 for b in args.batch_sizes):
        raise UserError("--warmup must be >= 0 and every --batch-sizes entry >= 1")


def _spread(values: list[float]) -> dict[str, float]:
    return dict(median=statistics.median(values), min=min(values), max=max(values))


def run(args: argparse.Namespace) -> int:
    _check(args)
    limit = max_model_len(args, read_config(args.model))
    if limit is not None and args.prompt_tokens + args.decode_tokens > limit:
        raise UserError(f"--prompt-tokens {args.prompt_tokens:,} + --decode-tokens {args.decode_tokens:,} is past "
                        f"--max-model-len {limit:,} (the model's max_position_embeddings unless given)")
    engine = build_engine(args, ignore_eos=True)
    from moetide.engine import native  # imports torch: after build_engine, which says so clearly if it is missing

    native_kernels = native.available() or native.unavailable_reason()
    vocab = engine.parts.model.config.vocab_size
    rng = random.Random(args.seed)
    for batch in args.batch_sizes:
        prefill, decode = [], []
        for run_index in range(args.warmup + args.repeats):
            prompts = [[rng.randrange(1, vocab) for _ in range(args.prompt_tokens)] for _ in range(batch)]
            stats = engine.generate(prompts, args.decode_tokens).stats
            if stats.failed_requests:
                raise UserError(f"batch {batch}: {stats.failed_requests} requests do not fit the KV cache; raise "
                                f"--kv-cache-memory")
            if run_index >= args.warmup:
                prefill.append(stats.prefill_tokens / stats.prefill_s)
                if stats.decode_tokens:
                    decode.append(stats.decode_tokens / stats.decode_s)
        line = dict(bench="engine", model=args.model, device=args.device, batch=batch,
                    prompt_tokens=args.prompt_tokens, decode_tokens=args.decode_tokens, repeats=args.repeats,
                    prefill_tokens_per_s=_spread(prefill),
                    decode_tokens_per_s=_spread(decode) if decode else None, native_kernels=native_kernels)
        print(json.dumps(line), flush=True)
    return 0
