"""Every verb's ``--help`` works in an environment without torch (the README's first set-up command installs
none): the parsers read only torch-free modules, and a verb imports torch when it runs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from moetide.cli import VERBS

BLOCK_TORCH = "import sys; sys.modules['torch'] = None; from moetide.cli import main; sys.exit(main())"


@pytest.mark.parametrize("verb", list(VERBS))
def test_help_needs_no_torch(verb):
    done = subprocess.run([sys.executable, "-c", BLOCK_TORCH, verb, "--help"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(f"usage: moetide {verb}")
