"""The `maco` command. Each subcommand lives in maco/commands/<name>.py and exposes
`register(subparsers)`; user errors (MacoError) print one line and exit 2, never a traceback."""
from __future__ import annotations

import argparse
import importlib
import sys
import warnings
from typing import NoReturn

from maco.core.errors import MacoError

COMMANDS = ["layers", "collect", "space", "bound", "plan", "tune", "optimize", "reproduce", "bench", "cim"]


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line (the usage is one --help away), like every
    other user error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="maco", description="MACO: memory-aware tuning of CNN convolutions "
        "(I/O lower bounds, pruned schedule search, layout planning).")
    from maco import __version__
    parser.add_argument("--version", action="version", version=f"maco {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"maco.commands.{name}").register(sub)
    return parser


def _one_line_warning(message, category, filename, lineno, line=None) -> str:  # noqa: ANN001
    return f"maco: warning: {message}\n"


def main(argv: list[str] | None = None) -> int:
    warnings.formatwarning = _one_line_warning  # e.g. skipped record lines: said, not dumped
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a bad argument argparse has explained
        return int(exc.code or 0)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except MacoError as exc:
        print(f"maco {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"maco {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
