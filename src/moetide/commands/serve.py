"""``moetide serve``: an OpenAI-compatible HTTP server on the engine (``moetide.serve``; docs/serve.md).

The engine options are ``moetide generate``'s (one builder, ``commands.generate.build_engine``); the server's own
are vLLM's names and defaults: ``--host``, ``--port`` 8000, ``--served-model-name``, ``--max-model-len`` (default:
the checkpoint's ``max_position_embeddings``), ``--chat-template`` (a file or the template itself, for a tokenizer
without one), ``--max-num-queued-reqs`` (503 past that many requests in flight), ``--uvicorn-log-level``.
SIGTERM or Ctrl-C: uvicorn stops accepting, lets the requests in flight finish, then the engine thread ends.
FastAPI, uvicorn and torch are imported only when the verb runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from moetide.commands.generate import (add_engine_arguments, build_engine, kv_capacity_tokens, load_tokenizer,
                                       max_model_len, read_config)
from moetide.commands.options import add_max_model_len, add_memory_option, bytes_text, checkpoint_dir
from moetide.errors import UserError, read_json

API_KEY_ENV = "MOETIDE_API_KEY"  # vLLM reads VLLM_API_KEY the same way


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    add = parser.add_argument
    add("--engine", choices=("moetide", "vllm"), default="moetide",
        help="moetide: moetide's engine (default); vllm: vLLM's own server with moetide's plugin, the shared options "
             "translated and any other option passed to vllm serve (docs/vllm_plugin.md)")
    parser.set_defaults(_unknown=_vllm_passthrough, _vllm_args=[])
    add("--host", default="0.0.0.0", help="address to listen on (default %(default)s)")
    add("--port", type=int, default=8000, help="port to listen on (default %(default)s)")
    add("--served-model-name", metavar="NAME", help="the model's name in the API (default: --model as given)")
    add_max_model_len(parser, "the model's max_position_embeddings")
    add("--chat-template", metavar="FILE|TEMPLATE",
        help="Jinja chat template for /v1/chat/completions (default: the tokenizer's)")
    add_memory_option(parser, "--max-request-bytes", None,
                      "answer 413 to a request body larger than this (default: 64 B per token of --max-model-len, "
                      "at least 1MiB)")
    add("--api-key", metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every /v1 route (default: $MOETIDE_API_KEY, else none); "
             "/health and /metrics stay open")
    add("--max-num-queued-reqs", type=int, metavar="N",
        help="answer 503 while N requests are in flight (default: no bound; requests wait in the queue)")
    add("--line-cycle-steps", type=int, default=0, metavar="N",
        help="--engine vllm, for soak tests of the line: every N steps give its last region back (once drained), "
             "or with none out grant the offload cap again (the plugin's line_cycle_steps; default 0: off)")
    add("--uvicorn-log-level", default="info", choices=("critical", "error", "warning", "info", "debug", "trace"),
        help="uvicorn's log level (default %(default)s)")


def read_chat_template(value: str | None) -> str | None:
    """vLLM's rule: a path to a file, else the template text itself (it must contain a Jinja tag)."""
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"--chat-template {value}: cannot read: {exc}") from None
    if "{" not in value:
        raise UserError(f"--chat-template {value}: no such file, and not a Jinja template")
    return value


def _generation_defaults(model: str) -> dict:
    """generation_config.json's sampling defaults, which vLLM applies to requests that do not set them."""
    path = checkpoint_dir(model) / "generation_config.json"
    doc = read_json(path, f"--model {path}") if path.is_file() else {}
    return doc if isinstance(doc, dict) else {}


def serve_config(args: argparse.Namespace):
    from moetide.serve.app import ServeConfig

    limit = max_model_len(args, read_config(args.model))
    if limit is None:
        raise UserError(f"--model {args.model}: config.json has no max_position_embeddings; give --max-model-len")
    if args.max_num_queued_reqs is not None and args.max_num_queued_reqs < 1:
        raise UserError(f"--max-num-queued-reqs must be >= 1, got {args.max_num_queued_reqs}")
    if not 0 < args.port < 65536:
        raise UserError(f"--port must be in 1..65535, got {args.port}")
    generation = _generation_defaults(args.model)
    body_limit = args.max_request_bytes if args.max_request_bytes is not None else max(1 << 20, 64 * limit)
    if not body_limit >= 1024:
        raise UserError(f"--max-request-bytes must be at least 1KiB, got {args.max_request_bytes:g}")
    key = api_key(args)
    return ServeConfig(model_name=args.served_model_name or args.model, model_dir=str(checkpoint_dir(args.model)),
                       max_model_len=limit, max_num_queued_reqs=args.max_num_queued_reqs, api_key=key,
                       max_request_bytes=body_limit,
                       chat_template=read_chat_template(args.chat_template),
                       default_temperature=float(generation.get("temperature", 1.0)),
                       default_top_p=float(generation.get("top_p", 1.0)))


def api_key(args: argparse.Namespace) -> str | None:
    """The key every /v1 route needs: ``--api-key``, else ``$MOETIDE_API_KEY``, else none (either engine)."""
    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    if key is not None and (not key.strip() or any(c.isspace() for c in key)):
        raise UserError("--api-key must be a non-empty key without spaces")
    return key


