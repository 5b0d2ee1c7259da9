"""Find specs by preset name or by file: ``get_model``, ``get_gpu``, ``get_host``.

Presets are data (``presets/*.toml``, read with tomllib through importlib.resources so they work from a wheel),
never Python literals, so every number sits next to its source. A user's own model is an HF ``config.json``;
a user's own GPU or host is a small flat TOML or JSON file with the same fields as a preset table. A host file may
also carry the two tables ``moetide calibrate`` writes: ``[offload_efficiency]`` (the attention model's fitted
factors, read with ``get_host_calibration``) and ``[measured]`` (the raw measurements, for the record); they are not
HostSpec fields and ``get_host`` skips them. A GPU file may likewise carry ``[efficiency]`` (the step-time model's
factors, ``perf.step.Efficiency``; ``moetide calibrate --model`` fits them for the engine on a CPU described as a
device) and ``[measured]``, read with ``get_gpu_calibration``. Names are matched case-insensitively (with aliases such as ``h100`` for
``h100-sxm``); an argument that names an existing file, or contains a path separator, or ends in .json/.toml, is a
path.

Every failure is a ``UserError`` naming the file and field, or listing the valid preset names.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

from moetide.errors import UserError
from moetide.specs.hardware import HardwareSpec, HostSpec
from moetide.specs.hf_config import model_from_hf_config_file, model_from_hf_dict
from moetide.specs.model import ModelSpec

SpecT = TypeVar("SpecT", HardwareSpec, HostSpec)
_PRESET_META_KEYS = ("source", "aliases", "null_fields")
_PRESET_FILES = {"model": "models.toml", "gpu": "gpus.toml", "host": "hosts.toml"}
HOST_CALIBRATION_TABLES = ("offload_efficiency", "measured")  # tables a host file may hold beside its fields
GPU_CALIBRATION_TABLES = ("efficiency", "measured")  # tables a GPU (device) file may hold beside its fields


@cache
def _preset_tables(file_name: str) -> dict[str, dict[str, Any]]:
    text = resources.files("moetide.specs").joinpath("presets", file_name).read_text(encoding="utf-8")
    return tomllib.loads(text)


def _alias_map(file_name: str) -> dict[str, str]:
    """lower-case name or alias -> canonical preset name."""
    names: dict[str, str] = {}
    for name, table in _preset_tables(file_name).items():
        for key in (name, *table.get("aliases", ())):
            names[key.lower()] = name
    return names


def preset_names(kind: str) -> list[str]:
    """Canonical preset names for kind 'model', 'gpu' or 'host', in file order."""
    return list(_preset_tables(_PRESET_FILES[kind]))


def is_preset(kind: str, name_or_path: str) -> bool:
    """Whether ``name_or_path`` names one of kind's presets (or an alias of one) rather than a file."""
    return _alias_map(_PRESET_FILES[kind]).get(name_or_path.lower()) is not None


def _looks_like_path(arg: str) -> bool:
    return (os.sep in arg or "/" in arg or arg.lower().endswith((".json", ".toml")) or Path(arg).exists())


def _unknown(kind: str, arg: str, file_hint: str) -> UserError:
    names = ", ".join(preset_names(kind))
    return UserError(f"unknown {kind} {arg!r}; valid names: {names} (or give a path to {file_hint})")


# ---- models -----------------------------------------------------------------------------------------------


def _model_preset(name: str) -> ModelSpec:
    source = _preset_tables("models.toml")[name].get("source", "")
    return model_from_hf_dict(model_preset_hf_config(name), name=name,
                              origin=f"preset '{name}' (presets/models.toml)", source=source)


def model_preset_hf_config(name: str) -> dict[str, Any]:
    """The official config.json values a model preset holds (JSON nulls restored), e.g. to build the
    transformers config of the same architecture."""
    canonical = _alias_map("models.toml").get(name.lower())
    if canonical is None:
        raise _unknown("model", name, "an HF config.json")
    table = dict(_preset_tables("models.toml")[canonical])
    table.pop("source", None)
    for key in table.pop("null_fields", ()):
        table[key] = None
    return table


def get_model(name_or_path: str) -> ModelSpec:
    """A preset model by name (case-insensitive), or a user's HF config.json (or its checkpoint folder) by path."""
    canonical = _alias_map("models.toml").get(name_or_path.lower())
    if canonical is not None:
        return _model_preset(canonical)
    if _looks_like_path(name_or_path):
        return model_from_hf_config_file(name_or_path)
    raise _unknown("model", name_or_path, "an HF config.json")


# ---- hardware ---------------------------------------------------------------------------------------------


def _field_kind(field: dataclasses.Field) -> str:
    return field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))


def _check_value(origin: str, key: str, kind: str, value: Any) -> None:
    if kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
        raise UserError(f"{origin}: field '{key}': expected an integer, got {value!r}")
    if kind == "float" and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise UserError(f"{origin}: field '{key}': expected a number, got {value!r}")
    if kind == "str" and not isinstance(value, str):
        raise UserError(f"{origin}: field '{key}': expected a string, got {value!r}")


