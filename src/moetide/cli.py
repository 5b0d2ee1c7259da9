"""The one entry point: ``moetide <verb>``.

Each verb lives in ``moetide.commands.<verb>`` and exposes ``add_arguments(parser)`` and ``run(args) -> int``.
Verbs are listed in one table (no if-chains) and imported only when chosen, so ``moetide specs`` never imports torch.
A ``UserError`` anywhere becomes one line on stderr and exit code 2. An interrupt is one line and exit code 130,
however many times Ctrl-C is pressed; a closed stdout (``moetide specs --json - | head``) ends quietly, as
``SIGPIPE`` would end a C tool (exit code 141).
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

from moetide import __version__
from moetide.errors import UserError

# verb -> (module under moetide.commands, one-line help)
VERBS: dict[str, tuple[str, str]] = {
    "specs": ("specs", "print model and hardware tables (presets, or your own config.json / hardware file)"),
    "perf": ("perf", "modeled step time (roofline) and per-GPU memory budget for a model on a GPU"),
    "make-test-model": ("make_test_model", "write a tiny random checkpoint and tokenizer made by transformers"),
    "plan-split": ("plan_split", "modeled WriteScope CPU/GPU split of host-spilled KV against our four baselines and the WriteScope paper's four"),
    "replay": ("replay", "replay a recorded trace (or the built-in agent sessions) on modeled hardware"),
    "compare": ("compare", "replay one workload under several memory policies and compare them"),
    "sweep": ("sweep", "replay one workload at several max offload ratios"),
    "generate": ("generate", "generate text with the engine under a KV budget (greedy, or seeded sampling)"),
    "bench-engine": ("bench_engine", "measured prefill and decode tokens/s of the engine at several batch sizes"),
    "calibrate": ("calibrate", "measure this machine (DRAM, CPU attention, host-to-device) and write a host file"),
    "serve": ("serve", "an OpenAI-compatible HTTP server on the engine (completions, chat, streaming, /metrics)"),
    "bench-serve": ("bench_serve", "replay a recorded trace in real time against an OpenAI-compatible server"),
}


def build_parser(verb: str | None = None) -> argparse.ArgumentParser:
    """Every verb listed; the options of ``verb`` only (None: of none), so that only its module is imported."""
    parser = argparse.ArgumentParser(prog="moetide", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"moetide {__version__}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    sub.required = True
    for name, (module_name, help_text) in VERBS.items():
        verb_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == verb:
            module = importlib.import_module(f"moetide.commands.{module_name}")
            # _unknown: what to do with options the verb does not know (None: an error; a verb may take them)
            verb_parser.set_defaults(_run=module.run, _parser=verb_parser, _unknown=None)
            module.add_arguments(verb_parser)
    return parser


def _verb_of(argv: list[str] | None) -> str | None:
    return next((word for word in (sys.argv[1:] if argv is None else argv) if not word.startswith("-")), None)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """Arguments, with an unknown one reported by the verb's parser (its usage, ``moetide VERB: error: ...``) and
    a spelling 0.2.0 removed named with its replacement."""
    from moetide.commands.options import check_removed

    check_removed(_verb_of(argv), sys.argv[1:] if argv is None else argv)
    args, extra = build_parser(_verb_of(argv)).parse_known_args(argv)
    if extra and args._unknown is None:
        args._parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args._unknown(args, extra)
    return args


def _quiet_stdout() -> None:
    """stdout to /dev/null, so that the interpreter's last flush into a closed pipe raises nothing."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def main(argv: list[str] | None = None) -> int:
    verb = f"moetide {_verb_of(argv)}" if _verb_of(argv) in VERBS else "moetide"
    try:
        args = _parse(argv)
        code = int(args._run(args) or 0)
        sys.stdout.flush()
        return code
    except UserError as exc:
        print(f"{verb}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not interrupt the goodbye
        print(f"{verb}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        _quiet_stdout()
        return 141


if __name__ == "__main__":
    sys.exit(main())
