"""Option groups every verb shares, declared once, with vLLM's names and one set of defaults.

Conventions (vLLM's where vLLM has the concept): memory sizes are bytes with optional unit suffixes
(``--kv-cache-memory 2GiB``, ``512MiB``, ``1e9``; vLLM's ``human_readable_int``: lowercase k/m/g/t are powers of
1000, uppercase K/M/G/T and KiB/MiB/GiB/TiB powers of 1024); ``--max-model-len``; ``--max-num-batched-tokens``;
``--json PATH`` with ``-`` for stdout; ``--model`` takes a preset name, a checkpoint folder or its config.json.
Spellings 0.2.0 removed (``--kv-budget-gib``, ``--tp`` ...) are refused with their replacement
(``REMOVED_SPELLINGS``, CHANGELOG.md).

The serving options' defaults are ``core.config.ServingConfig``'s (a ``None`` there is resolved by the driver), so
no verb carries a copy.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import sys
from pathlib import Path

from moetide.core.config import COLD_EXPERT_MODES
from moetide.core.kv_manager import DEVICE_PREFIXES
from moetide.core.pressure import POLICIES
from moetide.core.splits import SPLIT_POLICIES
from moetide.errors import UserError, read_json
from moetide.units import GiB, KiB, MiB, bytes_text  # noqa: F401 (bytes_text: the verbs import it from here)

_SUFFIXES = {"": 1, "b": 1, "B": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
             "K": KiB, "M": MiB, "G": GiB, "T": 2**40,
             "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "kib": KiB, "mib": MiB, "gib": GiB, "tib": 2**40}
_SIZE = re.compile(r"\s*([0-9.]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*")
POLICY_HELP = ", ".join(POLICIES)


def parse_bytes(text: str) -> float:
    """``2GiB`` -> 2147483648; ``1e9`` -> 1e9; ``1.5k`` -> 1500.0 (a float: a token count refuses fractions)."""
    match = _SIZE.fullmatch(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"a size in bytes such as 2GiB, 512MiB or 1e9, got {text!r}")
    number, suffix = match.groups()
    scale = _SUFFIXES.get(suffix) or _SUFFIXES.get(suffix.lower() if len(suffix) > 1 else suffix)
    try:
        value = float(number)
    except ValueError:
        value = math.nan
    if scale is None or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"a size in bytes such as 2GiB, 512MiB or 1e9, got {text!r}")
    return value * scale


def parse_size(text: str) -> int:
    """A memory size as every ``SIZE`` option takes it: ``parse_bytes``, in whole bytes."""
    return int(parse_bytes(text))


def int_list(text: str) -> list[int]:
    """A list option's value: comma-separated whole numbers, as every list option takes (``1,8,32``)."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated whole numbers such as 1,8,32, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"at least one number, got {text!r}")
    return values


# config fields whose flag is not the field's name in dashes
FLAG_OF_FIELD = {"staging_mode": "--staging", "tp": "--tensor-parallel-size"}


def flag_message(message: str) -> str:
    """A config error in the CLI's words: each ``ReplayConfig.field`` (``EngineConfig``, ``ServingConfig``)
    named as its flag."""
    return re.sub(r"(?:Replay|Engine|Serving)Config\.(\w+)",
                  lambda m: FLAG_OF_FIELD.get(m.group(1), "--" + m.group(1).replace("_", "-")), message)


# ---- removed spellings -------------------------------------------------------------------------

# spellings 0.2.0 removed -> what replaces them (CHANGELOG.md); "FLAG (VERB)" where only one verb had it.
# ``cli`` refuses each with its replacement.
_STATE_CHECKPOINTS = ("nothing: hybrid states are cached blocks (--prefix-cache-retention-interval none keeps every "
                      "block's)")
REMOVED_SPELLINGS = {
    "--kv-budget-gib": "--kv-cache-memory SIZE (e.g. 8GiB)", "--kv-budget-mib": "--kv-cache-memory SIZE (e.g. 64MiB)",
    "--kv-host-gib": "--kv-host-memory SIZE (e.g. 64GiB)", "--kv-host-mib": "--kv-host-memory SIZE (e.g. 64MiB)",
    "--kv-host-active-gib": "--kv-host-active-memory SIZE", "--kv-host-active-mib": "--kv-host-active-memory SIZE",
    "--fixed-ratio": "--split-fixed-ratio", "--tp": "--tensor-parallel-size (or -tp)",
    "--state-checkpoints (replay)": _STATE_CHECKPOINTS, "--state-checkpoints (compare)": _STATE_CHECKPOINTS,
    "--state-checkpoints (sweep)": _STATE_CHECKPOINTS,
    "--vram-gib": "--gpu-memory SIZE", "--device-kv-gib": "--kv-cache-memory SIZE", "--ring-mib": "--ring-memory SIZE",
    "--split-host": "--cpu", "--host (specs)": "--cpu",
}


