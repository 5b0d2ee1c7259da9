"""The one entry point: ``moetide <verb>``.

Each verb lives in ``moetide.commands.<verb>`` and exposes ``add_arguments(parser)`` and ``run(args) -> int``.
Verbs are listed in one table (no if-chains) and imported only when chosen, so ``moetide specs`` never imports torch.
A ``UserError`` anywhere becomes one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from moetide.errors import UserError

# verb -> (module under moetide.commands, one-line help)
VERBS: dict[str, tuple[str, str]] = {
    "specs": ("specs", "print model and hardware tables (presets, or your own config.json / hardware file)"),
    "perf": ("perf", "modeled step time (roofline) and per-GPU memory budget for a model on a GPU"),
    "make-test-model": ("make_test_model", "write a tiny random checkpoint and tokenizer made by transformers"),
    "plan-split": ("plan_split", "modeled WriteScope CPU/GPU split of host-spilled KV against four baselines"),
    "replay": ("replay", "replay a recorded trace (or the built-in agent sessions) on modeled hardware"),
    "compare": ("compare", "replay one workload under several memory policies and compare them"),
    "sweep": ("sweep", "replay one workload at several max offload ratios"),
    "generate": ("generate", "generate text with the engine under a KV budget (greedy, or seeded sampling)"),
    "bench-engine": ("bench_engine", "measured prefill and decode tokens/s of the engine at several batch sizes"),
    "calibrate": ("calibrate", "measure this machine (DRAM, CPU attention, host-to-device) and write a host file"),
    "serve": ("serve", "an OpenAI-compatible HTTP server on the engine (completions, chat, streaming, /metrics)"),
    "bench-serve": ("bench_serve", "replay a recorded trace in real time against an OpenAI-compatible server"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moetide", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    sub.required = True
    for verb, (module_name, help_text) in VERBS.items():
        module = importlib.import_module(f"moetide.commands.{module_name}")
        verb_parser = sub.add_parser(verb, help=help_text, description=help_text)
        module.add_arguments(verb_parser)
        verb_parser.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except UserError as exc:
        print(f"moetide {args.verb}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"moetide {args.verb}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
