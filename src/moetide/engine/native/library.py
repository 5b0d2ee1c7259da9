"""Building and loading the native kernels' library, and what its kernels read.

The C sources are compiled with the system compiler (``$CC`` or ``cc``; ``-O3 -march=native``, else ``-O3``) into
a cache directory (``$MOETIDE_NATIVE_DIR``, else ``~/.cache/moetide/native``, else a private temp directory),
keyed by the sources, the flags and the CPU, and loaded with ``ctypes`` only if this user owns the file and nobody
else can write it. ``MOETIDE_NATIVE=0`` turns it off. The wrappers in ``native`` and ``native.layer`` call
``load()`` and pass tensors by ``ptr``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import Tensor

_SOURCES = tuple(Path(__file__).with_name(name) for name in ("kernels.c", "moe.c", "gdn.c", "layer.c"))
# headers are part of the build's key, not compiled on their own
_HEADERS = tuple(Path(__file__).with_name(name) for name in ("bf16.h", "simd.h"))
_ABI_VERSION = 17
_FLAG_SETS = (["-O3", "-march=native"], ["-O3"])  # -march=native is refused by some compilers and CPUs
_LINEAR_ISAS = ("c", "avx2", "avx512", "avx512-bf16", "amx")  # moetide_linear_isa()'s answers, in order
_reasons: list[str] = []
EXPERT_DTYPES = (torch.float32, torch.bfloat16)  # what the experts, linear, norm and attention kernels read


def _cache_dirs() -> list[Path]:
    """Where the library may be built: ``$MOETIDE_NATIVE_DIR`` alone if set, else ``~/.cache/moetide/native`` and,
    where that cannot be written (a read-only or absent home), a private directory under the system temp dir."""
    if os.environ.get("MOETIDE_NATIVE_DIR"):
        return [Path(os.environ["MOETIDE_NATIVE_DIR"])]
    dirs = []
    try:
        dirs.append(Path.home() / ".cache" / "moetide" / "native")
    except RuntimeError:  # no home directory
        pass
    return [*dirs, Path(tempfile.gettempdir()) / f"moetide-native-{os.getuid()}"]


def _trusted(path: Path) -> bool:
    """A library we built ourselves: owned by this user, not writable by others (a shared cache directory must
    not let another user plant the code we load)."""
    st = path.stat()
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


@functools.cache
def _cpu_signature() -> str:
    """What ``-march=native`` compiles for: the machine and, on Linux, the CPU's feature flags (a cache directory
    shared by different CPUs must not hand one a library with instructions it lacks)."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + " " + platform.processor() + " " + flags


def _build(compiler: str, flags: list[str], cache_dir: Path) -> Path:
    source = b"".join(path.read_bytes() for path in (*_SOURCES, *_HEADERS))
    key = hashlib.sha256(source + " ".join([compiler, *flags, _cpu_signature()]).encode()).hexdigest()[:16]
    target = cache_dir / f"moetide_kernels_{key}.so"
    if target.is_file():
        if not _trusted(target):
            raise OSError(f"{target} is not owned by this user or is writable by others: not loaded")
        return target
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # build aside, then one atomic rename
        built = Path(tmp) / target.name
        subprocess.run([compiler, *flags, "-shared", "-fPIC", "-o", str(built), *map(str, _SOURCES), "-lm"], check=True,
                       capture_output=True, timeout=120)
        built.chmod(0o755)  # whatever the umask: never writable by others (``_trusted``)
        os.replace(built, target)
    return target


