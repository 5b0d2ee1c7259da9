"""The README's two set-up commands stay true: CI runs the test command word for word, and the main job is a
command the CLI accepts, on the built-in workload (no trace), with its plot."""

import re
import shlex
from pathlib import Path

from moetide.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]


def setup_commands() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Set up"):text.index("## Commands")]
    return re.findall(r"```bash\n(.+?)\n```", section)


def test_ci_runs_the_readme_test_command_word_for_word():
    main_job, tests = setup_commands()
    assert tests.endswith(".venv/bin/python -m pytest -q")
    assert tests in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()


def test_the_main_job_is_a_valid_command_on_the_built_in_workload():
    main_job, _ = setup_commands()
    words = shlex.split(main_job.split("&&")[-1])
    assert words[0] == ".venv/bin/moetide"
    args = build_parser(words[1]).parse_args(words[1:])
    assert args.verb == "compare" and args.trace is None and args.plot is not None
    assert args.policies == "vllm,vamp"
