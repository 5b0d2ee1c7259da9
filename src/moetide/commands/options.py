"""Option groups every verb shares, declared once, with vLLM's names and one set of defaults.

Conventions (vLLM's where vLLM has the concept): memory sizes are bytes with optional unit suffixes
(``--kv-cache-memory 2GiB``, ``512MiB``, ``1e9``; vLLM's ``human_readable_int``: lowercase k/m/g/t are powers of
1000, uppercase K/M/G/T and KiB/MiB/GiB/TiB powers of 1024); ``--max-model-len``; ``--max-num-batched-tokens``;
``--json PATH`` with ``-`` for stdout; ``--model`` takes a preset name, a checkpoint folder or its config.json.
Spellings of earlier releases (``--kv-budget-gib``, ``--kv-budget-mib``, ``--kv-host-gib`` ...) still work for
one release: each converts to the new option's unit and warns once per process.

Defaults come from the drivers' own config dataclasses (``sim.setup.ReplayConfig`` for the modeled verbs,
``engine.build.EngineConfig`` for the engine's), so no verb carries a third copy.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import sys
from pathlib import Path

from moetide.core.pressure import POLICIES
from moetide.errors import UserError

KiB, MiB, GiB = 2**10, 2**20, 2**30
_SUFFIXES = {"": 1, "b": 1, "B": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
             "K": KiB, "M": MiB, "G": GiB, "T": 2**40,
             "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "kib": KiB, "mib": MiB, "gib": GiB, "tib": 2**40}
_SIZE = re.compile(r"\s*([0-9.]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*")
POLICY_HELP = ", ".join(POLICIES)


def parse_bytes(text: str) -> float:
    """``2GiB`` -> 2147483648; ``1e9`` -> 1e9. A float, so that a size given in GiB divides back exactly."""
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


def bytes_text(num_bytes: float) -> str:
    """A size in the binary unit its magnitude calls for (``8 GiB``, ``1.5 MiB``)."""
    for scale, unit in ((2**50, "PiB"), (2**40, "TiB"), (GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if num_bytes >= scale:
            return f"{num_bytes / scale:,.4g} {unit}"
    return f"{num_bytes:,.0f} B"


# ---- deprecated spellings -----------------------------------------------------------------------------------

_WARNED: set[str] = set()
_PENDING: list[str] = []


def warn_once(key: str, message: str) -> None:
    """One warning per process and key, held until the run starts (``flush_warnings``): a command that stops on a
    ``UserError`` prints that one line only."""
    if key not in _WARNED:
        _WARNED.add(key)
        _PENDING.append(f"moetide: warning: {message}")


def flush_warnings() -> None:
    """The held warnings on stderr; verbs call it once their input is checked, ``cli.main`` after every run."""
    for line in _PENDING:
        print(line, file=sys.stderr)
    _PENDING.clear()


def drop_warnings() -> None:
    _PENDING.clear()


class _Deprecated(argparse.Action):
    """An old spelling: converts its value to the new option's (``scale``: bytes per old unit) and warns once."""

    def __init__(self, option_strings, dest, new_flag: str, scale: float | None = None, **kwargs) -> None:
        self.new_flag, self.scale = new_flag, scale
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        new = self.new_flag
        if self.scale is not None:
            try:
                number = float(values)
            except ValueError:
                parser.error(f"argument {option_string}: a number, got {values!r}")
            if not number >= 0:
                raise UserError(f"{option_string} must be >= 0, got {values}")
            unit = option_string.rsplit("-", 1)[-1]
            new = f"{self.new_flag} {values}{unit[:-2].upper()}iB" if unit.endswith("ib") else self.new_flag
            values = number * self.scale
        warn_once(option_string, f"{option_string} is deprecated and goes in the next release; use {new}")
        setattr(namespace, self.dest, values)


def add_deprecated(parser: argparse.ArgumentParser, old_flag: str, dest: str, new_flag: str, *,
                   scale: float | None = None, type=None) -> None:
    parser.add_argument(old_flag, dest=dest, action=_Deprecated, new_flag=new_flag, scale=scale, type=type,
                        help=argparse.SUPPRESS)


