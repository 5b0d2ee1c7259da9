"""``moetide serve``: an OpenAI-compatible HTTP server on the engine (being built; see issue 19)."""

from __future__ import annotations

import argparse

from moetide.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="DIR", help="HF checkpoint directory")


def run(args: argparse.Namespace) -> int:
    raise UserError("serve is not built yet")