def check_chat_template(tokenizer, template: str | None, flag: str | None) -> str:
    """Render the chat template on a one-message conversation at start, so a broken one fails the server, not
    every chat request; returns where the template comes from (for the start-up log), or why there is none."""
    template = template or getattr(tokenizer, "chat_template", None)
    if not template:
        return "none: /v1/chat/completions answers 400 until the server is started with --chat-template FILE"
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], chat_template=template, tokenize=False,
                                      add_generation_prompt=True)
    except Exception as exc:  # jinja's syntax and render errors
        where = f"--chat-template {flag}" if flag else "the tokenizer's chat template"
        raise UserError(f"{where}: it fails on a one-message conversation: {type(exc).__name__}: {exc}") from None
    if not flag:
        return "the tokenizer's"
    return f"--chat-template {flag}" if Path(flag).is_file() else "--chat-template (a template given inline)"


def check_kv_fits(engine, args: argparse.Namespace, max_model_len: int) -> int:
    """vLLM's start-up check: refuse a KV cache that cannot hold one ``max_model_len`` sequence, with the
    numbers and the longest length it could serve; returns the capacity in tokens."""
    capacity = kv_capacity_tokens(engine, args.policy)
    if capacity < max_model_len:
        raise UserError(f"the KV cache holds at most {capacity:,} tokens of one sequence (--kv-cache-memory "
                        f"{bytes_text(engine.config.kv_cache_memory)}), less than --max-model-len "
                        f"{max_model_len:,}: raise "
                        f"--kv-cache-memory, or serve --max-model-len {capacity:,} or less")
    return capacity


def build_app(args: argparse.Namespace):
    """The FastAPI app and its engine loop (not started: the app's lifespan starts and stops it)."""
    from moetide.serve.app import create_app
    from moetide.serve.loop import EngineLoop
    from moetide.serve.metrics import ServerMetrics

    config = serve_config(args)
    tokenizer = load_tokenizer(args.model)
    template = check_chat_template(tokenizer, config.chat_template, args.chat_template)
    engine = build_engine(args)
    capacity = check_kv_fits(engine, args, config.max_model_len)
    kv = engine.parts.scheduler.kv
    print(f"moetide serve: model {config.model_name} ({config.model_dir}); max_model_len {config.max_model_len:,}; "
          f"KV cache {kv.pool.num_blocks:,} blocks of {kv.block_size} tokens "
          f"({bytes_text(engine.config.kv_cache_memory)}"
          f"{f' + {bytes_text(args.kv_host_memory)} on the host' if args.kv_host_memory else ''}; one sequence "
          f"at most {capacity:,} tokens); policy {args.policy} (max offload ratio {args.max_offload_ratio:g}); "
          f"chat template: {template}; API key: {'required' if config.api_key else 'none'}", file=sys.stderr)
    if config.api_key is None and args.host in ("0.0.0.0", "::", ""):
        print(f"moetide serve: warning: listening on every interface ({args.host}) without an API key: anyone who "
              f"can reach port {args.port} can use the model (--api-key or ${API_KEY_ENV})", file=sys.stderr)
    loop = EngineLoop(engine)
    metrics = ServerMetrics(config.model_name, lambda: loop.metrics,
                            lambda: (loop.num_steps, loop.step_wall_s, loop.step_cpu_s))
    loop.observer = metrics.observe
    return create_app(loop, tokenizer, config, metrics), loop


def serve_in_thread(model: str, *argv: str):
    """``moetide serve --model MODEL ARGV`` on a free local port, on a thread of this process, with
    ``CHAT_TEMPLATE`` unless ARGV names one: what tests and benchmarks talk to (``serve.harness.LiveServer``)."""
    from moetide.serve.harness import CHAT_TEMPLATE, free_port, run_in_thread

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    template = [] if "--chat-template" in argv else ["--chat-template", CHAT_TEMPLATE]
    args = parser.parse_args(["--model", str(model), "--port", str(free_port()), "--host", "127.0.0.1", *template,
                              *argv])
    app, loop = build_app(args)
    return run_in_thread(app, loop, args)


def _check_port(host: str, port: int) -> None:
    """Fail before the engine is built (seconds), not after, when the address is taken."""
    import socket

    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError as exc:
        raise UserError(f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc})") from None


def _vllm_passthrough(args: argparse.Namespace, extra: list[str]) -> None:
    """Options moetide does not know go to ``vllm serve`` with ``--engine vllm``; without it they are errors."""
    if args.engine != "vllm":
        args._parser.error(f"unrecognized arguments: {' '.join(extra)} (vLLM's flags need --engine vllm)")
    args._vllm_args = extra


def run(args: argparse.Namespace) -> int:
    if args.engine == "vllm":
        from moetide.commands.serve_vllm import exec_vllm, serve_flags_env, vllm_argv, vllm_env

        defaults = args._parser.parse_known_args(["--model", args.model])[0]
        env = {**vllm_env(api_key(args)), **serve_flags_env(args._parser)}
        exec_vllm(vllm_argv(args, defaults, args._vllm_args), env)
    if args.line_cycle_steps:
        raise UserError("--line-cycle-steps: the vLLM plugin's soak setting; it needs --engine vllm")
    try:
        import uvicorn
    except ImportError:
        raise UserError("serve needs FastAPI and uvicorn: pip install 'moetide[serve]'") from None
    _check_port(args.host, args.port)
    app, _loop = build_app(args)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)
    return 0