def add_memory_option(parser: argparse.ArgumentParser, flag: str, default: float | None, help: str,
                      old: dict[str, float] | None = None) -> None:
    """A size in bytes with unit suffixes, and its old spellings (flag -> bytes per unit) as deprecated aliases."""
    dest = flag.lstrip("-").replace("-", "_")
    parser.add_argument(flag, type=parse_bytes, default=default, metavar="SIZE", help=help)
    for old_flag, scale in (old or {}).items():
        add_deprecated(parser, old_flag, dest, flag, scale=scale)


# ---- outputs ------------------------------------------------------------------------------------------------


def add_json_argument(parser: argparse.ArgumentParser, what: str, *, bare: bool = False) -> None:
    """``--json PATH`` (``-``: stdout). ``bare``: a verb whose ``--json`` once took no value keeps that meaning."""
    if bare:
        parser.add_argument("--json", nargs="?", const="-", metavar="PATH",
                            help=f"write {what} as JSON to PATH ('-' or no PATH: stdout)")
    else:
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
    parser.add_argument("trace", nargs="?", help="trace file (Mooncake JSONL, WEKA sessions, Azure CSV; .gz ok); "
                        "omitted: the built-in agent-session generator")
    parser.add_argument("--format", choices=["mooncake", "weka", "azure"], help="trace format (default: sniffed)")
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


def _driver_defaults(driver: str) -> dict[str, object]:
    """The defaults of one driver's config dataclass, in the options' units (bytes)."""
    if driver == "replay":
        from moetide.sim.setup import ReplayConfig

        d = ReplayConfig()
        return dict(model=d.model, kv_cache_memory=None, block_size=d.block_size, max_num_seqs=d.max_num_seqs,
                    max_num_batched_tokens=d.max_num_batched_tokens, max_offload_ratio=d.max_offload_ratio,
                    kv_host_memory=d.kv_host_gib * GiB, split_policy=d.split_policy,
                    split_fixed_ratio=d.split_fixed_ratio, device_prefixes=d.device_prefixes,
                    cold_experts=d.cold_experts, vamp_horizon_s=d.vamp_horizon_s, unit=("gib", GiB))
    from moetide.engine.build import DEFAULT_KV_CACHE_BYTES, EngineConfig

    d = EngineConfig(kv_budget_bytes=DEFAULT_KV_CACHE_BYTES)
    return dict(model=None, kv_cache_memory=float(d.kv_budget_bytes), block_size=d.block_size,
                max_num_seqs=d.max_num_seqs, max_num_batched_tokens=d.max_num_batched_tokens,
                max_offload_ratio=d.max_offload_ratio, kv_host_memory=float(d.kv_host_bytes),
                split_policy=d.split_policy, split_fixed_ratio=d.split_fixed_ratio,
                device_prefixes="evict" if d.evict_device_prefixes else "keep", cold_experts=d.cold_experts,
                vamp_horizon_s=d.vamp_horizon_s, unit=("mib", MiB))


