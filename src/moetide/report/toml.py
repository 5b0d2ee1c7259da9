"""TOML text for the files moetide writes (host and device files): one ``key = value`` line with an aligned comment.
tomllib reads but does not write TOML; these files are flat tables of numbers and strings, so a line writer is
all they need."""

from __future__ import annotations

from typing import Any


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        text = f"{value:.6g}"
        return text if any(ch in text for ch in ".en") else text + ".0"
    text = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return '"' + "".join(ch if ch.isprintable() else " " for ch in text) + '"'


def toml_line(key: str, value: Any, comment: str = "") -> str:
    text = f"{key} = {toml_value(value)}"
    return f"{text:<43} # {comment}" if comment else text
