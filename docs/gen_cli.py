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


def main(argv: list[str] | None = None) -> int:
    """``python docs/gen_cli.py [--check]``: write docs/cli.md, or (``--check``) only say whether
    it is current (exit 1 when it is stale); ``--help`` says so and writes nothing."""
    parser = argparse.ArgumentParser(prog="python docs/gen_cli.py",
                                     description="Regenerate docs/cli.md from the real --help output of mlxcc.")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when docs/cli.md is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = OUT.exists() and OUT.read_text() == text
        sys.stdout.write(f"{OUT} is {'current' if current else 'stale: run python docs/gen_cli.py'}\n")
        return 0 if current else 1
    OUT.write_text(text)
    sys.stdout.write(f"wrote {OUT}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
