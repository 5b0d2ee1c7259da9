"""A one-line progress bar on stderr for long replays; silent when stderr is not a terminal (logs stay clean)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    def __init__(self, label: str, stream: TextIO | None = None, min_interval_s: float = 0.2) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self.min_interval_s = min_interval_s
        self._last = 0.0
        self._start = time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last < self.min_interval_s and done < total:
            return
        self._last = now
        share = done / total if total else 1.0
        filled = int(30 * share)
        self.stream.write(f"\r{self.label} [{'#' * filled}{'.' * (30 - filled)}] {done:,}/{total:,} "
                          f"{now - self._start:5.1f}s")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()
