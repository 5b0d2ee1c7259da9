"""User-facing errors.

``UserError`` is raised for bad input a person can fix (a malformed config or trace line, an impossible memory
budget). The CLI prints its message on one line and exits with code 2; it never shows a traceback for it.
Messages name the file, line or field at fault.
"""

from __future__ import annotations

import json
from pathlib import Path


class UserError(Exception):
    """Bad input a person can act on; the CLI turns it into one line on stderr and exit code 2."""


def read_json(path: str | Path, where: str) -> object:
    """A JSON file's value, or one ``UserError`` starting with ``where`` (the option and path at fault)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise UserError(f"{where}: cannot read: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise UserError(f"{where}: not JSON ({exc})") from None
