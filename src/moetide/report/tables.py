"""Plain-text tables for terminal output, shared by every verb.

Invariant: the output is a pure function of its arguments (no terminal-width probing, no colour), so the same
inputs give the same bytes and tests can compare it exactly. Columns are separated by two spaces, the header is
underlined with dashes, and no line ends in whitespace. Cells are rendered with ``str`` (``None`` as ``-``);
callers format numbers themselves, because only they know the unit.
"""

from __future__ import annotations

from collections.abc import Sequence

ALIGNS = ("<", ">")
COLUMN_GAP = "  "


def _cell(value: object) -> str:
    return "-" if value is None else str(value)


def _looks_numeric(value: object) -> bool:
    """int/float, or text that starts like a number ("1.5 GiB", "-3", "48 (12/36)")."""
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)):
        return True
    text = _cell(value).lstrip("+-")
    return bool(text) and (text[0].isdigit() or text == "-")


def _default_align(rows: Sequence[Sequence[object]], num_columns: int) -> list[str]:
    """Right-align a column when every non-empty cell in it looks numeric; the first column stays left."""
    aligns = ["<"] * num_columns
    for col in range(1, num_columns):
        cells = [row[col] for row in rows if row[col] is not None]
        if cells and all(_looks_numeric(c) for c in cells):
            aligns[col] = ">"
    return aligns


def format_table(
    headers: Sequence[str], rows: Sequence[Sequence[object]], align: Sequence[str] | str | None = None
) -> str:
    """Render ``rows`` under ``headers``. ``align`` is one of "<" (left) or ">" (right) per column, given as a
    sequence or a string such as "<>>"; by default numeric-looking columns are right-aligned."""
    num_columns = len(headers)
    for index, row in enumerate(rows):
        if len(row) != num_columns:
            raise ValueError(f"format_table: row {index} has {len(row)} cells, expected {num_columns}")
    aligns = list(align) if align is not None else _default_align(rows, num_columns)
    if len(aligns) != num_columns or any(a not in ALIGNS for a in aligns):
        raise ValueError(f"format_table: align must give one of {ALIGNS} per column ({num_columns}), got {align!r}")
    text_rows = [[_cell(c) for c in row] for row in rows]
    widths = [max([len(headers[c])] + [len(r[c]) for r in text_rows]) for c in range(num_columns)]

    def line(cells: Sequence[str]) -> str:
        parts = [f"{cell:{a}{w}}" for cell, a, w in zip(cells, aligns, widths, strict=True)]
        return COLUMN_GAP.join(parts).rstrip()

    out = [line(list(headers)), line(["-" * w for w in widths])]
    out.extend(line(r) for r in text_rows)
    return "\n".join(out)