def add_serving_arguments(parser: argparse.ArgumentParser, driver: str, *, with_offload_ratio: bool = True,
                          policy: str | None = "vllm") -> None:
    """The options the replay (``driver="replay"``) and the engine (``"engine"``) share, with that driver's
    defaults; each verb adds its driver's own options beside them."""
    from moetide.core.kv_manager import DEVICE_PREFIXES
    from moetide.core.splits import SPLIT_POLICIES
    from moetide.perf.staging import COLD_EXPERT_MODES

    d = _driver_defaults(driver)
    unit, scale = d["unit"]
    add = parser.add_argument
    if driver == "replay":
        add_model_argument(parser, default=d["model"], what="model preset, checkpoint folder or its config.json")
    else:
        add_model_argument(parser, default=None, what="checkpoint folder (config.json + safetensors) or its "
                           "config.json", metavar="DIR|CONFIG_JSON")
    kv_default = ("what is left of --gpu-memory-utilization x HBM after weights and activations"
                  if d["kv_cache_memory"] is None else bytes_text(d["kv_cache_memory"]))
    what = "KV cache per GPU" if driver == "replay" else "device memory for the KV cache beyond the routed experts"
    add_memory_option(parser, "--kv-cache-memory", d["kv_cache_memory"],
                      f"{what}, e.g. 8GiB or 1e9 (vLLM's --kv-cache-memory-bytes) "
                      f"(default: {kv_default})", old={f"--kv-budget-{unit}": scale})
    add("--kv-cache-memory-bytes", dest="kv_cache_memory", type=parse_bytes, help=argparse.SUPPRESS)
    if driver == "replay":  # each engine verb declares its own: serve's answers requests, generate's refuses
        add_max_model_len(parser, "no limit")
    add("--block-size", type=int, default=d["block_size"], metavar="N",
        help="tokens per KV block (default: vLLM's, 16, or for hybrid models the size that fits one layer's "
             "linear-attention state in a page: 544 for Qwen3-Next-80B at TP 1-2)" if d["block_size"] is None
        else "tokens per KV block (default %(default)s)")
    add("--max-num-seqs", type=int, default=d["max_num_seqs"], metavar="N",
        help="most requests running at once, as in vLLM (default: vLLM 0.32's server default for the GPU: 1024 on "
             "H100/H200-class GPUs, 256 on A100, V100 and smaller)" if d["max_num_seqs"] is None
        else "most requests running at once, as in vLLM (default %(default)s)")
    add("--max-num-batched-tokens", type=int, default=d["max_num_batched_tokens"], metavar="N",
        help="token budget of a step, as in vLLM (default: vLLM 0.32's server default for the GPU: 8192 on "
             "H100/H200-class GPUs, 16384 from 160 GiB, 2048 on A100, V100 and smaller)"
        if d["max_num_batched_tokens"] is None else "token budget of a step, as in vLLM (default %(default)s)")
    if policy is not None:
        add_policy_argument(parser, policy)
    if with_offload_ratio:
        add("--max-offload-ratio", type=float, default=d["max_offload_ratio"], metavar="R",
            help="cap on the offloaded share of routed-expert bytes (default %(default)s)")
    add("--vamp-horizon-s", type=float, default=d["vamp_horizon_s"], metavar="S",
        help="vamp: seconds between reviews of the line, and the time constant of its measured rates "
             f"({'modeled' if driver == 'replay' else 'engine'} seconds; default %(default)s)")
    add("--cold-experts", choices=list(COLD_EXPERT_MODES), default=d["cold_experts"],
        help="offloaded experts a step does not prefetch: fetch them over the host link, or compute them on the "
             "host CPU where they lie when that is cheaper (default %(default)s)")
    add_memory_option(parser, "--kv-host-memory", d["kv_host_memory"],
                      "host memory for KV blocks that spill past the device KV cache, e.g. 64GiB: attention then "
                      "splits each step between the device, the CPU in place and blocks streamed to the device, as "
                      "--split-policy chooses (default: none)", old={f"--kv-host-{unit}": scale})
    add_memory_option(parser, "--kv-host-active-memory", None,
                      "--kv-host-memory: admit a request only while the host KV that running requests attend each "
                      "step stays within this size (the rest holds cached prefixes) (default: no bound)",
                      old={f"--kv-host-active-{unit}": scale})
    add("--split-policy", choices=list(SPLIT_POLICIES), default=d["split_policy"],
        help="--kv-host-memory: who attends the host KV each step (default %(default)s)")
    add("--split-fixed-ratio", type=float, default=d["split_fixed_ratio"], metavar="X",
        help="--split-policy fixed-ratio: the CPU's share of every sequence's host KV (default %(default)s)")
    add_deprecated(parser, "--fixed-ratio", "split_fixed_ratio", "--split-fixed-ratio", type=float)
    add("--device-prefixes", choices=list(DEVICE_PREFIXES), default=d["device_prefixes"],
        help="--kv-host-memory: when no uncached device block is free, keep the cached prefixes in device blocks "
             "and spill new KV to the host, or evict the least recently used of them first (default %(default)s)")
