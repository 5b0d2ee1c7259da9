"""User-facing errors.

``UserError`` is raised for bad input a person can fix (a malformed config or trace line, an impossible memory
budget). The CLI prints its message on one line and exits with code 2; it never shows a traceback for it.
Messages name the file, line or field at fault.
"""


class UserError(Exception):
    """Bad input a person can act on; the CLI turns it into one line on stderr and exit code 2."""