_P, _I64, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
# each kernel's C signature: (argument types, return type)
_SIGNATURES = {
    "moetide_moe_grouped_f32": ([_P, _I64, _I64, _P, _P, _P, _I64, _P, _I64, _I64, _I64, _I64, _P, _P, _P], _INT),
    "moetide_moe_grouped_bf16": ([_P, _I64, _I64, _P, _P, _P, _I64, _P, _I64, _I64, _I64, _I64, _P, _P, _P], _INT),
    "moetide_linear": ([_P, _I64, _I64, _I64, _P, _I64, _P, _P, _P], None),
    "moetide_linear_isa": ([], _INT),
    "moetide_gdn_forward": ([_P, _I64, _I64, _I64, _I64, _I64, _P, _I64, _P, _I64, _I64, _I64, _I64, _P, _P, _P,
                             _I64, _I64, _I64, _I64, _P, _P, _P], None),
    "moetide_rms_norm": ([_P, _I64, _I64, _I64, _I64, _F32, _P, _I64, _P, _I64, _P, _P], None),
    "moetide_copy_blocks": ([_P, _P, _I64, _I64, _I64], None),
    "moetide_paged_decode_attention": ([_P, _I64, _I64, _I64, _I64, _P, _P, _I64, _I64, _I64, _P, _P, _I64, _F32,
                                        _P, _I64, _P, _I64, _P, _P, _I64, _P], _INT),
    "moetide_rms_norm_rope": ([_P, _I64, _I64, _I64, _I64, _I64, _F32, _P, _I64, _P, _P, _P, _I64, _P, _P, _I64],
                              None),
    "moetide_moe_route": ([_P, _I64, _I64, _I64, _I64, _I64, _I64, _P, _P], None),
    "moetide_attention_block_scratch": ([_I64] * 6, _I64),
    "moetide_attention_block": ([_P, _P, _P, _I64, _I64, _I64, _P, _P, _P], _INT),  # the args struct first
    "moetide_moe_block_scratch": ([_I64] * 5, _I64),
    "moetide_moe_block": ([_P, _P, _I64, _I64, _P, _P, _P, _P, _P], None),
    "moetide_decode_layers": ([_I64, _P, _P, _P, _P, _I64, _I64, _P, _P, _P, _P, _P, _P, _P], _INT),
}


def _declare(lib: ctypes.CDLL) -> None:
    """Each kernel's signature on the loaded library, and the linear kernel's ISA (read on every projection:
    asked once)."""
    for name, (argtypes, restype) in _SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, restype
    lib.linear_isa = _LINEAR_ISAS[lib.moetide_linear_isa()]


@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernels' library, built and loaded on the first call; None where it cannot be (the reason is in
    ``unavailable_reason()``). Cached: after ``load.cache_clear()`` the next call reads the environment again."""
    if os.environ.get("MOETIDE_NATIVE", "1") == "0":
        _reasons.append("disabled by MOETIDE_NATIVE=0")
        return None
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        _reasons.append(f"no C compiler ({compiler!r} not found)")
        return None
    errors = []
    for flags, cache_dir in ((f, d) for f in _FLAG_SETS for d in _cache_dirs()):
        try:
            lib = ctypes.CDLL(str(_build(compiler, flags, cache_dir)))
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", b"") or b""
            errors.append(f"{' '.join(flags)} in {cache_dir}: {exc} {detail.decode(errors='replace').strip()[:200]}")
            continue
        if lib.moetide_abi_version() != _ABI_VERSION:
            errors.append(f"{' '.join(flags)}: ABI version {lib.moetide_abi_version()} != {_ABI_VERSION}")
            continue
        _declare(lib)
        return lib
    _reasons.append("the native kernels did not build: " + "; ".join(errors))
    return None


def available() -> bool:
    return load() is not None


def unavailable_reason() -> str | None:
    return None if available() else _reasons[-1]


def ptr(t: Tensor | None) -> int | None:
    """A tensor's data pointer for ctypes (NULL for None); the tensor must stay referenced across the call."""
    return None if t is None else t.data_ptr()


def require_f32(name: str, *tensors: Tensor | None) -> None:
    """The kernels read raw fp32 memory: anything else is refused, never misread."""
    for t in tensors:
        if t is not None and (t.dtype != torch.float32 or t.device.type != "cpu"):
            raise ValueError(f"{name} takes fp32 CPU tensors, got {t.dtype} on {t.device}")


def experts_readable(gate_up: Tensor, down: Tensor) -> bool:
    """Whether ``moe_experts`` can read these stacked views: [E, 2I, H] and [E, H, I] with packed rows."""
    E, two_i, H = gate_up.shape
    return (down.shape == (E, H, two_i // 2) and gate_up.stride()[1:] == (H, 1)
            and down.stride()[1:] == (two_i // 2, 1))
