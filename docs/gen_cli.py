"""Regenerate docs/cli.md from the real ``--help`` output: ``python docs/gen_cli.py``.

tests/test_docs.py fails when docs/cli.md is stale, so the reference never drifts
from the code.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

OUT = Path(__file__).with_name("cli.md")


def _help(parser: argparse.ArgumentParser) -> str:
    os.environ["COLUMNS"] = "100"  # stable wrapping
    return parser.format_help().rstrip()


def _subparsers(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.items()


def render() -> str:
    from mlx_chatcache.cli.main import build_parser

    root = build_parser()
    parts = ["# mlxcc command reference", "",
             "Generated from `--help` by `python docs/gen_cli.py`; do not edit by hand.", "",
             "```", _help(root), "```"]
    for name, sub in _subparsers(root):
        nested = list(_subparsers(sub))
        for full, parser in [(name, sub)] + [(f"{name} {n}", p) for n, p in nested]:
            parts += ["", f"## mlxcc {full}", "", "```", _help(parser), "```"]
    parts += _chat_commands()
    return "\n".join(parts) + "\n"


def _chat_commands() -> list[str]:
    """What ``/help`` prints inside ``mlxcc chat``."""
    from mlx_chatcache.cli.repl import HELP

    return ["", "## Commands inside mlxcc chat (/help)", "", "```", HELP.rstrip(), "```"]


if __name__ == "__main__":
    OUT.write_text(render())
    sys.stdout.write(f"wrote {OUT}\n")