def spec_from_table(cls: type[SpecT], table: dict[str, Any], name: str, origin: str) -> SpecT:
    """Build a HardwareSpec or HostSpec from a flat table; unknown, missing or mistyped fields are UserErrors."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = {k: v for k, v in table.items() if k not in _PRESET_META_KEYS or k == "source"}
    values.setdefault("name", name)
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise UserError(f"{origin}: unknown field(s) {unknown}; valid fields: {sorted(fields)}")
    required = [n for n, f in fields.items() if f.default is dataclasses.MISSING]
    missing = [n for n in required if n not in values]
    if missing:
        raise UserError(f"{origin}: missing field(s) {missing}")
    for key, value in values.items():
        _check_value(origin, key, _field_kind(fields[key]), value)
    values.setdefault("source", origin)
    try:
        return cls(**values)
    except ValueError as exc:
        raise UserError(f"{origin}: {exc}") from None


def _read_hardware_file(path: Path) -> dict[str, Any]:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise UserError(f"{path}: cannot read hardware file: {exc.strerror or exc}") from None
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(raw.decode("utf-8"))
        else:
            data = tomllib.loads(raw.decode("utf-8"))
    except (json.JSONDecodeError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: not valid {'JSON' if path.suffix.lower() == '.json' else 'TOML'}: {exc}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a table of fields at the top level")
    return data


def _split_tables(data: dict[str, Any], origin: str,
                  table_names: tuple[str, ...]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(the spec's fields, the calibration tables) of a hardware file; each calibration table must be a table of
    numbers, strings or booleans."""
    fields = {k: v for k, v in data.items() if k not in table_names}
    tables: dict[str, dict[str, Any]] = {}
    for name in table_names:
        table = data.get(name, {})
        if not isinstance(table, dict):
            raise UserError(f"{origin}: '{name}' must be a table ([{name}]), got {table!r}")
        for key, value in table.items():
            if not isinstance(value, (int, float, str, bool)):
                raise UserError(f"{origin}: field '{name}.{key}': expected a number, string or boolean, "
                                f"got {value!r}")
        tables[name] = dict(table)
    return fields, tables


def _get_hardware(cls: type[SpecT], kind: str, name_or_path: str) -> SpecT:
    file_name = _PRESET_FILES[kind]
    canonical = _alias_map(file_name).get(name_or_path.lower())
    if canonical is not None:
        table = _preset_tables(file_name)[canonical]
        return spec_from_table(cls, table, canonical, f"preset '{canonical}' (presets/{file_name})")
    if _looks_like_path(name_or_path):
        path = Path(name_or_path)
        data = _split_tables(_read_hardware_file(path), str(path), _CALIBRATION_TABLES[kind])[0]
        return spec_from_table(cls, data, path.stem, str(path))
    raise _unknown(kind, name_or_path, "a .toml or .json file with the same fields")


def get_gpu(name_or_path: str) -> HardwareSpec:
    """A preset GPU by name or alias (case-insensitive), or a user's TOML/JSON file by path."""
    return _get_hardware(HardwareSpec, "gpu", name_or_path)


def get_host(name_or_path: str) -> HostSpec:
    """A preset host CPU by name (case-insensitive), or a user's TOML/JSON file by path."""
    return _get_hardware(HostSpec, "host", name_or_path)


def host_for(cpu: str | None, gpu: HardwareSpec) -> str:
    """The host CPU (a preset name or file) beside ``gpu``: ``cpu`` when given, else the GPU's own ``host``."""
    if cpu:
        return cpu
    if not gpu.host:
        raise UserError(f"--cpu: {gpu.name} names no host CPU (no 'host' field); give --cpu NAME|FILE")
    return gpu.host


def get_host_calibration(name_or_path: str) -> dict[str, dict[str, Any]]:
    """The calibration tables of a host file, ``{"offload_efficiency": {...}, "measured": {...}}`` (empty tables
    when the file has none); both empty for a preset, which is not a measurement. The HostSpec fields are checked
    too, so a file this accepts is one ``get_host`` accepts. Values are checked for type only: which names
    ``offload_efficiency`` may hold is ``moetide.perf.calibrate``'s business."""
    get_host(name_or_path)
    return _calibration_tables("host", name_or_path)


def get_gpu_calibration(name_or_path: str) -> dict[str, dict[str, Any]]:
    """The calibration tables of a GPU file, ``{"efficiency": {...}, "measured": {...}}``, as
    ``get_host_calibration`` reads a host file's; both empty for a preset."""
    get_gpu(name_or_path)
    return _calibration_tables("gpu", name_or_path)


_CALIBRATION_TABLES = {"gpu": GPU_CALIBRATION_TABLES, "host": HOST_CALIBRATION_TABLES}


def _calibration_tables(kind: str, name_or_path: str) -> dict[str, dict[str, Any]]:
    names = _CALIBRATION_TABLES[kind]
    if is_preset(kind, name_or_path):
        return {name: {} for name in names}
    path = Path(name_or_path)
    return _split_tables(_read_hardware_file(path), str(path), names)[1]


def all_models() -> list[ModelSpec]:
    return [get_model(n) for n in preset_names("model")]


def all_gpus() -> list[HardwareSpec]:
    return [get_gpu(n) for n in preset_names("gpu")]


def all_hosts() -> list[HostSpec]:
    return [get_host(n) for n in preset_names("host")]

