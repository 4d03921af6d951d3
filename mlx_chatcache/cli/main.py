"""``mlxcc`` entry point: dispatches to one module per subcommand.

Each subcommand module exposes ``add_parser(subparsers)`` and ``run(args) -> int``.
Every error we raise on purpose (:class:`ChatCacheError`) and every bad flag is
reported as ONE line on stderr with a non-zero exit code, never a traceback.
"""

from __future__ import annotations

import argparse
import sys

from ..errors import ChatCacheError
from .common import check_utf8_args

SUBCOMMANDS = ("generate", "cache_prompt", "chat", "cache_info", "sessions", "doctor", "serve")


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are a single line on stderr (exit 2)."""

    def error(self, message: str):  # noqa: D401 - argparse API
        sys.stderr.write(f"{self.prog}: error: {message} (see '{self.prog} --help')\n")
        sys.exit(2)

    def _get_values(self, action, arg_strings):
        """As argparse's, but ``--flag=--`` gives a one-value flag the text "--" for its
        type to judge (argparse drops it as the end of options, leaving the flag ``[]``)."""
        if action.option_strings and action.nargs is None and arg_strings == ["--"]:
            value = self._get_value(action, "--")
            self._check_value(action, value)
            return value
        return super()._get_values(action, arg_strings)


def build_parser() -> OneLineParser:
    import importlib

    parser = OneLineParser(
        prog="mlxcc",
        description="Multi-turn LLM work on MLX that never pays twice for the same tokens.",
    )
    from ..config import VERSION

    parser.add_argument("--version", action="version", version=f"mlxcc {VERSION}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    for name in SUBCOMMANDS:
        module = importlib.import_module(f".{name}", __package__)
        module.add_parser(sub)
    _no_abbreviations(parser)
    return parser


def _no_abbreviations(parser: argparse.ArgumentParser) -> None:
    """No parser takes a prefix of a long flag (``--prompt-cache`` silently meant
    ``--prompt-cache-file``): every flag is typed in full, as documented."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _no_abbreviations(child)


def chosen_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The innermost (sub)parser the parsed ``args`` went through (``mlxcc sessions show``'s, say)."""
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        name = getattr(args, subs[0].dest, None) if subs else None
        if name is None or name not in subs[0].choices:
            return parser
        parser = subs[0].choices[name]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:  # said by the subcommand's parser, so the hint names its --help
        chosen_parser(parser, args).error(f"unrecognized arguments: {' '.join(extras)}")
    if not getattr(args, "run", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        check_utf8_args(args)
        return args.run(args) or 0
    except ChatCacheError as e:
        sys.stderr.write(f"mlxcc: error: {e}\n")
        return 1
    except ImportError as e:
        if "mlx" not in f"{e.name} {e}":
            raise
        sys.stderr.write(f"mlxcc: error: MLX cannot load here ({e}); on Linux install it with a backend: "
                         "pip install 'mlx-chatcache[cpu]', or 'mlx-chatcache[cuda]' for an NVIDIA GPU\n")  # fmt: skip
        return 1
    except KeyboardInterrupt:
        sys.stderr.write("mlxcc: interrupted\n")
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
