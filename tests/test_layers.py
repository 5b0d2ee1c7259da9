"""The package's layers import only downwards (DESIGN.md): the import graph by layer, checked on the source.

A layer is a top-level package of ``moetide`` (``errors`` and ``units`` are everyone's). Each may import only the layers listed
for it here; docs/layers.md shows the same table. A new upward import (``perf`` reaching into ``engine``, the
``core`` importing anything but the standard library) fails this test and names the file and line.
"""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "moetide"
SHARED = {"errors", "units"}  # stdlib-only modules every layer may import, the core included
ALLOWED = {
    "errors": set(),
    "units": set(),
    "specs": {"errors"},
    "perf": {"errors", "specs"},
    "core": set(),
    "workloads": {"errors"},
    "sim": {"errors", "specs", "perf", "core", "workloads"},
    "engine": {"errors", "specs", "perf", "core"},
    "serve": {"errors", "specs", "perf", "core", "workloads", "engine"},
    "vllm": {"errors", "specs", "perf", "core", "workloads", "engine"},
    "report": {"errors", "sim"},
    "commands": {"errors", "specs", "perf", "core", "workloads", "sim", "engine", "serve", "vllm", "report"},
    "cli": {"errors", "commands"},
    "__init__": set(),
}


def imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else (
            [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        for name in names:
            if name.startswith("moetide."):
                yield node.lineno, name.split(".")[1]


def test_every_import_goes_down_a_layer():
    upward = []
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC).parts
        layer = parts[0] if len(parts) > 1 else path.stem
        assert layer in ALLOWED, f"{path}: layer {layer!r} is not in the table (tests/test_layers.py, docs/layers.md)"
        upward += [f"{path.relative_to(SRC)}:{line} imports moetide.{target}"
                   for line, target in imports(path)
                   if target != layer and target not in ALLOWED[layer] and target not in SHARED]
    assert not upward, "imports against the layers:\n" + "\n".join(upward)
