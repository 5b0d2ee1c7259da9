"""``moetide bench-serve``: replay a recorded trace in real time against an OpenAI-compatible server (being built)."""

from __future__ import annotations

import argparse

from moetide.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", metavar="TRACE", help="recorded trace file")
    parser.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")


def run(args: argparse.Namespace) -> int:
    raise UserError("bench-serve is not built yet")