def check_removed(verb: str | None, argv: list[str]) -> None:
    """A spelling 0.2.0 removed is one error naming its replacement, not argparse's bare "unrecognized"."""
    for arg in argv:
        flag = arg.split("=", 1)[0]
        replacement = REMOVED_SPELLINGS.get(f"{flag} ({verb})") or REMOVED_SPELLINGS.get(flag)
        if replacement is not None:
            raise UserError(f"{flag} was removed in 0.2.0: use {replacement} (CHANGELOG.md)")


def add_memory_option(parser: argparse.ArgumentParser, flag: str, default: float | None, help: str) -> None:
    """A size in whole bytes with unit suffixes (``parse_size``)."""
    parser.add_argument(flag, type=parse_size, default=default, metavar="SIZE", help=help)


# ---- outputs ------------------------------------------------------------------------------------------------


def add_json_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """``--json PATH`` (``-``: stdout), the same in every verb."""
    parser.add_argument("--json", metavar="PATH", help=f"write {what} as JSON to PATH ('-': stdout)")


def add_plot_argument(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--plot", type=Path, metavar="PNG", help=f"write a PNG ({what}) here")


def check_output_path(flag: str, path: str | Path | None) -> None:
    """Fail before a run, not after it: the folder must exist and be writable, the path not a folder."""
    if path is None or str(path) == "-":
        return
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise UserError(f"{flag} {path}: is a folder; give a file name such as {path / 'out'}")
    if not parent.is_dir():
        raise UserError(f"{flag} {path}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UserError(f"{flag} {path}: not writable")


def check_outputs(args: argparse.Namespace) -> None:
    """Every optional output of a run (``--json``, ``--plot`` and matplotlib for it) checked before it starts."""
    check_output_path("--json", getattr(args, "json", None))
    plot = getattr(args, "plot", None)
    if plot is not None:
        check_output_path("--plot", plot)
        from moetide.report.plots import require_matplotlib

        require_matplotlib()


def write_json_output(path: str | Path, text: str) -> None:
    """JSON text to ``path``, or to stdout for ``-``; a failed write is one ``UserError`` naming the flag."""
    if str(path) == "-":
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        return
    try:
        Path(path).write_text(text if text.endswith("\n") else text + "\n", encoding="utf-8")
    except OSError as exc:
        raise UserError(f"--json {path}: cannot write: {exc.strerror or exc}") from None


def human_output(json_path: str | Path | None) -> contextlib.AbstractContextManager:
    """Where the human-readable report goes: stdout, or stderr when ``--json -`` gives stdout to the JSON."""
    return contextlib.redirect_stdout(sys.stderr) if str(json_path) == "-" else contextlib.nullcontext()


def add_policy_argument(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--policy", default=default, metavar="NAME",
                        help=f"memory-pressure policy, one of {POLICY_HELP} (default %(default)s)")


def add_model_argument(parser: argparse.ArgumentParser, *, default: str | None, what: str,
                       metavar: str = "NAME|DIR|CONFIG_JSON") -> None:
    parser.add_argument("--model", default=default, required=default is None, metavar=metavar,
                        help=f"{what} (default %(default)s)" if default else what)


def check_toml_output(flag: str, path: Path, kind: str, example: str) -> None:
    """A TOML file to write later: refused now (name, folder) rather than after the measuring."""
    if path.suffix.lower() != ".toml":
        raise UserError(f"{flag} {path}: the {kind} file is TOML and its name must end in .toml")
    if path.is_dir():
        raise UserError(f"{flag} {path}: is a directory; give a file name such as {path / example}")
    if not path.parent.is_dir():
        raise UserError(f"{flag} {path}: directory {path.parent} does not exist")
    _probe_write(flag, path)


def _probe_write(flag: str, path: Path) -> None:
    """Open the file for appending (and remove it again if it was not there): permissions are not the only thing
    that refuses a write (a read-only mount, a pseudo file system, root's own limits), and a run that measures first
    must not find out after."""
    existed = path.exists()
    try:
        with path.open("a", encoding="utf-8"):
            pass
    except OSError as exc:
        raise UserError(f"{flag} {path}: cannot write there: {exc.strerror or exc}") from None
    if not existed:
        path.unlink(missing_ok=True)


def write_text_file(flag: str, path: Path, text: str) -> None:
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise UserError(f"{flag} {path}: cannot write: {exc.strerror or exc}") from None


def checkpoint_dir(model: str) -> Path:
    """The checkpoint folder ``--model`` names: the folder itself, or the folder of its config.json."""
    path = Path(model)
    if path.is_file() and path.name.endswith(".json"):
        path = path.parent
    if not path.is_dir():
        raise UserError(f"--model {model}: not a checkpoint folder (a folder with config.json and safetensors)")
    if not (path / "config.json").is_file():
        raise UserError(f"--model {model}: the folder has no config.json")
    return path


def add_max_model_len(parser: argparse.ArgumentParser, default_text: str) -> None:
    parser.add_argument("--max-model-len", type=_positive_size, metavar="N",
                        help=f"longest sequence (prompt + output tokens) a request may reach; longer ones are "
                             f"refused, as vLLM refuses them (1k = 1000, 1K = 1024; default: {default_text})")


def _positive_size(text: str) -> int:
    value = parse_bytes(text)
    if value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"a positive whole number of tokens, got {text!r}")
    return int(value)


# ---- the workload of the modeled verbs (replay, compare, sweep) ---------------------------------------------


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    from moetide.workloads import READERS

    kinds = "; ".join(f"{name}: {reader.summary}" for name, reader in READERS.items())
    parser.add_argument("trace", nargs="?", help=f"trace file ({kinds}; .gz ok); omitted: the built-in "
                        "agent-session generator")
    parser.add_argument("--format", choices=list(READERS), help="trace format (default: sniffed)")
    parser.add_argument("--session-rate", type=float, help="closed-loop workloads: new sessions per second "
                        "(Poisson; the built-in generator's default 0.2)")
    parser.add_argument("--max-requests", type=int, help="keep the first N requests (whole sessions)")
    parser.add_argument("--time-window", help="keep START:END seconds of the trace, e.g. 0:600")
    parser.add_argument("--sessions", type=int, help="keep the first N sessions (the built-in generator: make N; "
                        "default 64)")
    parser.add_argument("--seed", type=int, default=0, help="one seed for everything random (default 0)")
    scale = parser.add_argument_group("scaling a trace to a small model (moetide.workloads.scale)")
    scale.add_argument("--time-scale", type=float, default=1.0, metavar="F",
                       help="multiply session starts, arrival times and think times by F (default %(default)s)")
    scale.add_argument("--length-scale", type=float, default=1.0, metavar="F",
                       help="multiply prompt, output and key-block lengths by F (default %(default)s)")
    scale.add_argument("--max-input-tokens", type=int, metavar="N",
                       help="cap each prompt at N tokens (its leading key blocks kept)")
    scale.add_argument("--max-output-tokens", type=int, metavar="N", help="cap each request's output at N tokens")


# ---- serving options both drivers have (the replay's modeled engine, the PyTorch engine) ---------------------


def _size_help(what: str, resolved: object, replay_text: str) -> str:
    return f"{what} (default: {replay_text if resolved is None else bytes_text(resolved)})"


def add_serving_arguments(parser: argparse.ArgumentParser, driver: str, *, with_offload_ratio: bool = True,
                          policy: str | None = "vllm") -> None:
    """``core.config.ServingConfig``'s options, its defaults; a ``None`` there is resolved by the driver (the
    replay, ``driver="replay"``, from the GPU and model; the engine from ``engine.defaults.ENGINE_DEFAULTS``), which
    the help says. Each verb adds its driver's own options beside them."""
    from moetide.core.config import ServingConfig

    d = ServingConfig()
    if driver == "replay":
        from moetide.sim.setup import ReplayConfig

        resolved: dict[str, object] = {}
        add_model_argument(parser, default=ReplayConfig.model, what="model preset, checkpoint folder or its "
                           "config.json")
    else:
        from moetide.engine.defaults import ENGINE_DEFAULTS as resolved

        add_model_argument(parser, default=None, what="checkpoint folder (config.json + safetensors) or its "
                           "config.json", metavar="DIR|CONFIG_JSON")
    what = "KV cache per GPU" if driver == "replay" else "device memory for the KV cache beyond the routed experts"
    parser.add_argument("--kv-cache-memory", type=parse_size, default=d.kv_cache_memory, metavar="SIZE",
                        help=_size_help(f"{what}, e.g. 8GiB or 1e9 (vLLM's --kv-cache-memory-bytes, also accepted)",
                                        resolved.get("kv_cache_memory"), "what is left of --gpu-memory-utilization x "
                                        "HBM after weights and activations"))
    parser.add_argument("--kv-cache-memory-bytes", dest="kv_cache_memory", type=parse_size, help=argparse.SUPPRESS)
    if driver == "replay":  # each engine verb declares its own: serve's answers requests, generate's refuses
        add_max_model_len(parser, "no limit")
    _add_batch_arguments(parser, resolved)
    if policy is not None:
        add_policy_argument(parser, policy)
    if with_offload_ratio:
        parser.add_argument("--max-offload-ratio", type=float, default=d.max_offload_ratio, metavar="R",
                            help="cap on the offloaded share of routed-expert bytes (default %(default)s)")
    parser.add_argument("--vamp-costs", metavar="FILE",
                        help="vamp: price with this cost record (EngineCosts' fields, or an earlier --json report's "
                             "\"vamp_costs\") as vLLM's plugin and moetide's engine do, instead of "
                             + ("the replay's own step and staging models" if driver == "replay"
                                else "measuring one at start; the same input then makes the same decisions"))
    parser.add_argument("--vamp-horizon-s", type=float, default=d.vamp_horizon_s, metavar="S",
                        help="vamp: seconds between reviews of the line, and the time constant of its measured "
                             f"rates ({'modeled' if driver == 'replay' else 'engine'} seconds; default %(default)s)")
    parser.add_argument("--cold-experts", choices=list(COLD_EXPERT_MODES), default=d.cold_experts,
                        help="offloaded experts a step does not prefetch: fetch them over the host link, or compute "
                             "them on the host CPU where they lie when that is cheaper (default %(default)s)")
    _add_host_kv_arguments(parser, d)


def _add_batch_arguments(parser: argparse.ArgumentParser, resolved: dict[str, object]) -> None:
    def default(name: str, replay_text: str) -> str:
        return f"default: {replay_text}" if resolved.get(name) is None else f"default {resolved[name]}"

    parser.add_argument("--block-size", type=int, metavar="N", help="tokens per KV block (" + default(
        "block_size", "vLLM's, 16, or for hybrid models the size that fits one layer's linear-attention state in a "
        "page: 544 for Qwen3-Next-80B at TP 1-2") + ")")
    parser.add_argument("--max-num-seqs", type=int, metavar="N", help="most requests running at once, as in vLLM ("
                        + default("max_num_seqs", "vLLM 0.32's server default for the GPU: 1024 on H100/H200-class "
                                  "GPUs, 256 on A100, V100 and smaller") + ")")
    parser.add_argument("--max-num-batched-tokens", type=int, metavar="N", help="token budget of a step, as in vLLM ("
                        + default("max_num_batched_tokens", "vLLM 0.32's server default for the GPU: 8192 on "
                                  "H100/H200-class GPUs, 16384 from 160 GiB, 2048 on A100, V100 and smaller") + ")")


def _add_host_kv_arguments(parser: argparse.ArgumentParser, d) -> None:
    parser.add_argument("--kv-host-memory", type=parse_size, default=d.kv_host_memory, metavar="SIZE",
                        help="host memory for KV blocks that spill past the device KV cache, e.g. 64GiB: attention "
                             "then splits each step between the device, the CPU in place and blocks streamed to the "
                             "device, as --split-policy chooses (default: none)")
    parser.add_argument("--kv-host-active-memory", type=parse_size, default=d.kv_host_active_memory, metavar="SIZE",
                        help="--kv-host-memory: admit a request only while the host KV that running requests attend "
                             "each step stays within this size (the rest holds cached prefixes) (default: no bound)")
    parser.add_argument("--split-policy", choices=list(SPLIT_POLICIES), default=d.split_policy,
                        help="--kv-host-memory: who attends the host KV each step (default %(default)s)")
    parser.add_argument("--split-fixed-ratio", type=float, default=d.split_fixed_ratio, metavar="X",
                        help="--split-policy fixed-ratio: the CPU's share of every sequence's host KV (default "
                             "%(default)s)")
    parser.add_argument("--device-prefixes", choices=list(DEVICE_PREFIXES), default=d.device_prefixes,
                        help="--kv-host-memory: when no uncached device block is free, keep the cached prefixes in "
                             "device blocks and spill new KV to the host, or evict the least recently used of them "
                             "first (default %(default)s)")


def read_costs(path: str) -> dict:
    """A cost record: a --json report (its ``vamp_costs``) or the bare record."""
    doc = read_json(path, f"--vamp-costs {path}")
    record = doc.get("vamp_costs", doc) if isinstance(doc, dict) else None
    if not isinstance(record, dict):
        raise UserError(f"--vamp-costs {path}: expected an object with the cost fields or a \"vamp_costs\" one")
    return record
